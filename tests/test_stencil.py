"""The stencil family (`tridist.ops.stencil`): the Jacobi solver, host-loop and fused, bit for bit
against one process, and its example."""
import pytest
import torch

import tridist
from tridist.ops import Jacobi2D, jacobi_reference

from .harness import group_layouts, join_groups, load_script

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


def _jacobi_in_groups(w, layout):
    """A solver within each group of `layout` at once, each on its own domain and sizes, with a
    different number of host-loop iterations (its barriers the group's: a barrier of the world
    would hang), then fused ones; exact against one process after every run."""
    index, members, made = join_groups(layout)
    me, local_rows, cols = members.index(w.rank), 2 + index, 9 + index
    rows = local_rows * len(members)
    domain = example.initial_domain(rows, cols) + 10 * index  # each group's own values, boundary included
    solver = Jacobi2D(rows, cols, programs=2, block=(2, 8), group=made[index])
    solver.load(domain)
    done = 0
    for method, iterations in (("host_loop", 2 + index), ("fused", 2)):
        got = solver.run(iterations, method)
        done += iterations
        expected = jacobi_reference(domain, done)[1 + me * local_rows:1 + (me + 1) * local_rows].to(w.device)
        assert torch.equal(got, expected), (members, method, done, (got - expected).abs().max().item())
    other = made[(index + 1) % len(made)]  # a group this rank is not in: refused before anything is allocated
    with pytest.raises(ValueError, match=f"rank {w.rank} is not a member"):
        Jacobi2D(rows, cols, group=other)
    if len(members) > 1:
        with pytest.raises(ValueError, match="multiple of the group's size"):
            Jacobi2D(rows + 1, cols, group=made[index])
    tridist.barrier_all(made[index])
    solver.free()
    tridist.barrier_all()


@pytest.mark.parametrize("layout", group_layouts())
def test_jacobi_in_groups(world, layout):
    world.run(_jacobi_in_groups, layout=layout)


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
