"""A bad argument on one rank is an error on every rank, at once, with the same message naming the
rank and what it passed (`checks.agree`), in the emulator and on GPUs with or without
TRIDIST_DEBUG; never a peer left waiting, never an internal buffer's name. And expert ids out of
range are never wrong data: refused where the host reads them, treated as -1 and counted where it
does not (GPUs without debug, and CUDA-graph captures)."""
import time

import pytest
import torch

import tridist
from tridist import ops
from tridist.ops import checks
from tridist.runtime import config
from tridist.runtime.world import transport

FAST_S = 10.0  # an error agreed by every rank comes at once; a rank left waiting would take the wait timeout


def _raises_everywhere(call, match: str) -> None:
    started = time.monotonic()
    with pytest.raises(ValueError, match=match):
        call()
    assert time.monotonic() - started < FAST_S, f"took {time.monotonic() - started:.1f} s"


def _one_rank_wrong(w):
    """Found 1: a rank with no rows to send (x of 0 rows) where its peer has rows; a dtype, a method
    and an out shape wrong on rank 0 only; a shape that differs, which used to surface as an
    internal buffer's SymmetricAllocationError (`int64[2, 4096]`)."""
    rows = 0 if w.rank == 0 else 4
    splits = torch.zeros(w.world_size, dtype=torch.int64, device=w.device)
    out = torch.zeros((4 * w.world_size, 2), device=w.device)
    _raises_everywhere(lambda: ops.all_to_all_v(torch.zeros((rows, 2), device=w.device), splits, out),
                       r"all_to_all_v \(rank layout\): ranks passed different shape of x \(rank 0: \(0, 2, 'float32'\)"
                       r", rank 1: \(4, 2, 'float32'\)")
    x = torch.zeros(8, dtype=torch.float64 if w.rank == 0 else torch.float32, device=w.device)
    _raises_everywhere(lambda: ops.all_gather(x), r"^all_gather: rank 0: x has dtype torch.float64")
    x = torch.zeros(8, device=w.device)
    _raises_everywhere(lambda: ops.all_reduce(x, method="fast" if w.rank == 0 else "auto"),
                       r"^all_reduce: rank 0: all_reduce: unknown method 'fast'")
    out = torch.zeros(8 * w.world_size + (w.rank == 1), device=w.device)
    _raises_everywhere(lambda: ops.all_gather(x, out), r"^all_gather: rank 1: out must be torch.float32 of shape")
    x = torch.zeros(8 + w.rank, device=w.device)
    _raises_everywhere(lambda: ops.all_gather(x), r"all_gather: ranks passed different shape and dtype of x "
                                                  r"\(rank 0: \(8, 'float32'\), rank 1: \(9, 'float32'\)")
    _raises_everywhere(lambda: ops.reduce_scatter(torch.zeros(4 * (1 + w.rank), device=w.device)),
                       r"reduce_scatter: ranks passed different shape and dtype of x")
    # Both ranks wrong, in different ways: each rank's message, with its rank.
    _raises_everywhere(lambda: ops.all_gather(torch.zeros(4, dtype=torch.float64, device=w.device)
                                              if w.rank == 0 else torch.zeros(4, device=w.device)[::2]),
                       r"rank 0: x has dtype torch.float64.*; rank 1: x is not contiguous")
    tridist.barrier_all()


def _gather_objects(w):
    """The host gather the checks run on: any picklable value, long ones in several rounds."""
    values = [("rank", rank, "x" * 700 * rank) for rank in range(w.world_size)]
    assert transport().allgather_objects(values[w.rank]) == values
    assert transport().allgather_objects(None) == [None] * w.world_size


@pytest.mark.worlds("2")
def test_one_rank_wrong_fails_everywhere_at_once(world):
    world.run(_gather_objects)
    world.run(_one_rank_wrong)


class _CountedGathers:
    """`agree` as on a GPU without TRIDIST_DEBUG (the emulator and debug checks off), counting its
    host gathers."""

    def __init__(self, monkeypatch):
        self.count = 0
        gather = transport().allgather_objects

        def counted(value):
            self.count += 1
            return gather(value)

        monkeypatch.setattr(checks, "is_emulator", lambda: False)
        monkeypatch.setattr(config, "debug", lambda: False)
        monkeypatch.setattr(transport(), "allgather_objects", counted)


