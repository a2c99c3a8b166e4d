"""The stencil family (`tridist.ops.stencil`): the Jacobi solver, host-loop and fused, bit for bit
against one process, and its example."""
import pytest
import torch

import tridist
from tridist.ops import Jacobi2D, jacobi_reference

from .harness import load_script

example = load_script("examples", "jacobi2d")


def _jacobi(w, local_rows, cols, block, programs):
    """Runs of both methods back to back, each going on from the last (tiles of BLOCK_R x BLOCK_C
    that divide neither the rank's rows nor its columns, fewer programs than tiles), equal to one
    process after every run. (The example loads the state again between methods.)"""
    rows = local_rows * w.world_size
    domain = example.initial_domain(rows, cols)
    mine = slice(1 + w.rank * local_rows, 1 + (w.rank + 1) * local_rows)
    solver = Jacobi2D(rows, cols, programs=programs, block=block)
    assert solver.tiles > programs, "the fused kernel's programs stride over several tiles"
    solver.load(domain)
    done = 0
    for method, iterations in (("fused", 2), ("host_loop", 1), ("fused", 1)):
        got = solver.run(iterations, method)
        done += iterations
        expected = jacobi_reference(domain, done)[mine].to(w.device)
        assert torch.equal(got, expected), (method, done, (got - expected).abs().max().item())
    tridist.barrier_all()
    solver.free()


@pytest.mark.worlds("1", "2", "3", "4", "2x2")
def test_jacobi_matches_one_process(world):
    world.run(_jacobi, local_rows=3, cols=10, block=(2, 8), programs=3)


def _example(w):
    differences = example.solve(w, rows=4 * w.world_size, cols=16, iterations=3)
    assert differences == {"host_loop": 0.0, "fused": 0.0}, differences


@pytest.mark.worlds("1", "2", "3", "4", "2x2")
def test_jacobi_example(world):
    world.run(_example)


def _bad_input(w):
    with pytest.raises(ValueError, match="multiple of the world size"):
        Jacobi2D(2 * w.world_size + 1, 8)
    with pytest.raises(ValueError, match="positive int cols"):
        Jacobi2D(w.world_size, 0)
    solver = Jacobi2D(2 * w.world_size, 8)
    shape = rf"\({2 * w.world_size + 2}, 10\)"
    with pytest.raises(ValueError, match=r"whole float32 domain with its boundary, " + shape):
        solver.load(torch.zeros(2 * w.world_size, 8))
    with pytest.raises(ValueError, match="unknown method 'pipelined'"):
        solver.run(1, "pipelined")
    with pytest.raises(ValueError, match="positive int number of iterations"):
        solver.run(0)
    solver.free()


@pytest.mark.worlds("2")
def test_jacobi_bad_input(world):
    world.run(_bad_input)
