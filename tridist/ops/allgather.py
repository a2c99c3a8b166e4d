"""All-gather: every rank contributes a shard of n elements; every rank gets all of them, in rank
order (torch's `all_gather_into_tensor` layout: out is world_size * n elements, rank r's at r*n).

Methods
- "push": program (p, s) stores slice s of this rank's shard into row `rank` of rank p's staging
  (through p's pointer on this node, an NVSHMEM put with signal on another node) and raises p's
  flag (rank, s); it then waits for rank p's flag (p, s) here and copies that slice of row p into
  `out`. Double-buffered staging and call epochs (see `_protocol.py`) need no handshake.
- "ll": the same exchange in low-latency packets: each 4-byte word travels with the epoch as its
  flag, so there are no separate signals; for small messages on one node.
- "pull": the program (rank, s) stages slice s of this rank's shard and raises flag (rank, s) on
  every rank of the node; program (p, s) waits for rank p's flag (p, s) here and reads that slice
  of p's staging through symm_at. Reads instead of writes over NVLink; on one node.
- "ce": this rank's copy engines write its shard into row `rank` of every peer's staging, chunk by
  chunk, each chunk followed by its flag (`CopyEnginePush`); a kernel copies each chunk out to
  `out` as soon as its flag is up. No SM moves data across NVLink; one node. A barrier at the start
  of each call says every peer has finished with its staging and flags.
"""
import torch
import triton
import triton.language as tl

import tridist
import tridist.language as dl
from tridist.runtime.jit import jit

from . import _protocol
from ._protocol import (CopyEnginePush, Workspace, call_epoch, check_input, check_output, copy_slice, finish_call,
                        push_slice, row_stride, split_bounds, wait_chunks)

