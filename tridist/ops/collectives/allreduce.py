"""Reduce-scatter and all-reduce (sum), accumulated in fp32 whatever the input dtype.

reduce_scatter: x has world_size * m elements; rank r gets out = sum over ranks of x[r*m:(r+1)*m].
all_reduce:     x has n elements; every rank gets out = sum over ranks of x.

Methods (each says where it works; see `_protocol.py` for slots and epochs)

- "one_shot" (any topology): all_reduce: program (s) pushes slice s of x to every peer, raises the
  peer's flag (rank, s), then waits for every peer's flag (p, s) here and sums the rows it
  received. One step, world_size - 1 copies of the data received per rank: best while latency
  dominates.
  reduce_scatter: the chunks are cut in slices (`slices_for`); program (p, s) for a peer p pushes
  slices s, s + splits, ... of chunk p to p, a flag (rank, slice) after each, while program
  (rank, s) sums those slices of this rank's chunk as every peer's arrive, so the sums overlap
  the sending.
- "two_shot" (all_reduce, any topology): the sliced reduce-scatter above, then the program that
  summed a slice pushes it to every peer (flags in the second half of the slot's signals), where
  the program that sent that peer its chunk copies it out. Each rank receives 2 (n-1)/n of the
  data instead of (n-1) x: best for large messages.
  In place on a symmetric x (`all_reduce(x, out=x)`, x from `tridist.symm_empty`, one node) the
  two-shot needs no staging: rank r sums chunk r reading every rank's x through symm_at, and
  stores the sum into every rank's x, one pass over NVLink each way (once every peer's flag
  `ready` says its x holds this call's input), then waits for the peers' sums to have landed here.
- "ll" (one node): one-shot in low-latency packets (`dl.ll`): each 4-byte word a peer sums travels
  to it with the epoch as its flag (all of x to every peer for all_reduce, chunk p to rank p for
  reduce_scatter), so there is no separate signal and no fence; the words are summed in rank
  order, so every rank gets the same bits. For small messages.
- "ce" (one node): the copy engines move the data (`CopyEnginePush`), so no SM drives NVLink: each
  rank's copy engines write chunk p of x into row `rank` of rank p's staging, a flag per piece,
  and a kernel sums the pieces as they land (reduce-scatter). For all_reduce the copy engines
  then write each rank's reduced chunk into every peer's second staging, and a kernel copies
  those into `out` as they land. For large messages next to other work on the SMs; on its own
  the sliced SM methods are faster (2 x H200, 2026-11-23), so `auto` does not pick it.
- "2d" (reduce_scatter, for several nodes): two levels, so that each chunk crosses to a node once.
  With L ranks per node, rank (node a, local index l) owns chunk a*L + l. First, within the node,
  every rank pushes to local rank l the chunks owned by the ranks with local index l on every node
  (row (n, j) of l's staging: local rank j's chunk n*L + l; flag (s, n, j)). Then rank (a, l) sums,
  for each node n, the L rows (n, *) in fp32: the sum for its own node stays here as node sum a;
  the sum for another node is put (with the signal) to rank (n, l) as that rank's node sum a, flag
  (s, a) of the second block of flags. Last, it sums its N node sums into `out`. Node sums are fp32
  (a separate symmetric buffer, double-buffered as the workspace): the result is rounded once.
- "ring" (reduce_scatter, any topology): program s passes slice s of the partial sums around the
  ring: world-1 steps; at step k a rank adds its own part of chunk rank-1-k to the partial it received
  (none at step 0) and pushes it to rank+1 (row k of its received rows, flag (k, s)); after the last
  step the partial of its own chunk has passed every other rank and it adds its own part into
  `out`. Partials travel in fp32 (twice the bytes of a 16-bit input): the result is rounded once.
"""
import torch
import triton
import triton.language as tl

import tridist
import tridist.language as dl
from tridist.runtime.jit import jit

from .. import _protocol
from .._protocol import (LL_BLOCK, CopyEnginePush, PacketRows, Workspace, after_flags, call_epoch, check_input,
                        check_output, copy_slice, finish_call, notify_peers, pack_halves, placement, push_slice,
                        row_stride, shape_of, split_bounds, symmetric_identity, sync_program, unpack_halves,
                        wait_chunks)
from .allgather import all_gather_ce_kernel

REDUCE_SCATTER_METHODS = ("auto", "ll", "one_shot", "ce", "2d", "ring")
ALL_REDUCE_METHODS = ("auto", "one_shot", "two_shot", "ll", "ce")
# From this size the in-place symmetric two-shot runs two programs per SM unless told otherwise:
# on 2 x H200 (2026-11-23, benchmarks/results/allreduce-symmetric-variants-*.log) 256 MB took 800.9
# and 802.3 us in two runs against 816.6 and 813.8 with one per SM (335 against 329 GB/s), 64 MB 208.9
# against 212.3; below, two were slower (16 MB 60.8 against 57.6, 4 MB 22.0 against 21.1).
SYMMETRIC_TWO_PER_SM_BYTES = 64 << 20


