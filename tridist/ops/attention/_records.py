"""Records of partial attention, and how they merge: what the split-KV kernel writes and the
combine kernel reads.

A record is the attention of a group of query heads (the GROUP = Hq / Hkv heads of one KV head, of
one sequence) over some set of positions: the GROUP output rows, already normalised, then their
GROUP log-sum-exps (base 2: lse = log2 sum_i 2^(s_i), s_i = q . k_i * sm_scale * log2(e)), in fp32,
`record_size(GROUP, width)` words padded to whole 64-byte lines. Records of disjoint position sets
merge exactly: with M the largest lse, o = sum_r 2^(lse_r - M) o_r / sum_r 2^(lse_r - M), and lse =
M + log2 of that sum. An empty set has lse = -inf and o = 0 and weighs nothing; if every record
is empty the merge gives o = 0 (softmax over no positions; SDPA would give NaN). A merge of some
output columns needs only those columns and the lse: a piece is a record of COLUMNS of the D.
"""
import triton
import triton.language as tl

import tridist.language as dl


@triton.constexpr_function
def record_size(group, width):
    """fp32 words of one record of `width` columns: group * width outputs and group lse, padded to 16."""
    return triton.cdiv(group * (width + 1), 16) * 16


@triton.constexpr_function
def group_rows(group):
    """Rows of a record's outputs in a block: the group padded to a power of two."""
    return triton.next_power_of_2(group)


@triton.jit
def merge_records(records, stride, count, width, first_column, flag, GROUP: tl.constexpr, COLUMNS: tl.constexpr,
                  ROWS: tl.constexpr, PACKETS: tl.constexpr):
    """Merge columns first_column ... + COLUMNS - 1 of `count` records of `width` columns, `stride`
    words apart, ROWS at a time, in order. Returns (acc, m, l), acc [group_rows, COLUMNS] and m, l
    [group_rows, 1]: `finish_record` makes the merged piece of them. The loads skip L1 (`.cg`):
    other programs or ranks wrote the records, and this SM may hold stale lines of them from an
    earlier call. PACKETS: the records are LL packets, waited for until they carry `flag`."""
    heads = tl.arange(0, group_rows(GROUP))[None, :, None]
    outputs = heads * width + first_column + tl.arange(0, COLUMNS)[None, None, :]
    rows = tl.arange(0, ROWS)[:, None, None]
    m = tl.full([group_rows(GROUP), 1], float("-inf"), tl.float32)
    l = tl.zeros([group_rows(GROUP), 1], tl.float32)  # noqa: E741 - the softmax denominator, as the papers name it
    acc = tl.zeros([group_rows(GROUP), COLUMNS], tl.float32)
    for first in range(0, count, ROWS):
        mask = (first + rows < count) & (heads < GROUP)
        base = records + (first + rows) * stride
        if PACKETS:
            lse = tl.where(mask, dl.ll.recv(base + GROUP * width + heads, flag, mask).to(tl.float32, bitcast=True),
                           float("-inf"))
            o = dl.ll.recv(base + outputs, flag, mask).to(tl.float32, bitcast=True)
        else:
            lse = tl.load(base + GROUP * width + heads, mask=mask, other=float("-inf"), cache_modifier=".cg")
            o = tl.load(base + outputs, mask=mask, other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        pivot = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing attended yet: all weights 0
        scale = tl.exp2(m - pivot)
        weight = tl.exp2(lse - pivot[None])
        l = l * scale + tl.sum(weight, axis=0)  # noqa: E741
        acc = acc * scale + tl.sum(weight * o, axis=0)
        m = m_new
    return acc, m, l


@triton.jit
def finish_record(acc, m, l):
    """(output, lse) from a merge's or an attention's (acc, m, l), m and l a column: 0 and -inf
    where l is 0."""
    seen = l > 0
    total = tl.where(seen, l, 1.0)
    return acc / total, tl.where(seen, m + tl.log2(total), float("-inf"))


@triton.jit
def store_record(record, o, lse, GROUP: tl.constexpr, WIDTH: tl.constexpr):
    """Write a record of (output [rows, WIDTH], lse [rows, 1]) for the first GROUP rows."""
    heads = tl.arange(0, o.shape[0])[:, None]
    tl.store(record + heads * WIDTH + tl.arange(0, WIDTH)[None, :], o, mask=heads < GROUP)
    tl.store(record + GROUP * WIDTH + heads, lse, mask=heads < GROUP)
