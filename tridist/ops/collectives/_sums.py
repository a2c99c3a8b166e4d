"""Device helpers of the methods that sum staged rows in fp32 (reduce-scatter one-shot, 2d; all-reduce
one-shot, two-shot).

Every sum runs in fp32 whatever the element type and is rounded once, when it is stored. Staging
rows are `row` elements apart: row p holds what rank p sent (see each method's protocol).
"""
import triton
import triton.language as tl

import tridist.language as dl

from ..protocol import after_flags, push_slice, split_bounds


@triton.jit
def sum_rows(stage_ptr, row_stride, rows, out_ptr, start, stop, BLOCK: tl.constexpr):
    """out[start:stop] = the sum of `rows` rows from `stage_ptr` (`row_stride` elements apart), in
    row order. The caller has waited for every row."""
    offsets = tl.arange(0, BLOCK)
    for offset in range(start, stop, BLOCK):
        mask = offset + offsets < stop
        total = tl.zeros([BLOCK], tl.float32)
        for row in range(rows):
            total += tl.load(stage_ptr + row * row_stride + offset + offsets, mask=mask).to(tl.float32)
        tl.store(out_ptr + offset + offsets, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def send_chunks(x_ptr, stage, flags, epoch, m, row, slices, local_world_size, BLOCK: tl.constexpr,
                WIDE: tl.constexpr, group=None):
    """Program (p, s) for a peer p: slices s, s + splits, ... of chunk p of x (m elements) into row
    `rank` of p's staging, each followed by p's flag (rank, slice). WIDE as in `push_slice` (16-byte
    stores to the peer, or 2 bytes at a time for 16-bit data): the reduce-scatter sends narrow, the
    two-shot all-reduce wide, each what was faster for it (benchmarks/NOTES.md, "Moved from the
    code's docstrings (issue 41)"). Ranks, peers and `local_world_size` are `group`'s, if given."""
    me = dl.rank(group)
    peer = tl.program_id(0)
    for j in range(tl.program_id(1), slices, tl.num_programs(1)):
        start, stop = split_bounds(m, j, slices, BLOCK)
        push_slice(x_ptr + peer * m, stage + me * row, start, stop, flags + me * slices + j, epoch, peer,
                   local_world_size, BLOCK, WIDE, group=group)


@triton.jit
def sum_slice(own_ptr, stage, row, flags, epoch, slices, j, out_ptr, start, stop, BLOCK: tl.constexpr, group=None):
    """out[start:stop] = the sum over ranks (of `group`, if given), in rank order, of this rank's term
    (`own_ptr`) and each peer p's (staging row p, once p's flag (p, j) is up), in fp32."""
    me = dl.rank(group)
    world = dl.num_ranks(group)
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
