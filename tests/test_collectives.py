"""all_gather, reduce_scatter and all_reduce: every method, several dtypes and shapes, random data,
poisoned outputs, back-to-back calls with no host synchronisation in between."""
import pytest
import torch

import tridist
from tridist import ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}  # relative, vs an fp64 sum


def _inputs(w, shape, dtype, call):
    """Every rank's input for one call, the same on every rank (so each can build the reference)."""
    g = torch.Generator().manual_seed(1000 * call + 7)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(w.world_size)]


def _poisoned(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _all_gather(w, method, dtype, shape, calls):
    if method in ("ll", "ce") and w.nnodes > 1:
        with pytest.raises(ValueError, match="within one node"):
            ops.AllGather(int(torch.Size(shape).numel()), dtype, method)
        return
    op = ops.AllGather(int(torch.Size(shape).numel()), dtype, method)
    everyone = [_inputs(w, shape, dtype, call) for call in range(calls)]
    outs = [_poisoned((w.world_size * shape[0], *shape[1:]), dtype, w.device) for _ in range(calls)]
    sources = [e[w.rank].to(w.device) for e in everyone]
    for call in range(calls):  # back to back: no barrier, no host synchronisation
        op(sources[call], outs[call])
    for call in range(calls):
        assert torch.equal(outs[call].cpu(), torch.cat(everyone[call])), f"call {call}"
    tridist.barrier_all()
    op.free()


@pytest.mark.parametrize("method", ["push", "ll", "ce"])
def test_all_gather(world, method):
    for dtype, shape in [(torch.float32, (37, 3)), (torch.bfloat16, (64,)), (torch.float16, (2, 130))]:
        world.run(_all_gather, method=method, dtype=dtype, shape=shape, calls=4)


def _all_gather_auto(w):
    x = torch.arange(10, dtype=torch.float32, device=w.device) + 100 * w.rank
    out = ops.all_gather(x)
    expected = torch.cat([torch.arange(10, dtype=torch.float32) + 100 * r for r in range(w.world_size)])
    assert torch.equal(out.cpu(), expected)
    assert ops.all_gather(x) is not out, "a new output each call unless out= is given"


def test_all_gather_auto(world):
    world.run(_all_gather_auto)


def _reduce_scatter(w, dtype, rows, calls):
    shape = (w.world_size * rows, 3)
    op = ops.ReduceScatter(shape[0] * shape[1], dtype)
    everyone = [_inputs(w, shape, dtype, call) for call in range(calls)]
    outs = [_poisoned((rows, 3), dtype, w.device) for _ in range(calls)]
    for call in range(calls):
        op(everyone[call][w.rank].to(w.device), outs[call])
    for call in range(calls):
        reference = sum(x.double() for x in everyone[call])[w.rank * rows:(w.rank + 1) * rows]
        torch.testing.assert_close(outs[call].cpu().double(), reference, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    tridist.barrier_all()
    op.free()


@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_scatter(world, dtype):
    world.run(_reduce_scatter, dtype=dtype, rows=45, calls=3)


def _all_reduce(w, method, dtype, numel, calls, in_place):
    op = ops.AllReduce(numel, dtype, method)
    everyone = [_inputs(w, (numel,), dtype, call) for call in range(calls)]
    outs = []
    for call in range(calls):
        x = everyone[call][w.rank].to(w.device).clone()
        out = x if in_place else _poisoned((numel,), dtype, w.device)
        outs.append(op(x, out))
    for call in range(calls):
        reference = sum(x.double() for x in everyone[call])
        torch.testing.assert_close(outs[call].cpu().double(), reference, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    tridist.barrier_all()
    op.free()


@pytest.mark.parametrize("method", ["one_shot", "two_shot"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce(world, method, dtype):
    world.run(_all_reduce, method=method, dtype=dtype, numel=301, calls=3, in_place=False)


def test_all_reduce_in_place(world):
    world.run(_all_reduce, method="auto", dtype=torch.float32, numel=64, calls=2, in_place=True)


def _bad_input(w):
    x = torch.zeros(8, device=w.device)
    with pytest.raises(ValueError, match="dtype"):
        ops.all_gather(torch.zeros(8, dtype=torch.int64, device=w.device))
    with pytest.raises(ValueError, match="contiguous"):
        ops.all_reduce(torch.zeros(4, 4, device=w.device).t())
    with pytest.raises(ValueError, match="unknown method"):
        ops.all_gather(x, method="carrier-pigeon")
    with pytest.raises(ValueError, match="out must be"):
        ops.all_gather(x, out=torch.empty(3, device=w.device))
    with pytest.raises(ValueError, match="multiple of the world size|multiple of world_size"):
        ops.reduce_scatter(torch.zeros(w.world_size * 4 + 1, device=w.device))
    op = ops.AllReduce(8, torch.float32)
    with pytest.raises(ValueError, match="built for 8"):
        op(torch.zeros(9, device=w.device))
    op.free()


def test_bad_input_fails_before_launch(world):
    if world.size > 1:  # (world_size * 4 + 1 is a multiple of 1)
        world.run(_bad_input)