METHODS = ("auto", "push", "pull", "ll", "ce")
# An all-gather only moves data, so it takes raw bytes and integers as well.
DTYPES = (*_protocol.SUPPORTED, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
BLOCK = 2048
LL_BLOCK = 1024  # packets per step


@jit
def all_gather_push_kernel(x_ptr, out_ptr, staging_ptr, flags_ptr, calls_ptr, n, row, slot_numel, local_world_size,
                           splits, BLOCK: tl.constexpr):
    """Staging rows are `row` (n rounded up to 64) elements apart."""
    epoch = call_epoch(calls_ptr)
    me = dl.rank()
    peer = tl.program_id(0)
    split = tl.program_id(1)
    start, stop = split_bounds(n, split, splits, BLOCK)
    stage = staging_ptr + (epoch % 2) * slot_numel
    flags = flags_ptr + (epoch % 2) * (tl.num_programs(0) * splits)
    if peer == me:
        copy_slice(x_ptr, out_ptr + me * n, start, stop, BLOCK)
    else:
        push_slice(x_ptr, stage + me * row, start, stop, flags + me * splits + split, epoch, peer, local_world_size,
                   BLOCK)
        token = dl.wait(flags + peer * splits + split, 1, scope="sys", semantic="acquire", waitValue=epoch)
        copy_slice(dl.consume_token(stage + peer * row, token), out_ptr + peer * n, start, stop, BLOCK)
        dl.shmem.quiet()
    finish_call(calls_ptr)


@jit
def all_gather_pull_kernel(x_ptr, out_ptr, staging_ptr, flags_ptr, calls_ptr, n, slot_numel, splits,
                           BLOCK: tl.constexpr):
    """Staging holds this rank's shard, one per slot."""
    epoch = call_epoch(calls_ptr)
    me = dl.rank()
    world = dl.num_ranks()
    peer = tl.program_id(0)
    split = tl.program_id(1)
    start, stop = split_bounds(n, split, splits, BLOCK)
    stage = staging_ptr + (epoch % 2) * slot_numel
    flags = flags_ptr + (epoch % 2) * (world * splits)
    if peer == me:
        copy_slice(x_ptr, stage, start, stop, BLOCK)
        copy_slice(x_ptr, out_ptr + me * n, start, stop, BLOCK)
        for other in range(world):
            if other != me:
                dl.notify(flags + me * splits + split, other, signal=epoch, sig_op="set")
    else:
        token = dl.wait(flags + peer * splits + split, 1, scope="sys", semantic="acquire", waitValue=epoch)
        copy_slice(dl.consume_token(dl.symm_at(stage, peer), token), out_ptr + peer * n, start, stop, BLOCK)
    finish_call(calls_ptr)


@jit
def all_gather_ll_kernel(x_ptr, out_ptr, packets_ptr, calls_ptr, n, row, slot_numel, splits,
                         BLOCK: tl.constexpr):
    """x and out are viewed as int32 words; program (p, s) exchanges slice s of the shards with rank
    p. Staging rows are `row` packets apart."""
    epoch = call_epoch(calls_ptr)
    me = dl.rank()
    peer = tl.program_id(0)
    start, stop = split_bounds(n, tl.program_id(1), splits, BLOCK)
    stage = packets_ptr + (epoch % 2) * slot_numel
    offsets = tl.arange(0, BLOCK)
    if peer == me:
        copy_slice(x_ptr, out_ptr + me * n, start, stop, BLOCK)
    else:
        remote = dl.symm_at(stage + me * row, peer)
        for offset in range(start, stop, BLOCK):
            mask = offset + offsets < stop
            dl.ll.send(remote + offset + offsets, tl.load(x_ptr + offset + offsets, mask=mask), epoch, mask)
        for offset in range(start, stop, BLOCK):
            mask = offset + offsets < stop
            words = dl.ll.recv(stage + peer * row + offset + offsets, epoch, mask)
            tl.store(out_ptr + peer * n + offset + offsets, words, mask=mask)
    finish_call(calls_ptr)


@jit
def all_gather_ce_kernel(x_ptr, out_ptr, staging_ptr, flags_ptr, n, total, row, chunk, chunks,
                         COPY_OWN: tl.constexpr, splits, BLOCK: tl.constexpr):
    """out[p * n:] gets rank p's part (n elements, fewer for the last ranks if `total` is short):
    from x for this rank (if COPY_OWN), for the others from staging row p as its chunks land.
    Program (p, s) copies blocks s, s + splits, ... of part p, so all programs of a row work on a
    chunk as soon as it is there."""
    me = dl.rank()
    peer = tl.program_id(0)
    length = tl.minimum(tl.maximum(total - peer * n, 0), n)
    offsets = tl.arange(0, BLOCK)
    source = staging_ptr + peer * row
    if peer == me:
        source = x_ptr
    arrived = tl.cast(-1, tl.int32)
    if peer != me or COPY_OWN:
        for block in range(tl.program_id(1), tl.cdiv(length, BLOCK), splits):
            start = block * BLOCK
            stop = tl.minimum(start + BLOCK, length)
            if peer != me:
                arrived, source = wait_chunks(flags_ptr + peer * chunks, arrived, stop, chunk, source)
            mask = start + offsets < stop
            tl.store(out_ptr + peer * n + start + offsets, tl.load(source + start + offsets, mask=mask), mask=mask)


class AllGather:
    """An all-gather of `numel` elements of `dtype` per rank, with its own workspace. Reuse one
    instance per stream; `tridist.ops.all_gather` keeps one per shape for the current stream.
    `programs` caps the programs (blocks, so SMs) a call's kernel runs (default: one per SM)."""

    def __init__(self, numel: int, dtype: torch.dtype, method: str = "auto", programs: int | None = None):
        if method not in METHODS:
            raise _protocol.method_error("all_gather", method, METHODS)
        if dtype not in DTYPES:
            raise ValueError(f"all_gather takes {', '.join(map(str, DTYPES))}; got {dtype}")
        self.world = w = tridist.world()
        self.numel, self.dtype = numel, dtype
        nbytes = numel * dtype.itemsize
        self.method = choose_method(nbytes * w.world_size, w) if method == "auto" else method
        if self.method in ("pull", "ll", "ce") and w.nnodes > 1:
            raise ValueError(f"all_gather method {self.method!r} works within one node; this world has {w.nnodes} "
                             "nodes: use method='push'")
        if self.method == "ll" and nbytes % 4:
            raise ValueError("all_gather method 'll' moves 4-byte words: the shard must be a multiple of 4 bytes")
        per_peer = max(1, _protocol.programs_limit(programs, w) // w.world_size)
        if self.method == "ll":
            self.words = nbytes // 4
            self.splits = _protocol.splits_for(self.words, LL_BLOCK, per_peer)
            self.row = row_stride(self.words)
            self.workspace = Workspace(w.world_size * self.row, torch.int64, 1)
        elif self.method == "pull":
            self.splits = _protocol.splits_for(numel, BLOCK, per_peer)
            self.workspace = Workspace(numel, dtype, w.world_size * self.splits)
        elif self.method == "push":
            self.splits = _protocol.splits_for(numel, BLOCK, per_peer)
            self.row = row_stride(numel)
            self.workspace = Workspace(w.world_size * self.row, dtype, w.world_size * self.splits)
        else:
            self.splits = _protocol.splits_for(numel, BLOCK, per_peer)
            self.transfer = CopyEnginePush(numel, dtype)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        w = self.world
        check_input(x, "x", DTYPES)
        if x.numel() != self.numel or x.dtype != self.dtype:
            raise ValueError(f"this all-gather moves {self.numel} {self.dtype} elements per rank; x has "
                             f"{x.numel()} {x.dtype}")
        shape = (w.world_size * x.shape[0], *x.shape[1:]) if x.dim() else (w.world_size,)
        if out is None:
            out = torch.empty(shape, dtype=x.dtype, device=x.device)
        check_output(out, shape, x.dtype)
        grid = (w.world_size, self.splits)
        if self.method == "pull":
            ws = self.workspace
            all_gather_pull_kernel[grid](x, out, ws.staging, ws.flags, ws.calls, self.numel, ws.slot_numel,
                                         splits=self.splits, BLOCK=BLOCK)
        elif self.method == "push":
            ws = self.workspace
            all_gather_push_kernel[grid](x, out, ws.staging, ws.flags, ws.calls, self.numel, self.row, ws.slot_numel,
                                         w.local_world_size, splits=self.splits, BLOCK=BLOCK)
        elif self.method == "ll":
            ws = self.workspace
            all_gather_ll_kernel[grid](x.view(-1).view(torch.int32), out.view(-1).view(torch.int32), ws.staging,
                                       ws.calls, self.words, self.row, ws.slot_numel, splits=self.splits,
                                       BLOCK=LL_BLOCK)
        else:
            transfer = self.transfer
            tridist.barrier_all_on_stream()
            transfer.push([x.view(-1)] * w.world_size)
            all_gather_ce_kernel[grid](x, out, transfer.staging, transfer.flags, self.numel, out.numel(),
                                       transfer.row, transfer.chunk, transfer.chunks, COPY_OWN=True,
                                       splits=self.splits, BLOCK=BLOCK)
            transfer.join()
        return out

    def free(self) -> None:
        if self.method == "ce":
            self.transfer.free()
        else:
            self.workspace.free()


def choose_method(total_bytes: int, world) -> str:
    """Crossovers measured on 2 x H200, bf16 (benchmarks/results/allgather-*-2026-11-22.json): LL
    packets were fastest up to 1 MB (3.96 us at 4 KB, 7.84 us at 1 MB), SM push from 4 MB to 16 MB,
    the copy engines at 256 MB. Across nodes only push moves data."""
    if world.nnodes > 1:
        return "push"
    if total_bytes <= 1 << 20:
        return "ll"
    if total_bytes <= 32 << 20:
        return "push"
    return "ce"


def all_gather(x: torch.Tensor, out: torch.Tensor | None = None, method: str = "auto") -> torch.Tensor:
    """Gather `x` from every rank into `out` (world_size * x.shape[0] rows), like
    `torch.distributed.all_gather_into_tensor`. A collective: every rank calls it with the same
    shape, dtype and method."""
    check_input(x, "x", DTYPES)
    op = _protocol.instance(lambda: AllGather(x.numel(), x.dtype, method), AllGather, x.numel(), x.dtype, method,
                            device=x.device)
    return op(x, out)


@torch.library.custom_op("tridist::all_gather", mutates_args=())
def all_gather_op(x: torch.Tensor, method: str = "auto") -> torch.Tensor:
    """`all_gather` as a PyTorch custom op (`torch.ops.tridist.all_gather`), for torch.compile."""
    return all_gather(x, method=method)


@all_gather_op.register_fake
def _all_gather_shape(x: torch.Tensor, method: str = "auto") -> torch.Tensor:
    n = tridist.world().world_size
    return x.new_empty((n * x.shape[0], *x.shape[1:]) if x.dim() else (n,))
