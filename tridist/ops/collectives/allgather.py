"""All-gather: every rank contributes a shard of n elements; every rank gets all of them, in rank
order (torch's `all_gather_into_tensor` layout: out is world_size * n elements, rank r's at r*n).

Methods

- "push": the shard is cut in slices (`slices_for`). Program (p, s) for a peer p stores slices
  s, s + splits, ... of this rank's shard into row `rank` of rank p's staging (through p's pointer
  on this node, an NVSHMEM put with signal on another node), raising p's flag (rank, slice) after
  each; program (rank, s) copies each of those slices of every rank's shard into `out`, this
  rank's from x, a peer's once its flag is up, so copying out overlaps sending. Double-buffered
  staging and call epochs (see `_protocol.py`) need no handshake.
- "ll": the same exchange in low-latency packets: each 4-byte word travels with the epoch as its
  flag, so there are no separate signals; for small messages on one node.
- "pull": the program (rank, s) stages slice s of this rank's shard and raises flag (rank, s) on
  every rank of the node; program (p, s) waits for rank p's flag (p, s) here and reads that slice
  of p's staging through symm_at. Reads instead of writes over NVLink; on one node.
- "ce": this rank's copy engines write its shard into row `rank` of every peer's staging, chunk by
  chunk, each chunk followed by its flag (`CopyEnginePush`); a kernel copies each chunk out to
  `out` as soon as its flag is up. No SM moves data across NVLink (for large messages next to
  other work on the SMs; on its own "push" is faster, so `auto` does not pick it); one node. A
  barrier at the start of each call says every peer has finished with its staging and flags.
- "2d" (for several nodes): each shard crosses to every other node once. The rank puts its shard
  (with the signal attached) to the rank with its local index on every other node, and stores it
  into the staging of every rank of its own node; a rank forwards each shard it received from
  another node to the other ranks of its node once that shard's flag has arrived. Flag (p, s) on a
  rank says slice s of rank p's shard is in its staging, raised once per call by whoever wrote
  it; then each program waits for a few of those flags and copies those rows into `out`. On one
  node this is "push" with the copy-outs spread differently. A program may wait for a shard that a
  program after it in the grid forwards, so the kernel launches co-resident (`kernel[grid](...,
  coresident=True)`), with fewer splits if its grid would not all be resident (asked at the first
  call). `ag_gemm` (comm="sm") runs the same kernel without the copy-out: its GEMM reads the staging
  itself.
- A symmetric `out` (`tridist.symm_empty`, the same tensor on every rank; `symmetric_out=True`)
  lets "ce" skip the staging: the copy engines write the shard straight into every peer's `out`,
  between two barriers on the stream (every peer has reached the call; every shard has landed).
  The fastest all-gather of 256 MB here (2 x H200: 372 us, 360 GB/s). The SM methods stage as
  usual: a push straight into the peers' `out` from every SM was slower than the sliced push
  (256 MB: 446 against 387 us; 64 MB: 137 against 109; 2026-11-23).
- "ring": program s passes slice s around the ring: it pushes its own slice to rank+1, then
  world-1 times waits for the slice of the next source along the ring (rank-1, rank-2, ...) under
  flag (source, s), forwards it to rank+1 (unless rank+1 is that source) and copies it to `out`.
  Each rank sends and receives (n-1)/n of the output once, whatever the topology; the slices move
  independently, so the steps overlap.
"""
import torch
import triton.language as tl

import tridist
import tridist.language as dl
from tridist.runtime.jit import jit

from .. import _protocol, sync
from .._protocol import (LL_BLOCK, CopyEnginePush, PacketRows, PeerStreams, Workspace, after_flags, call_epoch,
                        check_input, check_output, copy_slice, finish_call, notify_peers, placement, push_slice,
                        row_stride, shape_of, split_bounds, symmetric_identity, wait_chunks)

