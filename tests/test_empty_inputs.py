"""Zero-size inputs are normal (a rank with no tokens is common in MoE serving): the collectives on
empty tensors on every rank are no-ops that return empty results, in every method, function and
class, eager and (on GPUs) captured in a CUDA graph; all_to_all_v with nothing to send or nowhere
to receive; EPBuffer with no tokens on a rank, both modes."""
import pytest
import torch

import tridist
from tridist import ops
from tridist.ops.collectives import allgather, allreduce, reducescatter


def _empty_collectives(w):
    for shape in ((0,), (0, 3)):
        x = torch.empty(shape, device=w.device)
        for method in allgather.METHODS:
            out = ops.all_gather(x, method=method)
            assert out.shape == (0, *shape[1:]), (method, out.shape)
        for method in reducescatter.METHODS:
            assert ops.reduce_scatter(x, method=method).shape == x.shape
        for method in allreduce.METHODS:
            assert ops.all_reduce(x, method=method).shape == x.shape
            assert ops.all_reduce_(x, method=method) is x
    symmetric = tridist.symm_empty((0,), torch.bfloat16)
    gathered = tridist.symm_empty((0,), torch.bfloat16)
    assert ops.all_reduce_(symmetric) is symmetric
    assert ops.all_gather(symmetric, gathered) is gathered
    classes = [ops.AllGather(0, torch.float32), ops.ReduceScatter(0, torch.float32), ops.AllReduce(0, torch.float32)]
    x = torch.empty(0, device=w.device)
    for op in classes:
        assert op(x).numel() == 0
    if w.device.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            results = [op(x) for op in classes]
        graph.replay()
        assert all(r.numel() == 0 for r in results)
    tridist.barrier_all()
    for op in classes:
        op.free()
    tridist.symm_free(gathered)
    tridist.symm_free(symmetric)


@pytest.mark.worlds("1", "2")
def test_empty_collectives(world):
    world.run(_empty_collectives)


def _empty_all_to_all(w):
    """x of no rows on every rank (nothing to send), and out of no rows (nothing may arrive)."""
    zeros = torch.zeros(w.world_size, dtype=torch.int64, device=w.device)
    out = torch.full((5, 2), -7.0, device=w.device)
    result = ops.all_to_all_v(torch.empty((0, 2), device=w.device), zeros, out)
    assert result.tolist() == [[0] * w.world_size] * 2
    assert (out == -7).all()  # nothing written
    result = ops.all_to_all_v(torch.ones((3, 2), device=w.device), zeros, torch.empty((0, 2), device=w.device))
    assert result.tolist() == [[0] * w.world_size] * 2
    result = ops.all_to_all_v(torch.empty((0, 2), device=w.device), zeros, torch.empty((0, 2), device=w.device))
    assert result.tolist() == [[0] * w.world_size] * 2
    tridist.barrier_all()


@pytest.mark.worlds("1", "2")
def test_empty_all_to_all_v(world):
    world.run(_empty_all_to_all)


def _no_tokens(w):
    """Every rank but the last has tokens; the last has none, and then no rank has any."""
    experts, hidden, topk = 2 * w.world_size, 64, 2
    buffer = ops.EPBuffer(experts, hidden, 4)
    for tokens in ((0 if w.rank == w.world_size - 1 else 3), 0):
        x = torch.ones((tokens, hidden), dtype=torch.bfloat16, device=w.device)
        idx = torch.arange(topk, device=w.device).repeat(tokens, 1)
        weights = torch.full((tokens, topk), 0.5, device=w.device)
        recv_x, recv_idx, recv_weights, _, handle = buffer.dispatch(x, idx, weights, sync=True)
        out = buffer.combine((recv_x.float() * recv_weights.sum(1, keepdim=True)).to(torch.bfloat16), handle)
        assert out.shape == (tokens, hidden) and (out == 1).all()
        recv_x, _, handle, _ = buffer.low_latency_dispatch(x, idx)
        out = buffer.low_latency_combine(recv_x, idx, weights, handle)
        assert out.shape == (tokens, hidden) and (out == 1).all()
    tridist.barrier_all()
    buffer.free()


@pytest.mark.worlds("2")
def test_ep_rank_without_tokens(world):
    world.run(_no_tokens)
