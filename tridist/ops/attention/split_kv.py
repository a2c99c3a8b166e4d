"""Split-KV decode attention over this rank's slice of the KV cache.

Decoding attends one query per sequence over every cached position: little arithmetic, and K and V
read once. One program per KV head and sequence leaves most SMs idle when the batch is small and
the sequences long, so each sequence's positions are cut in `splits` chunks of whole `BLOCK_N`
tiles and program (unit, split) attends over one chunk, a unit being a (sequence b, KV head h)
pair. Under grouped-query attention (GQA) the GROUP = Hq / Hkv query heads of KV head h share that
program, so K and V are read once for all of them: the queries are the rows of a dot product
padded to 16, the least a tensor-core dot takes.

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
def _row_offsets(positions, valid, b, h, seq_stride, row_stride, table_ptr, table_stride, PAGE: tl.constexpr,
                 D: tl.constexpr):
    """int64 element offsets of K/V rows (head h) for `positions` of sequence b: contiguous
    ([B, L, Hkv, D], PAGE 0) or paged ([blocks, PAGE, Hkv, D], block ids from the table's row b)."""
    if PAGE == 0:
        rows = b.to(tl.int64) * seq_stride + positions.to(tl.int64) * row_stride
    else:
        block = tl.load(table_ptr + b * table_stride + positions // PAGE, mask=valid, other=0)
        rows = (block.to(tl.int64) * PAGE + positions % PAGE) * row_stride
    return rows + h * D


@jit
def flash_decode_split_kernel(q_ptr, k_ptr, v_ptr, seqlens_ptr, table_ptr, partials_ptr, sm_scale, seq_stride,
                              row_stride, table_stride, splits, kv_heads, GROUP: tl.constexpr, D: tl.constexpr,
                              BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    """Program (unit, split); unit = b * kv_heads + h. q is [B, Hq, D] (query heads h * GROUP to
    h * GROUP + GROUP - 1 belong to KV head h); seqlens int32 [B]; K/V rows `row_stride` (Hkv * D)
    elements apart, sequences `seq_stride` apart (contiguous) or gathered through the block table
    (PAGE > 0, rows `table_stride` apart)."""
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
        rows = _row_offsets(positions, valid, b, h, seq_stride, row_stride, table_ptr, table_stride, PAGE, D)
        k = tl.load(k_ptr + rows[:, None] + cols[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + rows[:, None] + cols[None, :], mask=valid[:, None], other=0.0)
        s = dl.dot(q, tl.trans(k), tl.zeros([ROWS, BLOCK_N], tl.float32)) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: every tile holds a valid position
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
        acc = dl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m = m_new
    o, lse = finish_record(acc, m[:, None], l[:, None])
    store_record(partials_ptr + (unit * splits + split) * record_size(GROUP, D), o, lse, GROUP, D)