def _first_call_of_a_shape(w):
    """On GPUs without TRIDIST_DEBUG the ranks check together at the first call of each new shape
    (which builds an instance, a collective anyway), and later calls cost no host round trip."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        gathers = _CountedGathers(monkeypatch)
        checks._agreed.clear()
        x = torch.zeros(8 + (w.rank == 0), device=w.device)
        with pytest.raises(ValueError, match="ranks passed different shape and dtype of x"):
            ops.all_gather(x)
        assert gathers.count == 1
        x = torch.full((8,), float(w.rank), device=w.device)
        for _ in range(3):
            assert torch.equal(ops.all_gather(x).cpu(), torch.arange(w.world_size).float().repeat_interleave(8))
        assert gathers.count == 3  # the function's check and its new instance's, at the first call only
    tridist.barrier_all()


@pytest.mark.worlds("2")
def test_ranks_check_together_at_the_first_call_of_a_shape(world):
    world.run(_first_call_of_a_shape)


EXPERTS_PER_RANK, HIDDEN, TOKENS, TOPK = 2, 64, 4, 2


def _expert_ids_out_of_range(w, low_latency):
    """Ids past the last expert or below -1, with the host's check bypassed as on a GPU: the tokens
    are not sent to those experts (as -1), the combine is right for the rest, and the ids are
    counted in `dropped_expert_ids`."""
    experts = EXPERTS_PER_RANK * w.world_size
    generator = torch.Generator().manual_seed(w.rank)
    idx = torch.rand(TOKENS, experts, generator=generator).argsort(1)[:, :TOPK].contiguous()
    idx[0, 0], idx[2, 1], idx[3, 0] = experts, -5, experts + 7
    weights = torch.rand(TOKENS, TOPK, generator=generator)
    x = (w.rank * 100 + torch.arange(TOKENS)[:, None] + torch.arange(HIDDEN)[None, :] / 256).to(torch.bfloat16)
    valid = (idx >= 0) & (idx < experts)
    expected = x.float() * torch.where(valid, weights, 0).sum(1, keepdim=True)  # identity experts
    buffer = ops.EPBuffer(experts, HIDDEN, TOKENS)
    x, idx, weights = x.to(w.device), idx.to(w.device), weights.to(w.device)
    if checks.host_reads(idx):  # CPU tensors, or TRIDIST_DEBUG=1
        with pytest.raises(ValueError, match="expert ids from -5 to"):
            buffer.dispatch(x, idx, weights)
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(checks, "host_reads", lambda t: False)
        if low_latency:
            recv_x, _, handle, _ = buffer.low_latency_dispatch(x, idx)
            out = buffer.low_latency_combine(recv_x, idx, weights, handle)
        else:
            recv_x, recv_idx, recv_weights, _, handle = buffer.dispatch(x, idx, weights)
            y = recv_x.float() * torch.where(recv_idx >= 0, recv_weights, 0).sum(1, keepdim=True)
            out = buffer.combine(y.to(torch.bfloat16), handle)
    error = (out.float().cpu() - expected).abs().max() / expected.abs().max()
    assert error < 2e-2, f"rank {w.rank}: relative error {error:.2e}"
    assert int(buffer.dropped_expert_ids) == 3
    tridist.barrier_all()
    buffer.free()


@pytest.mark.worlds("2")
@pytest.mark.parametrize("low_latency", [False, True])
def test_expert_ids_out_of_range_are_never_wrong_data(world, low_latency):
    world.run(_expert_ids_out_of_range, low_latency=low_latency)


def _capture_takes_no_host_collective(w):
    """Found 3 (stress call 43 across two H200s): a captured call of an all-gather into a symmetric
    out compared the ranks' tensors with a host collective, which NCCL runs by copying a pickle from
    the CPU to the GPU, refused during a capture. While a capture is on (`checks.capturing`, true
    here as on a GPU) the checks are this rank's own and no host collective runs."""
    n = 11
    op = ops.AllGather(n, torch.uint8, "auto", symmetric_out=True)
    out = tridist.symm_empty((n * w.world_size,), torch.uint8)
    x = torch.full((n,), w.rank + 1, dtype=torch.uint8, device=w.device)
    op(x, out)  # eager first, as a capture needs
    expected = torch.arange(1, w.world_size + 1, dtype=torch.uint8).repeat_interleave(n)
    out.zero_()
    tridist.barrier_all()
    with pytest.MonkeyPatch.context() as monkeypatch:

        def refuse(*args):
            raise RuntimeError("a host collective while a CUDA graph is captured")

        monkeypatch.setattr(checks, "capturing", lambda: True)
        monkeypatch.setattr(transport(), "allgather_objects", refuse)
        monkeypatch.setattr(transport(), "allgather_ints", refuse)
        assert torch.equal(op(x, out).cpu(), expected)
        with pytest.raises(ValueError, match="built for 11"):  # this rank's checks still run
            op(torch.zeros(n + 1, dtype=torch.uint8, device=w.device), out)
    tridist.barrier_all()
    op.free()
    tridist.symm_free(out)


@pytest.mark.worlds("2")
def test_capture_takes_no_host_collective(world):
    world.run(_capture_takes_no_host_collective)