@triton.jit
def _sum_rows(stage_ptr, row_stride, rows, out_ptr, start, stop, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    for offset in range(start, stop, BLOCK):
        mask = offset + offsets < stop
        total = tl.zeros([BLOCK], tl.float32)
        for row in range(rows):
            total += tl.load(stage_ptr + row * row_stride + offset + offsets, mask=mask).to(tl.float32)
        tl.store(out_ptr + offset + offsets, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _send_chunks(x_ptr, stage, flags, epoch, m, row, slices, local_world_size, BLOCK: tl.constexpr,
                 WIDE: tl.constexpr):
    """Program (p, s) for a peer p: slices s, s + splits, ... of chunk p of x (m elements) into row
    `rank` of p's staging, each followed by p's flag (rank, slice). WIDE as in `push_slice`: the
    reduce-scatter sends narrow. In one run, 2 x H200, 2026-11-23, one kernel build with 16-byte
    stores and one without: its 256 MB took 565 and 404 us (64 MB: 170 and 115), where the all-gather
    push took 388 and 414 (64 MB: 108 and 111) and the two-shot all-reduce, which sends its chunks
    here too, was faster with them (842-849 against 861 us at 256 MB, in other runs). Not understood yet."""
    me = dl.rank()
    peer = tl.program_id(0)
    for j in range(tl.program_id(1), slices, tl.num_programs(1)):
        start, stop = split_bounds(m, j, slices, BLOCK)
        push_slice(x_ptr + peer * m, stage + me * row, start, stop, flags + me * slices + j, epoch, peer,
                   local_world_size, BLOCK, WIDE)


@triton.jit
def _sum_slice(own_ptr, stage, row, flags, epoch, slices, j, out_ptr, start, stop, BLOCK: tl.constexpr):
    """out[start:stop] = the sum over ranks, in rank order, of this rank's term (`own_ptr`) and each
    peer p's (staging row p, once p's flag (p, j) is up), in fp32."""
    me = dl.rank()
    world = dl.num_ranks()
    for peer in range(world):
        if peer != me:
            stage = after_flags(stage, flags + peer * slices + j, 1, epoch)
    offsets = tl.arange(0, BLOCK)
    for offset in range(start, stop, BLOCK):
        mask = offset + offsets < stop
        total = tl.zeros([BLOCK], tl.float32)
        for peer in range(world):
            term = stage + peer * row
            if peer == me:
                term = own_ptr
            total += tl.load(term + offset + offsets, mask=mask).to(tl.float32)
        tl.store(out_ptr + offset + offsets, total.to(out_ptr.dtype.element_ty), mask=mask)


@jit
def reduce_scatter_kernel(x_ptr, out_ptr, staging_ptr, flags_ptr, calls_ptr, m, row, slot_numel, local_world_size,
                          slices, BLOCK: tl.constexpr):
    """Program (p, s) for a peer p sends p's chunk of x (`_send_chunks`); program (rank, s) sums
    slices s, s + splits, ... of this rank's chunk as they arrive."""
    epoch = call_epoch(calls_ptr)
    me = dl.rank()
    stage = staging_ptr + (epoch % 2) * slot_numel
    flags = flags_ptr + (epoch % 2) * (dl.num_ranks() * slices)
    if tl.program_id(0) == me:
        for j in range(tl.program_id(1), slices, tl.num_programs(1)):
            start, stop = split_bounds(m, j, slices, BLOCK)
            _sum_slice(x_ptr + me * m, stage, row, flags, epoch, slices, j, out_ptr, start, stop, BLOCK)
    else:
        _send_chunks(x_ptr, stage, flags, epoch, m, row, slices, local_world_size, BLOCK, WIDE=False)
    dl.shmem.quiet()
    finish_call(calls_ptr)


@jit
def reduce_scatter_2d_kernel(x_ptr, out_ptr, staging_ptr, sums_ptr, flags_ptr, calls_ptr, m, row, slot_numel,
                             local_world_size, splits, BLOCK: tl.constexpr):
    """A slot of `staging` (x's dtype) holds world rows (n, j), a slot of `sums` (fp32) the N node
    sums of this rank's chunk, then N rows from which this rank puts its node's sums to the other
    nodes. Rows are `row` apart. Flags per slot: (split, n, j) for the rows, then (split, n) for
    the node sums."""
    epoch = call_epoch(calls_ptr)
    me, world, nodes, node, local = placement(local_world_size)
    split = tl.program_id(0)
    start, stop = split_bounds(m, split, splits, BLOCK)
    slot = epoch % 2
    gathered = staging_ptr + slot * slot_numel
    node_sums = sums_ptr + slot * (2 * nodes * row)
    outgoing = node_sums + nodes * row
    gathered_flags = flags_ptr + slot * ((world + nodes) * splits) + split * world
    sum_flags = flags_ptr + slot * ((world + nodes) * splits) + world * splits + split * nodes
    for step in range(local_world_size):
        j = (local + step) % local_world_size
        for n in range(nodes):
            push_slice(x_ptr + (n * local_world_size + j) * m, gathered + (n * local_world_size + local) * row, start,
                       stop, gathered_flags + n * local_world_size + local, epoch, node * local_world_size + j,
                       local_world_size, BLOCK)
    for step in range(nodes):  # the other nodes first, so that their puts are on their way early
        n = (node + 1 + step) % nodes
        rows = after_flags(gathered + n * local_world_size * row, gathered_flags + n * local_world_size,
                           local_world_size, epoch)
        if n == node:  # this node's sum of this rank's chunk stays here
            _sum_rows(rows, row, local_world_size, node_sums + node * row, start, stop, BLOCK)
        else:
            _sum_rows(rows, row, local_world_size, outgoing + n * row, start, stop, BLOCK)
            sync_program()
            push_slice(outgoing + n * row, node_sums + node * row, start, stop, sum_flags + node, epoch,
                       n * local_world_size + local, local_world_size, BLOCK)
    for n in range(nodes):
        if n != node:
            node_sums = after_flags(node_sums, sum_flags + n, 1, epoch)
    sync_program()  # this node's sum, stored above
    _sum_rows(node_sums, row, nodes, out_ptr, start, stop, BLOCK)
    dl.shmem.quiet()
    finish_call(calls_ptr)


@triton.jit
def _add_slice(x_ptr, partial_ptr, with_partial, dst_ptr, start, stop, BLOCK: tl.constexpr):
    """dst[start:stop] = x + partial (x alone unless `with_partial`), summed in fp32."""
    offsets = tl.arange(0, BLOCK)
    for offset in range(start, stop, BLOCK):
        mask = offset + offsets < stop
        total = tl.load(x_ptr + offset + offsets, mask=mask).to(tl.float32)
        if with_partial:
            total += tl.load(partial_ptr + offset + offsets, mask=mask).to(tl.float32)
        tl.store(dst_ptr + offset + offsets, total.to(dst_ptr.dtype.element_ty), mask=mask)


@jit
def reduce_scatter_ring_kernel(x_ptr, out_ptr, staging_ptr, flags_ptr, calls_ptr, m, row, slot_numel,
                               local_world_size, splits, BLOCK: tl.constexpr):
    """A slot of `staging` (fp32) holds world-1 received partials, then the world-1 this rank
    sends, `row` apart; flag (step, split) says received partial `step` is here."""
    epoch = call_epoch(calls_ptr)
    me = dl.rank()
    world = dl.num_ranks()
    successor = (me + 1) % world
    split = tl.program_id(0)
    start, stop = split_bounds(m, split, splits, BLOCK)
    received = staging_ptr + (epoch % 2) * slot_numel
    sent = received + (world - 1) * row
    flags = flags_ptr + (epoch % 2) * (world * splits)
    for step in range(world):
        partial = received + (step - 1) * row
        if step > 0:
            partial = after_flags(partial, flags + (step - 1) * splits + split, 1, epoch)
        if step < world - 1:
            chunk = (me + world - 1 - step) % world
            _add_slice(x_ptr + chunk * m, partial, step > 0, sent + step * row, start, stop, BLOCK)
            sync_program()
            push_slice(sent + step * row, received + step * row, start, stop, flags + step * splits + split, epoch,
                       successor, local_world_size, BLOCK)
        else:  # the partial of this rank's chunk has been through every other rank
            _add_slice(x_ptr + me * m, partial, step > 0, out_ptr, start, stop, BLOCK)
    dl.shmem.quiet()
    finish_call(calls_ptr)


@jit
def all_reduce_one_shot_kernel(x_ptr, out_ptr, staging_ptr, flags_ptr, calls_ptr, n, row, slot_numel,
                               local_world_size, splits, BLOCK: tl.constexpr):
    epoch = call_epoch(calls_ptr)
    me = dl.rank()
    world = dl.num_ranks()
    stage = staging_ptr + (epoch % 2) * slot_numel
    flags = flags_ptr + (epoch % 2) * (world * splits)
    split = tl.program_id(0)
    start, stop = split_bounds(n, split, splits, BLOCK)
    for step in range(world):
        peer = (me + step) % world
        push_slice(x_ptr, stage + me * row, start, stop, flags + me * splits + split, epoch, peer, local_world_size,
                   BLOCK)
    for peer in range(world):
        stage = after_flags(stage, flags + peer * splits + split, 1, epoch)
    _sum_rows(stage, row, world, out_ptr, start, stop, BLOCK)
    dl.shmem.quiet()
    finish_call(calls_ptr)


@jit
def all_reduce_two_shot_kernel(x_ptr, out_ptr, staging_ptr, flags_ptr, calls_ptr, m, row, slot_numel,
                               local_world_size, slices, BLOCK: tl.constexpr):
    """x and out have world_size * m elements (padded by the host). The slot holds world rows
    (`row` apart) for the reduce-scatter, then world rows for the gather of reduced chunks, each
    with a flag per slice. Program (rank, s) sums slices s, s + splits, ... of this rank's chunk into
    `out` and sends each to every peer; program (p, s) for a peer p sends p its chunk of x
    (`_send_chunks`), then copies p's reduced slices into `out` as they arrive. In place (out is x)
    is safe: chunk p of x is overwritten only by the program that sent it, after sending it."""
    epoch = call_epoch(calls_ptr)
    me = dl.rank()
    world = dl.num_ranks()
    peer = tl.program_id(0)
    stage = staging_ptr + (epoch % 2) * slot_numel
    flags = flags_ptr + (epoch % 2) * (2 * world * slices)
    gathered = stage + world * row
    gather_flags = flags + world * slices
    if peer == me:
        for j in range(tl.program_id(1), slices, tl.num_programs(1)):
            start, stop = split_bounds(m, j, slices, BLOCK)
            _sum_slice(x_ptr + me * m, stage, row, flags, epoch, slices, j, out_ptr + me * m, start, stop, BLOCK)
            sync_program()
            for step in range(1, world):
                push_slice(out_ptr + me * m, gathered + me * row, start, stop, gather_flags + me * slices + j, epoch,
                           (me + step) % world, local_world_size, BLOCK)
    else:
        _send_chunks(x_ptr, stage, flags, epoch, m, row, slices, local_world_size, BLOCK, WIDE=True)
        for j in range(tl.program_id(1), slices, tl.num_programs(1)):
            start, stop = split_bounds(m, j, slices, BLOCK)
            copy_slice(after_flags(gathered + peer * row, gather_flags + peer * slices + j, 1, epoch),
                       out_ptr + peer * m, start, stop, BLOCK)
    dl.shmem.quiet()
    finish_call(calls_ptr)


@jit
def all_reduce_symmetric_kernel(x_ptr, flags_ptr, calls_ptr, n, m, slices, BLOCK: tl.constexpr):
    """x (n elements) is symmetric and becomes the sum on every rank. Rank r owns chunk r (elements
    r*m to (r+1)*m, fewer for the last ranks); program s sums slices s, s + splits, ... of this
    rank's chunk over every rank's x and stores the sums into every rank's x, then raises flag
    (rank, s) on every peer and waits for flag (p, s) from every peer p: the same program's sums
    stored here. A chunk is read and written by its owner only, so the in-place stores are safe."""
    epoch = call_epoch(calls_ptr)
    me = dl.rank()
    world = dl.num_ranks()
    split = tl.program_id(0)
    splits = tl.num_programs(0)
    flags = flags_ptr + (epoch % 2) * (world * (splits + 1))
    ready = flags + world * splits
    if split == 0:
        notify_peers(ready + me, epoch)
    chunk = x_ptr + me * m
    for step in range(1, world):
        chunk = after_flags(chunk, ready + (me + step) % world, 1, epoch)
    length = tl.minimum(tl.maximum(n - me * m, 0), m)
    offsets = tl.arange(0, BLOCK)
    for j in range(split, slices, splits):
        start, stop = split_bounds(length, j, slices, BLOCK)
        for offset in range(start, stop, BLOCK):
            mask = offset + offsets < stop
            total = tl.zeros([BLOCK], tl.float32)
            for step in range(world):
                total += tl.load(dl.symm_at(chunk, (me + step) % world) + offset + offsets, mask=mask).to(tl.float32)
            total = total.to(x_ptr.dtype.element_ty)
            for step in range(world):
                tl.store(dl.symm_at(chunk, (me + step) % world) + offset + offsets, total, mask=mask)
    notify_peers(flags + me * splits + split, epoch)
    for step in range(1, world):
        dl.wait(flags + ((me + step) % world) * splits + split, 1, scope="sys", semantic="acquire", waitValue=epoch)
    finish_call(calls_ptr)


@jit
def reduce_ce_kernel(x_ptr, out_ptr, staging_ptr, flags_ptr, n, m, row, chunk, chunks, splits,
                     BLOCK: tl.constexpr):
    """out[:len] = the sum over ranks r of x_r[rank * m:][:len] (len = this rank's part of n, m per
    rank): this rank's term from x, rank r's from staging row r, where r's copy engines write it,
    block by block as r's chunks land (see `CopyEnginePush`). Summed in rank order, in fp32."""
    me = dl.rank()
    world = dl.num_ranks()
    length = tl.minimum(tl.maximum(n - me * m, 0), m)
    offsets = tl.arange(0, BLOCK)
    stage = staging_ptr
    arrived = tl.cast(-1, tl.int32)
    for block in range(tl.program_id(0), tl.cdiv(length, BLOCK), splits):
        start = block * BLOCK
        stop = tl.minimum(start + BLOCK, length)
        seen = arrived
        for peer in range(world):
            if peer != me:  # every peer's stream writes its chunks in the same order
                seen, stage = wait_chunks(flags_ptr + peer * chunks, arrived, stop, chunk, stage)
        arrived = seen
        mask = start + offsets < stop
        total = tl.zeros([BLOCK], tl.float32)
        for peer in range(world):
            if peer == me:
                total += tl.load(x_ptr + me * m + start + offsets, mask=mask).to(tl.float32)
            else:
                total += tl.load(stage + peer * row + start + offsets, mask=mask).to(tl.float32)
        tl.store(out_ptr + start + offsets, total.to(out_ptr.dtype.element_ty), mask=mask)


@jit
def reduce_ll_kernel(x_ptr, out_ptr, packets_ptr, calls_ptr, n, peer_stride, row, slot_numel, DTYPE: tl.constexpr,
                     splits, BLOCK: tl.constexpr):
    """x and out are viewed as int32 words, each one fp32 or two 16-bit floats of DTYPE. Rank p gets
    the sum over ranks of the n words at x + p * peer_stride: peer_stride is 0 for an all-reduce
    (every rank sums all of x) and n for a reduce-scatter (rank p sums chunk p). Program s sends
    its slice of what each peer sums to row `rank` of that peer's packets, then sums its slice over
    the ranks in rank order (its own words straight from x), so every rank gets the same bits."""
    epoch = call_epoch(calls_ptr)
    me = dl.rank()
    world = dl.num_ranks()
    stage = packets_ptr + (epoch % 2) * slot_numel
    start, stop = split_bounds(n, tl.program_id(0), splits, BLOCK)
    offsets = tl.arange(0, BLOCK)
    for step in range(1, world):
        peer = (me + step) % world
        remote = dl.symm_at(stage + me * row, peer)
        source = x_ptr + peer * peer_stride
        for offset in range(start, stop, BLOCK):
            mask = offset + offsets < stop
            dl.ll.send(remote + offset + offsets, tl.load(source + offset + offsets, mask=mask), epoch, mask)
    mine = x_ptr + me * peer_stride
    for offset in range(start, stop, BLOCK):
        mask = offset + offsets < stop
        own = tl.load(mine + offset + offsets, mask=mask)
        low = tl.zeros([BLOCK], tl.float32)
        high = tl.zeros([BLOCK], tl.float32)
        for peer in range(world):
            words = own
            if peer != me:
                words = dl.ll.recv(stage + peer * row + offset + offsets, epoch, mask)
            if DTYPE == tl.float32:
                low += tl.cast(words, tl.float32, bitcast=True)
            else:
                peer_low, peer_high = unpack_halves(words, DTYPE)
                low += peer_low
                high += peer_high
        if DTYPE == tl.float32:
            total = tl.cast(low, tl.int32, bitcast=True)
        else:
            total = pack_halves(low, high, DTYPE)
        tl.store(out_ptr + offset + offsets, total, mask=mask)
    finish_call(calls_ptr)


class ReduceScatter:
    """A sum reduce-scatter of `numel` elements of `dtype` per rank, with its own symmetric
    buffers: rank r gets the sum over ranks of chunk r (dim 0 of x cut in `world_size` chunks),
    summed in fp32 and rounded once.

    Build it on every rank at once; call it (`op(x, out)`) back to back on one stream, also in
    CUDA graphs; `free()` it on every rank. `tridist.ops.reduce_scatter` keeps one per shape,
    dtype, method and stream.

    | method | how | where |
    | --- | --- | --- |
    | `"ll"` | low-latency packets: chunk p travels to rank p with the call's epoch as the flag of every 4-byte word; summed in rank order | one node; small messages; chunks of whole 4-byte words |
    | `"one_shot"` | chunk p is cut in slices (about 128 KB), pushed to rank p, a flag after each; rank p's own programs sum each slice as every peer's arrives, so summing overlaps sending | any topology |
    | `"ce"` | the copy engines write chunk p into rank p's staging, a flag per 8 MB; a kernel sums the pieces as they land | one node; large messages next to other work on the SMs |
    | `"2d"` | summed on the node first: every rank pushes to its node's ranks the chunks they collect for each node, they sum them in fp32 and put one sum per other node (fp32, with its signal) to its owner | several nodes |
    | `"ring"` | each slice of the partial sums passes around the ring, each rank adding its part; partials travel in fp32 (twice the bytes of a 16-bit input) | any topology |
    | `"auto"` | [`choose_reduce_scatter`][tridist.ops.collectives.allreduce.choose_reduce_scatter]: `2d` across nodes, `ll` while a rank sends at most 1 MB, else `one_shot` | |

    Args:
        numel: elements of each rank's x, a multiple of the world size (0: calls do nothing).
        dtype: bf16, fp16 or fp32.
        method: one of the methods above.
        programs: the most programs (blocks, so SMs) a call's kernel runs (default: one per SM).

    Raises:
        ValueError: an unknown method, a dtype it does not take, `numel` not a non-negative
            multiple of the world size, `programs` not a positive int, a one-node method in a
            world of several nodes, buffers past 2^31 elements, or for `"ll"` chunks that are
            not whole 4-byte words.
    """

    def __init__(self, numel: int, dtype: torch.dtype, method: str = "auto", programs: int | None = None):
        if method not in REDUCE_SCATTER_METHODS:
            raise _protocol.method_error("reduce_scatter", method, REDUCE_SCATTER_METHODS)
        _protocol.check_build("reduce_scatter", numel, dtype)
        self.world = w = tridist.world()
        if numel % w.world_size:
            raise ValueError(f"reduce_scatter needs a multiple of world_size={w.world_size} elements, got {numel}")
        self.numel, self.dtype = numel, dtype
        self.method = choose_reduce_scatter(numel * dtype.itemsize, w) if method == "auto" else method
        if numel == 0:  # nothing to sum: no buffers, and calls return at once
            return
        if self.method in ("ll", "ce"):
            _protocol.require_one_node(f"reduce_scatter method {self.method!r}", "method='2d' or 'one_shot'")
        self.chunk = numel // w.world_size
        # staging holds a row per rank (the ring's fp32 partials: two, counted in elements of x)
        _protocol.check_offsets("reduce_scatter", 2 * w.world_size * row_stride(self.chunk))
        limit = _protocol.programs_limit(programs, w)
        if self.method == "ll":  # all the programs, `PacketRows` splits them
            self.workspace = PacketRows("reduce_scatter", self.chunk * dtype.itemsize, limit)
            return
        if self.method in ("ce", "one_shot"):  # programs per destination; `ring` and `2d` take all of them
            limit = max(1, limit // w.world_size)
        step_bytes = _protocol.CE_STEP_BYTES if self.method == "ce" else _protocol.STEP_BYTES
        self.block, self.splits, self.warps = _protocol.steps_for(self.chunk, dtype.itemsize, limit, step_bytes)
        self.row = row = row_stride(self.chunk)
        if self.method == "ce":
            self.transfer = CopyEnginePush(self.chunk, dtype, name="reduce_scatter ce")
        elif self.method == "ring":  # fp32 partials: world-1 received and world-1 sent rows
            self.workspace = Workspace(2 * max(1, w.world_size - 1) * row, torch.float32, w.world_size * self.splits,
                                       "reduce_scatter ring")
        elif self.method == "2d":  # flags for the rows, then for the node sums
            self.workspace = Workspace(w.world_size * row, dtype, (w.world_size + w.nnodes) * self.splits,
                                       "reduce_scatter 2d")
            self.sums = tridist.symm_empty((2, 2 * w.nnodes * row), torch.float32)
        else:  # "one_shot"
            self.slices = _protocol.slices_for(self.chunk, dtype.itemsize, self.splits)
            self.workspace = Workspace(w.world_size * row, dtype, w.world_size * self.slices, "reduce_scatter one_shot")

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Sum `x` over ranks and give this rank its chunk.

        Args:
            x: `numel` elements of `dtype` (as built), contiguous, on this rank's device, dim 0 a
                multiple of the world size.
            out: `x.shape[0] // world_size` rows of `x`'s other dimensions, `x`'s dtype; a new
                tensor if None.

        Returns:
            `out`: chunk `rank` of the sum over ranks.

        Raises:
            ValueError: `x` or `out` not what this instance was built for, on any rank
                (`_protocol.agree` says when every rank checks).
        """
        w = self.world

        def check() -> None:
            _protocol.check_same(x, self.numel, self.dtype, "reduce-scatter")
            check_scattered(x, out, w)

        _protocol.agree("reduce_scatter", check, {"shape and dtype of x": shape_of(x)})
        if out is None:
            out = torch.empty(scattered_shape(x, w), dtype=x.dtype, device=x.device)
        if self.numel == 0:
            return out
        if self.method == "ll":
            _reduce_packets(self.workspace, x, out, peer_stride=self.workspace.words)
            return out
        if self.method == "ce":
            transfer = self.transfer
            transfer.barrier()
            transfer.push(x.view(w.world_size, -1))
            reduce_ce_kernel[(self.splits,)](x, out, transfer.staging, transfer.flags, self.numel, self.chunk,
                                             transfer.row, transfer.chunk, transfer.chunks, splits=self.splits,
                                             BLOCK=self.block, num_warps=self.warps)
            transfer.join()
            return out
        ws = self.workspace
        if self.method == "2d":
            reduce_scatter_2d_kernel[(self.splits,)](x, out, ws.staging, self.sums, ws.flags, ws.calls, self.chunk,
                                                     self.row, ws.slot_numel, w.local_world_size, splits=self.splits,
                                                     BLOCK=self.block, num_warps=self.warps)
        elif self.method == "ring":
            reduce_scatter_ring_kernel[(self.splits,)](x, out, ws.staging, ws.flags, ws.calls, self.chunk, self.row,
                                                       ws.slot_numel, w.local_world_size, splits=self.splits,
                                                       BLOCK=self.block, num_warps=self.warps)
        else:  # "one_shot"
            reduce_scatter_kernel[(w.world_size, self.splits)](x, out, ws.staging, ws.flags, ws.calls, self.chunk,
                                                               self.row, ws.slot_numel, w.local_world_size,
                                                               self.slices, BLOCK=self.block, num_warps=self.warps)
        return out

    def free(self) -> None:
        """Give the symmetric buffers back (collective: every rank, in the same order)."""
        if self.numel == 0:
            return
        if self.method == "ce":
            self.transfer.free()
            return
        if self.method == "2d":
            tridist.symm_free(self.sums)
        self.workspace.free()


class AllReduce:
    """A sum all-reduce of `numel` elements of `dtype` per rank, with its own symmetric buffers:
    every rank gets the sum over ranks, summed in fp32 and rounded once, the same bits on every
    rank.

    Build it on every rank at once; call it (`op(x, out)`) back to back on one stream, also in
    CUDA graphs; `free()` it on every rank. `tridist.ops.all_reduce` keeps one per shape, dtype,
    method and stream.

    | method | how | where |
    | --- | --- | --- |
    | `"ll"` | one-shot in low-latency packets: all of x to every peer, each 4-byte word with the call's epoch as its flag; summed in rank order | one node; small messages; whole 4-byte words |
    | `"one_shot"` | every program pushes its slice of x to every peer, raises a flag, waits for every peer's and sums the rows it received: one step, `world_size - 1` copies of the data received per rank | any topology; while latency dominates |
    | `"two_shot"` | a sliced reduce-scatter, then the program that summed a slice pushes the sum to every peer: each rank receives `2 (n-1)/n` of the data | any topology; large messages |
    | `"ce"` | a copy-engine reduce-scatter, then a copy-engine all-gather of the sums | one node; large messages next to other work on the SMs |
    | `"auto"` | [`choose_all_reduce`][tridist.ops.collectives.allreduce.choose_all_reduce]: `ll` while a rank sends at most 1 MB (one node), `one_shot` up to 4 MB sent, else `two_shot` (on one node in place on a symmetric x: `two_shot` from 1 MB) | |

    With `symmetric_in_place`, every call reduces a symmetric x (`tridist.symm_empty`, the same
    tensor on every rank) in place (`out=x`). On one node the two-shot then needs no staging: rank
    r reads chunk r of every rank's x through `symm_at`, sums it and stores the sum into every
    rank's x, as PyTorch's `two_shot_all_reduce_` does (from 64 MB with two programs per SM).

    Args:
        numel: elements of each rank's x (0: calls do nothing).
        dtype: bf16, fp16 or fp32.
        method: one of the methods above.
        programs: the most programs (blocks, so SMs) a call's kernels run (default: one per SM).
        symmetric_in_place: every call passes a symmetric x with `out=x`.

    Raises:
        ValueError: an unknown method, a dtype it does not take, `numel` not a non-negative
            int, `programs` not a positive int, a one-node method in a world of several nodes,
            buffers past 2^31 elements, or for `"ll"` data that is not whole 4-byte words.
    """

    def __init__(self, numel: int, dtype: torch.dtype, method: str = "auto", programs: int | None = None,
                 symmetric_in_place: bool = False):
        if method not in ALL_REDUCE_METHODS:
            raise _protocol.method_error("all_reduce", method, ALL_REDUCE_METHODS)
        _protocol.check_build("all_reduce", numel, dtype)
        self.world = w = tridist.world()
        self.numel, self.dtype = numel, dtype
        self.symmetric_in_place = symmetric_in_place
        self.method = (choose_all_reduce(numel * dtype.itemsize, w, symmetric_in_place) if method == "auto"
                       else method)
        if numel == 0:  # nothing to sum: no buffers, and calls return at once
            return
        self.direct = symmetric_in_place and self.method == "two_shot" and w.nnodes == 1
        # one-shot and LL staging hold all of x per rank; the others a chunk per rank, twice
        whole = self.method in ("one_shot", "ll")
        _protocol.check_offsets("all_reduce", w.world_size * row_stride(numel) if whole else
                                2 * w.world_size * row_stride(triton.cdiv(numel, w.world_size)))
        limit = _protocol.programs_limit(programs, w)
        if self.method in ("ll", "ce"):
            _protocol.require_one_node(f"all_reduce method {self.method!r}", "method='one_shot' or 'two_shot'")
        if self.method == "ll":
            self.workspace = PacketRows("all_reduce", numel * dtype.itemsize, limit)
        elif self.method == "one_shot":
            self.block, self.splits, self.warps = _protocol.steps_for(numel, dtype.itemsize, limit)
            self.row = row_stride(numel)
            self.workspace = Workspace(w.world_size * self.row, dtype, w.world_size * self.splits,
                                       "all_reduce one_shot")
        elif self.method == "ce":
            self.chunk = triton.cdiv(numel, w.world_size)
            self.block, self.splits, self.warps = _protocol.steps_for(self.chunk, dtype.itemsize,
                                                                      max(1, limit // w.world_size),
                                                                      _protocol.CE_STEP_BYTES)
            self.scatter = CopyEnginePush(self.chunk, dtype, name="all_reduce ce scatter")
            self.gather = CopyEnginePush(self.chunk, dtype, name="all_reduce ce gather")
        elif self.direct:
            self.chunk = triton.cdiv(numel, w.world_size)
            if programs is None and numel * dtype.itemsize >= SYMMETRIC_TWO_PER_SM_BYTES:
                limit *= 2
            self.block, self.splits, self.warps = _protocol.steps_for(self.chunk, dtype.itemsize, limit)
            self.slices = _protocol.slices_for(self.chunk, dtype.itemsize, self.splits)
            self.workspace = Workspace(0, dtype, w.world_size * (self.splits + 1), "all_reduce symmetric two_shot")
        else:  # "two_shot" through staging
            self.chunk = triton.cdiv(numel, w.world_size)
            self.block, self.splits, self.warps = _protocol.steps_for(self.chunk, dtype.itemsize,
                                                                      max(1, limit // w.world_size))
            self.slices = _protocol.slices_for(self.chunk, dtype.itemsize, self.splits)
            self.row = row_stride(self.chunk)
            self.workspace = Workspace(2 * w.world_size * self.row, dtype, 2 * w.world_size * self.slices,
                                       "all_reduce two_shot")
            self.padded = None if self.chunk * w.world_size == numel else torch.zeros(
                2, self.chunk * w.world_size, dtype=dtype, device=w.device)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Sum `x` over ranks into `out`.

        Args:
            x: `numel` elements of `dtype` (as built), contiguous, on this rank's device.
            out: `x`'s shape and dtype; a new tensor if None; `x` itself for in place (required
                with `symmetric_in_place`).

        Returns:
            `out`, the sum over ranks.

        Raises:
            ValueError: `x` or `out` not what this instance was built for, on any rank; with
                `symmetric_in_place`, ranks passed different tensors (`_protocol.agree` says when
                every rank checks).
        """
        def check() -> None:
            _protocol.check_same(x, self.numel, self.dtype, "all-reduce")
            if out is not None:
                check_output(out, tuple(x.shape), x.dtype)
            if self.symmetric_in_place and (out is None or out.data_ptr() != x.data_ptr()
                                            or not tridist.is_symmetric(x)):
                raise ValueError("this all-reduce was built with symmetric_in_place=True: call it with out=x, x a "
                                 "symmetric tensor (tridist.symm_empty), the same on every rank")

        _protocol.agree("all_reduce", check, {"shape and dtype of x": shape_of(x),
                                              "x": symmetric_identity(x) if self.symmetric_in_place else "any"})
        if out is None:
            out = torch.empty_like(x)
        if self.numel == 0:
            return out
        if self.direct:
            ws = self.workspace
            all_reduce_symmetric_kernel[(self.splits,)](x, ws.flags, ws.calls, self.numel, self.chunk, self.slices,
                                                        BLOCK=self.block, num_warps=self.warps)
            return out
        if self.method == "ce":
            self._copy_engines(x, out)
            return out
        if self.method == "ll":
            _reduce_packets(self.workspace, x, out, peer_stride=0)
            return out
        ws = self.workspace
        if self.method == "one_shot":
            all_reduce_one_shot_kernel[(self.splits,)](x, out, ws.staging, ws.flags, ws.calls, self.numel, self.row,
                                                       ws.slot_numel, self.world.local_world_size, splits=self.splits,
                                                       BLOCK=self.block, num_warps=self.warps)
            return out
        source, target = x, out
        if self.padded is not None:
            self.padded[0, :self.numel].copy_(x.view(-1))
            source, target = self.padded[0], self.padded[1]
        all_reduce_two_shot_kernel[(self.world.world_size, self.splits)](
            source, target, ws.staging, ws.flags, ws.calls, self.chunk, self.row, ws.slot_numel,
            self.world.local_world_size, self.slices, BLOCK=self.block, num_warps=self.warps)
        if self.padded is not None:
            out.view(-1).copy_(target[:self.numel])
        return out

    def _copy_engines(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """A reduce-scatter, then an all-gather of the reduced parts, both moved by copy engines.
        In place (out is x) is safe: a peer's reduced part overwrites x only after the peer has
        received all of this rank's x that it needed."""
        w, m, n = self.world, self.chunk, self.numel
        source, target = x.view(-1), out.view(-1)
        mine = target[min(w.rank * m, n):min((w.rank + 1) * m, n)]
        self.scatter.barrier()  # every peer is done with the last call, with both stagings
        self.scatter.push([source[min(p * m, n):min((p + 1) * m, n)] for p in range(w.world_size)])
        reduce_ce_kernel[(self.splits,)](source, mine, self.scatter.staging, self.scatter.flags, n, m,
                                         self.scatter.row, self.scatter.chunk, self.scatter.chunks,
                                         splits=self.splits, BLOCK=self.block, num_warps=self.warps)
        self.gather.push([mine] * w.world_size)
        all_gather_ce_kernel[(w.world_size, self.splits)](target, target, self.gather.staging, self.gather.flags, m, n,
                                                          self.gather.row, self.gather.chunk, self.gather.chunks,
                                                          COPY_OWN=False, splits=self.splits, BLOCK=self.block,
                                                          num_warps=self.warps)
        self.scatter.join()
        self.gather.join()

    def free(self) -> None:
        """Give the symmetric buffers back (collective: every rank, in the same order)."""
        if self.numel == 0:
            return
        if self.method == "ce":
            self.scatter.free()
            self.gather.free()
        else:
            self.workspace.free()


def _reduce_packets(packets: PacketRows, x: torch.Tensor, out: torch.Tensor, peer_stride: int) -> None:
    reduce_ll_kernel[(packets.splits,)](x.view(-1).view(torch.int32), out.view(-1).view(torch.int32), packets.staging,
                                        packets.calls, packets.words, peer_stride, packets.row, packets.slot_numel,
                                        DTYPE=_protocol.TRITON_DTYPES[x.dtype], splits=packets.splits, BLOCK=LL_BLOCK)


def scattered_shape(x: torch.Tensor, world) -> tuple:
    """The shape of a rank's part of the reduce-scatter of `x`: dim 0 cut in `world_size` chunks."""
    return (x.shape[0] // world.world_size, *x.shape[1:])


def check_scattered(x: torch.Tensor, out: torch.Tensor | None, world) -> None:
    """x's dim 0 splits in `world_size` chunks, and `out` (unless None) is one of them."""
    if x.dim() == 0 or x.shape[0] % world.world_size:
        raise ValueError(f"reduce_scatter splits dim 0 of x ({tuple(x.shape)}) into {world.world_size} chunks; make "
                         "it a multiple of the world size")
    if out is not None:
        check_output(out, scattered_shape(x, world), x.dtype)


def choose_reduce_scatter(nbytes: int, world) -> str:
    """The method `"auto"` runs for a reduce-scatter of `nbytes` per rank.

    From the runs on H200s joined by NVLink, bf16 (benchmarks/results/reducescatter-*.json): LL
    packets up to 1 MB of x (2 ranks, 2026-11-23: 3.6 us at 4 KB, 6.8 us at 1 MB; 4 ranks similar
    on 2026-11-22); each rank sends (world-1)/world of x, so the limit is the all-reduce's 1 MB sent.
    Above, the sliced one-shot (2 ranks: 13.7 us at 4 MB, 115 us at 64 MB, 407 us at 256 MB, where
    the copy engines took 32.9, 168 and 531); one-shot also won at 4 ranks from 4 MB (2026-11-22).
    Across nodes "2d" puts each node's sum over the network once (not measured across nodes yet)."""
    n = world.world_size
    if world.nnodes > 1:
        return "2d"
    if n > 1 and nbytes * (n - 1) // n <= 1 << 20 and (nbytes // n) % 4 == 0:
        return "ll"
    return "one_shot"


def choose_all_reduce(nbytes: int, world, symmetric_in_place: bool = False) -> str:
    """The method `"auto"` runs for an all-reduce of `nbytes` per rank.

    By what each rank sends, from the runs on H200s joined by NVLink, bf16
    (benchmarks/results/allreduce-*.json): LL packets (twice the bytes, no signal round trip) were
    fastest up to 1 MB sent (2 ranks, 2026-11-23: 3.7-9.8 us; 4 ranks, 2026-11-22: 5.2-9.4 us up to
    256 KB), one-shot up to 4 MB sent (2 ranks: 23.5 us, two-shot 23.7), then the sliced two-shot
    (2 ranks: 73 us at 16 MB, 232 at 64 MB, 861 at 256 MB; the copy engines took 110, 303, 1089;
    4 ranks, before the two-shot was sliced: 42-1878 us from 4 MB to 256 MB). In place on a symmetric
    x the two-shot needs no staging, and takes over from LL (2 ranks, allreduce-symmetric-*.json:
    4 MB 21.7 us against one-shot's 22.8)."""
    n = world.world_size
    sent = nbytes * (n - 1)
    if world.nnodes == 1 and sent <= 1 << 20 and nbytes % 4 == 0:
        return "ll"
    if sent <= 4 << 20 and not (symmetric_in_place and world.nnodes == 1):
        return "one_shot"
    return "two_shot"


def reduce_scatter(x: torch.Tensor, out: torch.Tensor | None = None, method: str = "auto") -> torch.Tensor:
    """Sum `x` over ranks and give rank r the r-th of `world_size` chunks of dim 0, like
    `torch.distributed.reduce_scatter_tensor`; summed in fp32, rounded once.

    A collective: every rank calls it with the same shape, dtype and method. An empty `x` (on
    every rank) gives an empty `out` and moves nothing. Keeps one
    [`ReduceScatter`][tridist.ops.ReduceScatter] per shape, dtype, method and stream (its table
    lists the methods).

    Args:
        x: contiguous, on this rank's device, bf16, fp16 or fp32, dim 0 a multiple of the world
            size.
        out: `x.shape[0] // world_size` rows of `x`'s other dimensions, `x`'s dtype; a new
            tensor if None.
        method: `"auto"` or one of `ReduceScatter`'s methods.

    Returns:
        `out`.

    Raises:
        ValueError: before any launch, on every rank: a dtype, device, layout or size it does not
            take on any rank, ranks that disagree on the shape, dtype or method, an unknown
            method, or a one-node method on several nodes (see `ReduceScatter`).
        TypeError: `x` is not a tensor.
    """
    def check() -> None:
        check_input(x, "x")
        if method not in REDUCE_SCATTER_METHODS:
            raise _protocol.method_error("reduce_scatter", method, REDUCE_SCATTER_METHODS)
        check_scattered(x, out, tridist.world())

    _protocol.agree("reduce_scatter", check, {"shape and dtype of x": shape_of(x), "method": method})
    op = _protocol.instance(lambda: ReduceScatter(x.numel(), x.dtype, method), ReduceScatter, x.numel(), x.dtype,
                            method, device=x.device)
    return op(x, out)


def all_reduce(x: torch.Tensor, out: torch.Tensor | None = None, method: str = "auto") -> torch.Tensor:
    """Sum `x` over ranks into `out`, a new tensor unless given: out of place, where
    `torch.distributed.all_reduce` sums in place (that is `all_reduce_(x)`, or `out=x`); summed
    in fp32, rounded once, the same bits on every rank.

    A collective: every rank calls it with the same shape, dtype and method, and a symmetric x
    in place on every rank or on none. An empty `x` (on every rank) moves nothing. Keeps one
    [`AllReduce`][tridist.ops.AllReduce] per shape, dtype, method and stream (its table lists the
    methods).

    Args:
        x: contiguous, on this rank's device, bf16, fp16 or fp32.
        out: `x`'s shape and dtype; a new tensor if None; `x` for in place. In place on a
            symmetric x (`tridist.symm_empty`) on one node, the two-shot reduces it without
            staging: what `"auto"` runs once a rank sends more than 1 MB.
        method: `"auto"` or one of `AllReduce`'s methods.

    Returns:
        `out` (a new tensor if None was given): the sum over ranks.

    Raises:
        ValueError: before any launch, on every rank: a dtype, device, layout or size it does not
            take on any rank, ranks that disagree on the shape, dtype, method or a symmetric x in
            place, an unknown method, or a one-node method on several nodes (see `AllReduce`).
        TypeError: `x` is not a tensor.
    """
    def check() -> None:
        check_input(x, "x")
        if method not in ALL_REDUCE_METHODS:
            raise _protocol.method_error("all_reduce", method, ALL_REDUCE_METHODS)
        if out is not None:
            check_output(out, tuple(x.shape), x.dtype)

    in_place = isinstance(x, torch.Tensor) and isinstance(out, torch.Tensor) and out.data_ptr() == x.data_ptr()
    _protocol.agree("all_reduce", check, {"shape and dtype of x": shape_of(x), "method": method,
                                          "x in place": symmetric_identity(x) if in_place else "not in place"})
    symmetric = in_place and tridist.is_symmetric(x)
    op = _protocol.instance(lambda: AllReduce(x.numel(), x.dtype, method, symmetric_in_place=symmetric), AllReduce,
                            x.numel(), x.dtype, method, symmetric, device=x.device)
    return op(x, out)


def all_reduce_(x: torch.Tensor, method: str = "auto") -> torch.Tensor:
    """Sum `x` over ranks in place, as `torch.distributed.all_reduce(x)` does: `all_reduce(x,
    out=x)`. On a symmetric x (`tridist.symm_empty`, the same tensor on every rank) on one node,
    the two-shot sums it without staging (see `all_reduce`).

    Args:
        x: contiguous, on this rank's device, bf16, fp16 or fp32; regular or symmetric.
        method: `"auto"` or one of `AllReduce`'s methods.

    Returns:
        `x`, which now holds the sum over ranks (summed in fp32, rounded once, the same bits on
        every rank).

    Raises:
        ValueError, TypeError: as `all_reduce`.
    """
    return all_reduce(x, out=x, method=method)


@torch.library.custom_op("tridist::reduce_scatter", mutates_args=())
def reduce_scatter_op(x: torch.Tensor, method: str = "auto") -> torch.Tensor:
    """`reduce_scatter` as a PyTorch custom op (`torch.ops.tridist.reduce_scatter`)."""
    return reduce_scatter(x, method=method)


@reduce_scatter_op.register_fake
def _reduce_scatter_shape(x: torch.Tensor, method: str = "auto") -> torch.Tensor:
    return x.new_empty((x.shape[0] // tridist.world().world_size, *x.shape[1:]))


@torch.library.custom_op("tridist::all_reduce", mutates_args=())
def all_reduce_op(x: torch.Tensor, method: str = "auto") -> torch.Tensor:
    """`all_reduce` (out of place) as a PyTorch custom op (`torch.ops.tridist.all_reduce`)."""
    return all_reduce(x, method=method)


@all_reduce_op.register_fake
def _all_reduce_shape(x: torch.Tensor, method: str = "auto") -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("tridist::all_reduce_", mutates_args=("x",))
def all_reduce_in_place_op(x: torch.Tensor, method: str = "auto") -> None:
    """`all_reduce_` (in place) as a PyTorch custom op (`torch.ops.tridist.all_reduce_`), which
    torch.compile knows to mutate `x`."""
    all_reduce_(x, method=method)


@all_reduce_in_place_op.register_fake
def _all_reduce_in_place_shape(x: torch.Tensor, method: str = "auto") -> None:
    return None