METHODS = ("auto", "push", "pull", "ll", "ce", "2d", "ring")
# An all-gather only moves data, so it takes raw bytes and integers as well.
DTYPES = (*_protocol.SUPPORTED, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


@jit
def all_gather_push_kernel(x_ptr, out_ptr, staging_ptr, flags_ptr, calls_ptr, n, row, slot_numel, local_world_size,
                           slices, BLOCK: tl.constexpr):
    """Program (p, s) for a peer p sends slices s, s + splits, ... of this rank's shard into row
    `rank` of p's staging, each followed by flag (rank, slice) there; program (rank, s) copies the
    same slices of this rank's shard into `out`, then of each peer's as its flag arrives. Staging
    rows are `row` (n rounded up to 64) elements apart."""
    epoch = call_epoch(calls_ptr)
    me = dl.rank()
    world = dl.num_ranks()
    peer = tl.program_id(0)
    stage = staging_ptr + (epoch % 2) * slot_numel
    flags = flags_ptr + (epoch % 2) * (world * slices)
    for j in range(tl.program_id(1), slices, tl.num_programs(1)):
        start, stop = split_bounds(n, j, slices, BLOCK)
        if peer == me:
            copy_slice(x_ptr, out_ptr + me * n, start, stop, BLOCK)
            for step in range(1, world):
                source = (me + step) % world
                copy_slice(after_flags(stage + source * row, flags + source * slices + j, 1, epoch),
                           out_ptr + source * n, start, stop, BLOCK)
        else:
            push_slice(x_ptr, stage + me * row, start, stop, flags + me * slices + j, epoch, peer, local_world_size,
                       BLOCK)
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
        notify_peers(flags + me * splits + split, epoch)
    else:
        copy_slice(after_flags(dl.symm_at(stage, peer), flags + peer * splits + split, 1, epoch),
                   out_ptr + peer * n, start, stop, BLOCK)
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


@jit
def all_gather_2d_kernel(x_ptr, out_ptr, staging_ptr, flags_ptr, calls_ptr, n, row, slot_numel, local_world_size,
                         COPY_OUT: tl.constexpr, splits, BLOCK: tl.constexpr):
    """Program (task, split) moves slice `split`. With L ranks per node and N nodes, the grid's
    L + 2 (N - 1) tasks (`spread_tasks`) spread this rank's shard into row `rank` of every rank's
    staging (rows `row` apart):
    - task < L: to local rank `task` of this node (this rank included);
    - task = L + j, j < N - 1: to the rank with this local index on node (node + 1 + j) % N;
    - task = L + N - 1 + j: waits until the shard of the rank with this local index on node
      (node + 1 + j) % N has arrived here, then forwards it to the other ranks of this node.
    With COPY_OUT, task t then copies rows t, t + L + 2 (N - 1), ... into `out` as they arrive."""
    epoch = call_epoch(calls_ptr)
    me, world, nodes, node, local = placement(local_world_size)
    task = tl.program_id(0)
    split = tl.program_id(1)
    start, stop = split_bounds(n, split, splits, BLOCK)
    stage = staging_ptr + (epoch % 2) * slot_numel
    flags = flags_ptr + (epoch % 2) * (world * splits)
    direct = local_world_size + nodes - 1
    if task < direct:
        peer = node * local_world_size + task
        if task >= local_world_size:
            peer = ((node + 1 + task - local_world_size) % nodes) * local_world_size + local
        push_slice(x_ptr, stage + me * row, start, stop, flags + me * splits + split, epoch, peer, local_world_size,
                   BLOCK)
    else:
        source = ((node + 1 + task - direct) % nodes) * local_world_size + local
        flag = flags + source * splits + split
        received = after_flags(stage + source * row, flag, 1, epoch)
        for other in range(local_world_size):
            if other != local:
                push_slice(received, stage + source * row, start, stop, flag, epoch, node * local_world_size + other,
                           local_world_size, BLOCK)
    if COPY_OUT:
        for source in range(task, world, tl.num_programs(0)):
            copy_slice(after_flags(stage + source * row, flags + source * splits + split, 1, epoch),
                       out_ptr + source * n, start, stop, BLOCK)
    dl.shmem.quiet()
    finish_call(calls_ptr)


@jit
def all_gather_ring_kernel(x_ptr, out_ptr, staging_ptr, flags_ptr, calls_ptr, n, row, slot_numel, local_world_size,
                           splits, BLOCK: tl.constexpr):
    """Program s carries slice s of every shard one hop along the ring; staging rows are `row` apart."""
    epoch = call_epoch(calls_ptr)
    me = dl.rank()
    world = dl.num_ranks()
    successor = (me + 1) % world
    split = tl.program_id(0)
    start, stop = split_bounds(n, split, splits, BLOCK)
    stage = staging_ptr + (epoch % 2) * slot_numel
    flags = flags_ptr + (epoch % 2) * (world * splits)
    push_slice(x_ptr, stage + me * row, start, stop, flags + me * splits + split, epoch, successor, local_world_size,
               BLOCK)
    copy_slice(x_ptr, out_ptr + me * n, start, stop, BLOCK)
    for step in range(1, world):
        source = (me + world - step) % world
        flag = flags + source * splits + split
        received = after_flags(stage + source * row, flag, 1, epoch)
        if source != successor:  # forward first: the rest of the ring waits for it
            push_slice(received, stage + source * row, start, stop, flag, epoch, successor, local_world_size, BLOCK)
        copy_slice(received, out_ptr + source * n, start, stop, BLOCK)
    dl.shmem.quiet()
    finish_call(calls_ptr)


class AllGather:
    """An all-gather of `numel` elements of `dtype` per rank, with its own symmetric buffers.

    Build it on every rank at once; call it (`op(x, out)`) back to back on one stream, also in
    CUDA graphs; `free()` it on every rank. `tridist.ops.all_gather` keeps one per shape, dtype,
    method and stream.

    | method | how | where |
    | --- | --- | --- |
    | `"ll"` | low-latency packets (`dl.ll`): every 4-byte word travels with the call's epoch as its flag, no separate signal | one node; small messages; `numel * itemsize` a multiple of 4 |
    | `"push"` | the shard is cut in slices (about 128 KB); programs store each slice into every peer's staging and raise its flag, while the rank's own programs copy the slices that have arrived into `out`, so copying out overlaps sending | any topology (across nodes each slice is a put with signal to every rank) |
    | `"pull"` | each rank stages its shard and raises a flag on every peer; each peer reads it through `symm_at` (reads instead of writes over NVLink) | one node |
    | `"ce"` | the copy engines write the shard into every peer's staging, 8 MB chunks with a flag each; a kernel copies each chunk out as its flag rises. Into a symmetric `out` (`symmetric_out=True`) they write straight into the peers' `out`, no staging | one node; for large messages next to other work on the SMs |
    | `"2d"` | each shard crosses to every other node once: put (with its signal) to the rank with the same local index on each other node, which forwards it along its node | several nodes (on one node, `push` with the copy-outs spread differently) |
    | `"ring"` | each slice passes around the ring of ranks, every rank forwarding what it received to the next | any topology |
    | `"auto"` | [`choose_method`][tridist.ops.collectives.allgather.choose_method]: `2d` across nodes, `ll` up to 1 MB in all, `ce` into a symmetric `out` above 64 MB, else `push` | |

    Args:
        numel: elements of each rank's shard (0: calls do nothing).
        dtype: bf16, fp16, fp32, uint8, int8, int16, int32 or int64 (an all-gather only moves
            bytes).
        method: one of the methods above.
        programs: the most programs (blocks, so SMs) a call's kernel runs (default: one per SM).
        symmetric_out: every call passes a symmetric `out` (`tridist.symm_empty`), the same
            tensor on every rank; `"ce"` then writes into it directly.

    Raises:
        ValueError: an unknown method, a dtype it does not take, `numel` not a non-negative
            int, `programs` not a positive int, a one-node method in a world of several nodes, an
            output past 2^31 elements, or for `"ll"` a shard that is not whole 4-byte words.
    """

    def __init__(self, numel: int, dtype: torch.dtype, method: str = "auto", programs: int | None = None,
                 symmetric_out: bool = False):
        if method not in METHODS:
            raise _protocol.method_error("all_gather", method, METHODS)
        _protocol.check_build("all_gather", numel, dtype, DTYPES)
        self.world = w = tridist.world()
        self.numel, self.dtype = numel, dtype
        nbytes = numel * dtype.itemsize
        self.method = choose_method(nbytes * w.world_size, w, symmetric_out) if method == "auto" else method
        self.symmetric_out = symmetric_out
        if numel == 0:  # nothing to move: no buffers, and calls return at once
            return
        self.direct = symmetric_out and self.method == "ce" and w.world_size > 1
        self.fitted = self.method != "2d"  # "2d" fits its splits to what can be resident at its first call
        _protocol.check_offsets("all_gather", w.world_size * row_stride(numel))
        if self.method in ("pull", "ll", "ce"):
            _protocol.require_one_node(f"all_gather method {self.method!r}", "method='2d' or 'push'")
        limit = _protocol.programs_limit(programs, w)
        per_peer = max(1, limit // w.world_size)
        if self.method == "ll":
            self.workspace = PacketRows("all_gather", nbytes, per_peer)
            self.splits = self.workspace.splits
        elif self.method == "pull":
            self.block, self.splits, self.warps = _protocol.steps_for(numel, dtype.itemsize, per_peer)
            self.workspace = Workspace(numel, dtype, w.world_size * self.splits, "all_gather pull")
        elif self.method == "push":
            self.block, self.splits, self.warps = _protocol.steps_for(numel, dtype.itemsize, per_peer)
            self.slices = _protocol.slices_for(numel, dtype.itemsize, self.splits)
            self.row = row_stride(numel)
            self.workspace = Workspace(w.world_size * self.row, dtype, w.world_size * self.slices, "all_gather push")
        elif self.method in ("2d", "ring"):
            tasks = spread_tasks(w) if self.method == "2d" else 1  # programs per slice
            self.block, self.splits, self.warps = _protocol.steps_for(numel, dtype.itemsize,
                                                                      max(1, limit // tasks))
            self.row = row_stride(numel)
            self.workspace = Workspace(w.world_size * self.row, dtype, w.world_size * self.splits,
                                       f"all_gather {self.method}")
        elif self.direct:
            self.streams = PeerStreams(w)
            self.barrier = sync.Barrier()
        else:  # "ce" through staging
            self.block, self.splits, self.warps = _protocol.steps_for(numel, dtype.itemsize, per_peer,
                                                                      _protocol.CE_STEP_BYTES)
            self.transfer = CopyEnginePush(numel, dtype, name="all_gather ce")

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Gather `x` from every rank into `out`.

        Args:
            x: this rank's shard: `numel` elements of `dtype` (as built), contiguous, on this
                rank's device.
            out: `world_size * x.shape[0]` rows of `x`'s other dimensions (`world_size`
                elements for a 0-d `x`), `x`'s dtype; a new tensor if None. Required, and
                symmetric, with `symmetric_out`.

        Returns:
            `out`, every rank's shard in rank order.

        Raises:
            ValueError: `x` or `out` not what this instance was built for, on any rank; with
                `symmetric_out`, ranks passed different tensors (`_protocol.agree` says when
                every rank checks).
        """
        w = self.world

        def check() -> None:
            _protocol.check_same(x, self.numel, self.dtype, "all-gather", DTYPES)
            if out is None and self.symmetric_out:
                raise ValueError("this all-gather was built with symmetric_out=True: pass out, a symmetric tensor "
                                 "(tridist.symm_empty)")
            if out is not None:
                check_output(out, gathered_shape(x, w), x.dtype)
            if self.symmetric_out and not tridist.is_symmetric(out):
                raise ValueError("this all-gather was built with symmetric_out=True: out must be a symmetric tensor "
                                 "(tridist.symm_empty), the same on every rank")

        _protocol.agree("all_gather", check, {"shape and dtype of x": shape_of(x),
                                              "out": symmetric_identity(out) if self.symmetric_out else "any"})
        if out is None:
            out = torch.empty(gathered_shape(x, w), dtype=x.dtype, device=x.device)
        if self.numel == 0:
            return out
        if self.direct:
            self._into_symmetric(x, out)
            return out
        grid = (w.world_size, self.splits)
        if self.method == "pull":
            ws = self.workspace
            all_gather_pull_kernel[grid](x, out, ws.staging, ws.flags, ws.calls, self.numel, ws.slot_numel,
                                         splits=self.splits, BLOCK=self.block, num_warps=self.warps)
        elif self.method == "push":
            ws = self.workspace
            all_gather_push_kernel[grid](x, out, ws.staging, ws.flags, ws.calls, self.numel, self.row, ws.slot_numel,
                                         w.local_world_size, self.slices, BLOCK=self.block, num_warps=self.warps)
        elif self.method == "2d":
            ws = self.workspace
            args = (x, out, ws.staging, ws.flags, ws.calls, self.numel, self.row, ws.slot_numel, w.local_world_size)
            meta = {"COPY_OUT": True, "BLOCK": self.block, "num_warps": self.warps}
            if not self.fitted:  # fewer splits use fewer of the workspace's flags
                self.splits = _protocol.fit_coresident(all_gather_2d_kernel, self.splits, spread_tasks(w), *args,
                                                       splits=self.splits, **meta)
                self.fitted = True
            all_gather_2d_kernel[(spread_tasks(w), self.splits)](*args, splits=self.splits, coresident=True, **meta)
        elif self.method == "ring":
            ws = self.workspace
            all_gather_ring_kernel[(self.splits,)](x, out, ws.staging, ws.flags, ws.calls, self.numel, self.row,
                                                   ws.slot_numel, w.local_world_size, splits=self.splits,
                                                   BLOCK=self.block, num_warps=self.warps)
        elif self.method == "ll":
            ws = self.workspace
            all_gather_ll_kernel[grid](x.view(-1).view(torch.int32), out.view(-1).view(torch.int32), ws.staging,
                                       ws.calls, ws.words, ws.row, ws.slot_numel, splits=self.splits, BLOCK=LL_BLOCK)
        else:  # "ce" through staging
            transfer = self.transfer
            transfer.barrier()
            transfer.push([x.view(-1)] * w.world_size)
            all_gather_ce_kernel[grid](x, out, transfer.staging, transfer.flags, self.numel, out.numel(),
                                       transfer.row, transfer.chunk, transfer.chunks, COPY_OWN=True,
                                       splits=self.splits, BLOCK=self.block, num_warps=self.warps)
            transfer.join()
        return out

    def _into_symmetric(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """The copy engines write x into row `rank` of every peer's `out`, and of this rank's
        (unless x is that row already) at the same time."""
        w, n = self.world, self.numel
        self.barrier()  # every peer's out may be written
        for index, peer in enumerate(self.streams.peers):
            with self.streams.side(index):
                tridist.peer_tensor(out, peer).view(-1)[w.rank * n:(w.rank + 1) * n].copy_(x.view(-1))
        own = out.view(-1)[w.rank * n:(w.rank + 1) * n]
        if own.data_ptr() != x.data_ptr():
            own.copy_(x.view(-1))
        self.streams.join()
        self.barrier()  # every peer's shard has landed here

    def free(self) -> None:
        """Give the symmetric buffers back (collective: every rank frees its instance in the same
        order)."""
        if self.numel == 0:
            return
        if self.direct:
            self.barrier.free()
        elif self.method == "ce":
            self.transfer.free()
        else:
            self.workspace.free()


def gathered_shape(x: torch.Tensor, world) -> tuple:
    """The shape of the all-gather of `x`: `world_size` times its rows."""
    return (world.world_size * x.shape[0], *x.shape[1:]) if x.dim() else (world.world_size,)


def spread_tasks(world) -> int:
    """Spreading programs per slice in `all_gather_2d_kernel`: one per rank of the node, one put and
    one forward per other node."""
    return world.local_world_size + 2 * (world.nnodes - 1)


def choose_method(total_bytes: int, world, symmetric_out: bool = False) -> str:
    """The method `"auto"` runs for an all-gather of `total_bytes` (all ranks' shards together).

    Crossovers measured on H200s joined by NVLink, bf16 (benchmarks/results/allgather-*.json):
    LL packets were fastest up to 1 MB (2 ranks, 2026-11-23: 3.3 us at 4 KB, 6.8 us at 1 MB), then
    the sliced push (13.2 us at 4 MB, 109 us at 64 MB, 402 us at 256 MB, where the ring took 13.2,
    132 and 502, the copy engines 31.9, 153 and 487). With 4 ranks (2026-11-22, before the push was
    sliced and the steps grew) LL won up to 1 MB as well; the ring beat that older push from 64 MB.
    Into a symmetric `out` the copy engines skip the staging and won at 256 MB (372-373 us against
    the sliced push's 387-409), not at 64 MB (126 against 109; 2026-11-23, `allgather-symmetric-*`).
    Across nodes "2d" sends each shard over the network once per node, where push sends it once per
    rank (not measured across nodes yet)."""
    if world.nnodes > 1:
        return "2d"
    if total_bytes <= 1 << 20 and total_bytes % (4 * world.world_size) == 0:
        return "ll"
    if symmetric_out and total_bytes > 64 << 20:
        return "ce"
    return "push"


def all_gather(x: torch.Tensor, out: torch.Tensor | None = None, method: str = "auto") -> torch.Tensor:
    """Gather `x` from every rank into `out` (`world_size * x.shape[0]` rows), like
    `torch.distributed.all_gather_into_tensor`.

    A collective: every rank calls it with the same shape, dtype and method, and a symmetric
    `out` on every rank or on none. An empty `x` (on every rank) gives an empty `out` and moves
    nothing. Keeps one [`AllGather`][tridist.ops.AllGather] per shape,
    dtype, method and stream (its table lists the methods).

    Args:
        x: this rank's shard, contiguous, on this rank's device: bf16, fp16, fp32, uint8, int8,
            int16, int32 or int64.
        out: the result, `world_size * x.shape[0]` rows of `x`'s other dimensions in `x`'s
            dtype; a new tensor if None. A symmetric `out` (`tridist.symm_empty`, the same on
            every rank) is written straight from the peers by method `"ce"`, what `"auto"` runs
            there above 64 MB on one node; `x` may then be `out`'s own row.
        method: `"auto"` or one of `AllGather`'s methods.

    Returns:
        `out`, every rank's shard in rank order.

    Raises:
        ValueError: before any launch, on every rank: a dtype, device, layout or size it does not
            take on any rank, ranks that disagree on the shape, dtype, method or a symmetric
            `out`, an unknown method, or a one-node method on several nodes (see `AllGather`).
        TypeError: `x` is not a tensor.
    """
    def check() -> None:
        check_input(x, "x", DTYPES)
        if method not in METHODS:
            raise _protocol.method_error("all_gather", method, METHODS)
        if out is not None:
            check_output(out, gathered_shape(x, tridist.world()), x.dtype)

    _protocol.agree("all_gather", check, {"shape and dtype of x": shape_of(x), "method": method,
                                          "out": symmetric_identity(out)})
    symmetric = out is not None and tridist.is_symmetric(out)
    op = _protocol.instance(lambda: AllGather(x.numel(), x.dtype, method, symmetric_out=symmetric), AllGather,
                            x.numel(), x.dtype, method, symmetric, device=x.device)
    return op(x, out)


@torch.library.custom_op("tridist::all_gather", mutates_args=())
def all_gather_op(x: torch.Tensor, method: str = "auto") -> torch.Tensor:
    """`all_gather` as a PyTorch custom op (`torch.ops.tridist.all_gather`), for torch.compile."""
    return all_gather(x, method=method)


@all_gather_op.register_fake
def _all_gather_shape(x: torch.Tensor, method: str = "auto") -> torch.Tensor:
    n = tridist.world().world_size
    return x.new_empty((n * x.shape[0], *x.shape[1:]) if x.dim() else (n,))
