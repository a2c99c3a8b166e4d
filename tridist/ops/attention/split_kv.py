"""Split-KV decode attention over this rank's slice of the KV cache.

Decoding attends one query per sequence over every cached position: little arithmetic, and K and V
read once. One program per KV head and sequence leaves most SMs idle when the batch is small and
the sequences long, so each sequence's positions are cut in `splits` chunks of whole `BLOCK_N`
tiles and program (unit, split) attends over one chunk, a unit being a (sequence b, KV head h)
pair. Under grouped-query attention (GQA) the GROUP = Hq / Hkv query heads of KV head h share that
program, so K and V are read once for all of them: the queries are the rows of a dot product
padded to 16, the least a tensor-core dot takes.

A sequence attends over positions 0 ... seqlens[b] - 1 of its cache; with a mask (MASKED), only
those of them the mask allows (`mask[b, p]` nonzero: left padding, or any other pattern of holes).
A tile whose positions are all masked loads no K or V (the loads are predicated on the mask), so
holes cost only the mask's bytes.

Program (unit, split) writes its chunk's record (`_records`: outputs and log-sum-exps) to `partials`
row (unit * splits + split), and that is all: no program waits or counts, so the grid need not be
resident at once. The combine kernel, queued after it, merges the records; launched as this kernel's
programmatic dependent (`dl.launch_dependents`), it starts while this kernel's last programs run.
"""
import triton
import triton.language as tl

import tridist.language as dl
from tridist.runtime.jit import jit

from ._records import finish_record, record_size, store_record

LOG2E = tl.constexpr(1.4426950408889634)  # scores in base 2: exp2 is one instruction


@triton.constexpr_function
def query_rows(group):
    """Rows of a group's query block: the group padded to a power of two, at least 16 (the fewest
    rows of a tensor-core dot)."""
    return max(16, triton.next_power_of_2(group))


@triton.jit
def _row_offsets(positions, valid, b, h, seq_stride, row_stride, head_stride, table_ptr, table_stride,
                 PAGE: tl.constexpr):
    """int64 element offsets of K/V rows (head h) for `positions` of sequence b: a cache indexed
    [B, L, Hkv, D] (PAGE 0) or paged [blocks, PAGE, Hkv, D] (block ids from the table's row b), its
    first three dimensions `seq_stride`, `row_stride` and `head_stride` elements apart (so that
    transformers' [B, Hkv, L, D] cache, transposed, is read in place)."""
    if PAGE == 0:
        rows = b.to(tl.int64) * seq_stride + positions.to(tl.int64) * row_stride
    else:
        block = tl.load(table_ptr + b * table_stride + positions // PAGE, mask=valid, other=0)
        rows = block.to(tl.int64) * seq_stride + (positions % PAGE).to(tl.int64) * row_stride
    return rows + h.to(tl.int64) * head_stride


@jit
def flash_decode_split_kernel(q_ptr, k_ptr, v_ptr, seqlens_ptr, table_ptr, mask_ptr, partials_ptr, sm_scale,
                              seq_stride, row_stride, head_stride, table_stride, mask_stride, splits, kv_heads,
                              GROUP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
                              MASKED: tl.constexpr):
    """Program (unit, split); unit = b * kv_heads + h. q is [B, Hq, D] (query heads h * GROUP to
    h * GROUP + GROUP - 1 belong to KV head h); seqlens int32 [B]; K/V addressed as `_row_offsets`
    says (the block table's rows `table_stride` apart); with MASKED, mask bytes [B, >= L] (rows
    `mask_stride` apart), a position attended only where its byte is nonzero."""
    # The combine kernel may take the SMs this launch's last programs leave (its programs wait for
    # this kernel to end before they read a record).
    dl.launch_dependents()
    unit = tl.program_id(0)
    split = tl.program_id(1)
    b = unit // kv_heads
    h = unit % kv_heads
    ROWS: tl.constexpr = query_rows(GROUP)
    seqlen = tl.load(seqlens_ptr + b)
    per_split = tl.cdiv(tl.cdiv(seqlen, splits), BLOCK_N) * BLOCK_N
    start = tl.minimum(split * per_split, seqlen)
    stop = tl.minimum(start + per_split, seqlen)

    heads = tl.arange(0, ROWS)
    cols = tl.arange(0, D)
    q = tl.load(q_ptr + (unit * GROUP + heads)[:, None] * D + cols[None, :], mask=(heads < GROUP)[:, None], other=0.0)
    scale = sm_scale * LOG2E
    m = tl.full([ROWS], float("-inf"), tl.float32)
    l = tl.zeros([ROWS], tl.float32)  # noqa: E741
    acc = tl.zeros([ROWS, D], tl.float32)
    for first in range(start, stop, BLOCK_N):
        positions = first + tl.arange(0, BLOCK_N)
        valid = positions < stop
        if MASKED:
            valid = valid & (tl.load(mask_ptr + b.to(tl.int64) * mask_stride + positions, mask=valid, other=0) != 0)
        rows = _row_offsets(positions, valid, b, h, seq_stride, row_stride, head_stride, table_ptr, table_stride,
                            PAGE)
        k = tl.load(k_ptr + rows[:, None] + cols[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + rows[:, None] + cols[None, :], mask=valid[:, None], other=0.0)
        s = dl.dot(q, tl.trans(k), tl.zeros([ROWS, BLOCK_N], tl.float32)) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        pivot = m_new  # unmasked, finite: every tile holds a valid position
        if MASKED:  # every position so far masked: all weights 0
            pivot = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - pivot)
        p = tl.exp2(s - pivot[:, None])
        l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
        acc = dl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m = m_new
    o, lse = finish_record(acc, m[:, None], l[:, None])
    store_record(partials_ptr + (unit * splits + split) * record_size(GROUP, D), o, lse, GROUP, D)
