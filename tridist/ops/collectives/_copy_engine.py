"""The kernels that consume copy-engine transfers (`copy_engines.CopyEnginePush`), which the "ce"
methods share: all-gather "ce" and all-reduce "ce" copy rows out of staging, reduce-scatter "ce" and
all-reduce "ce" sum them.

Protocol (`CopyEnginePush`): rank r's copy engines write its data into row r of every peer's
staging, chunk by chunk, and set flag (r, chunk) there to 1 after each. One stream writes a row's
chunks in order, so a flag that is up says every earlier chunk of that row has landed too: a
program waits only for the chunk holding the last element it reads (`wait_chunks`). The flags are
1, not an epoch: the owner zeroes them after the call (`CopyEnginePush.join`), and the next call
starts with a barrier, after which every peer has done so.
"""
import triton.language as tl

import tridist.language as dl
from tridist.runtime.jit import jit

from ..copy_engines import wait_chunks


@jit
def all_gather_ce_kernel(x_ptr, out_ptr, staging_ptr, flags_ptr, n, total, row, chunk, chunks,
                         COPY_OWN: tl.constexpr, splits, BLOCK: tl.constexpr, group=None):
    """out[p * n:] gets rank p's part (n elements, fewer for the last ranks if `total` is short):
    from x for this rank (if COPY_OWN), for the others from staging row p as its chunks land.
    Program (p, s) copies blocks s, s + splits, ... of part p, so all programs of a row work on a
    chunk as soon as it is there. Ranks are `group`'s, if given."""
    me = dl.rank(group)
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
def reduce_ce_kernel(x_ptr, out_ptr, staging_ptr, flags_ptr, n, m, row, chunk, chunks, splits,
                     BLOCK: tl.constexpr, group=None):
    """out[:len] = the sum over ranks r of x_r[rank * m:][:len] (len = this rank's part of n, m per
    rank): this rank's term from x, rank r's from staging row r, where r's copy engines write it,
    block by block as r's chunks land. Summed in rank order, in fp32. Ranks are `group`'s, if given."""
    me = dl.rank(group)
    world = dl.num_ranks(group)
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
