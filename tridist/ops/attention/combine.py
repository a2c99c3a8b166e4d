"""Records of partial attention, how they merge, and the combine kernel that merges them, across
the ranks too.

A record is the attention of a group of query heads (the GROUP = Hq / Hkv heads of one KV head, of
one sequence) over some set of positions: the GROUP output rows, already normalised, then their
GROUP log-sum-exps (base 2: lse = log2 sum_i 2^(s_i), s_i = q . k_i * sm_scale * log2(e)), in fp32,
`record_size(GROUP, width)` words padded to whole 64-byte lines. Records of disjoint position sets
merge exactly: with M the largest lse, o = sum_r 2^(lse_r - M) o_r / sum_r 2^(lse_r - M), and lse =
M + log2 of that sum. An empty set has lse = -inf and o = 0 and weighs nothing; if every record
is empty the merge gives o = 0 (softmax over no positions; SDPA would give NaN). A merge of some
output columns needs only those columns and the lse: a piece is a record of COLUMNS of the D.

The combine kernel. The split-KV kernel leaves a record of D columns per (unit, chunk) in
`partials`, a unit being a (sequence b, KV head h) pair, unit = b * Hkv + h. The combine kernel's
work items are (unit, column block): COLUMNS of the unit's D output columns, so that many programs
share each unit's merge and each loads all of the unit's chunks at once, or in few rounds (with
one program a unit merging its 66 chunks in 9 rounds of loads, the op took 1.50x the kernel alone
at 1x32768 on an H100, 2026-11-24; this way 1.07x, 2026-11-26). Program t takes items t,
t + programs, ...:
- one rank: it merges each item's chunks, in chunk order, into its columns of `out`;
- several ranks: it merges each item's chunks into a piece and sends it to every rank as LL
  packets (`dl.ll`: each word with e, the call's epoch, as its flag), this one first: into row
  `rank` of the item's pieces in slot e % 2 of each rank's staging (through `dl.symm_at` on this
  node; to another, an NVSHMEM put of its own row's packets). Once all of its items are sent, it
  waits for each item's packets from every rank and merges the world pieces, in rank order, into
  `out`: every rank computes the same bits. The pieces it waits for are sent by the same program
  of every rank before that program waits, so the launch is co-resident: those programs are
  running. Packets need no fence and no separate flag, whose round trips cost most of the
  exchange: with put-with-signal (a piece, a system-scope release, a flag) the op took 11.3 us
  more than with no exchange at 2 ranks on 2 x H100 (2026-11-26), at 1x8192 and at 1x131072.

The combine is launched as the split-KV kernel's programmatic dependent (`launch_pdl`, sm_90): its
programs start on the SMs the split-KV kernel's last wave leaves free, and wait there
(`dl.wait_prior_kernel`) for that kernel to end, so that the second launch's latency is hidden.

Epochs and slots are `_protocol`'s: the kernel counts its calls, and a rank sends into slot e % 2
in call e only after its call e - 1 has seen every rank's packets of call e - 1, which each rank
sent after its call e - 2, the last reader of that slot, had ended.
"""
import triton
import triton.language as tl

import tridist.language as dl
from tridist.runtime.jit import jit

from .._protocol import call_epoch, finish_call, sync_program

TILE = 4096  # fp32 values a combine program loads at once: 32 a thread of its 4 warps
WARPS = 4
MIN_COLUMNS = 8  # a piece's rows are at least 32 bytes, one sector of memory


@triton.constexpr_function
def record_size(group, width):
    """fp32 words of one record of `width` columns: group * width outputs and group lse, padded to 16."""
    return triton.cdiv(group * (width + 1), 16) * 16


@triton.constexpr_function
def group_rows(group):
    """Rows of a record's outputs in a block: the group padded to a power of two."""
    return triton.next_power_of_2(group)


def combine_shape(group: int, head_dim: int, splits: int, world_size: int) -> tuple[int, int, int]:
    """(COLUMNS, ROWS, RANK_ROWS) of the combine kernel: the output columns of an item, and how
    many records (of `splits` chunks) and pieces (of `world_size` ranks) it loads at once. Columns
    as few as let every chunk load at once within TILE, but not below MIN_COLUMNS."""
    rows_of_group = triton.next_power_of_2(group)
    columns = max(MIN_COLUMNS, min(head_dim, TILE // (triton.next_power_of_2(splits) * rows_of_group)))
    per_round = max(1, TILE // (rows_of_group * columns))
    return (columns, min(triton.next_power_of_2(splits), per_round),
            min(triton.next_power_of_2(world_size), per_round))


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


@triton.jit
def store_output(out_ptr, unit, first_column, o, GROUP: tl.constexpr, D: tl.constexpr):
    """The first GROUP rows of o ([rows, columns]) into columns first_column... of rows
    unit * GROUP... of out ([B, Hq, D])."""
    heads = tl.arange(0, o.shape[0])[:, None]
    columns = first_column + tl.arange(0, o.shape[1])[None, :]
    tl.store(out_ptr + (unit * GROUP + heads) * D + columns, o.to(out_ptr.dtype.element_ty), mask=heads < GROUP)


@triton.jit
def send_piece(o, lse, piece, epoch, local_world_size, GROUP: tl.constexpr, COLUMNS: tl.constexpr):
    """This rank's piece (o, lse) as LL packets flagged `epoch` to every rank (this one first) at
    `piece`, this rank's address in a symmetric packet buffer, laid out as `store_record` lays out
    a record."""
    me = dl.rank()
    world = dl.num_ranks()
    heads = tl.arange(0, o.shape[0])[:, None]
    mask = heads < GROUP
    outputs = heads * COLUMNS + tl.arange(0, COLUMNS)[None, :]
    for step in range(world):
        peer = (me + step) % world
        if peer // local_world_size == me // local_world_size:
            to = dl.symm_at(piece, peer)
            dl.ll.send(to + outputs, o.to(tl.int32, bitcast=True), epoch, mask)
            dl.ll.send(to + GROUP * COLUMNS + heads, lse.to(tl.int32, bitcast=True), epoch, mask)
        else:  # this rank's own packets, sent at step 0, once every thread's are stored and visible
            sync_program()
            dl.fence("sys")
            dl.shmem.putmem_nbi_block(piece, piece, record_size(GROUP, COLUMNS) * 8, peer)


@jit
def flash_decode_combine_kernel(partials_ptr, out_ptr, staging_ptr, calls_ptr, units, splits, slot_numel,
                                local_world_size, GROUP: tl.constexpr, D: tl.constexpr, COLUMNS: tl.constexpr,
                                ROWS: tl.constexpr, RANK_ROWS: tl.constexpr, EXCHANGE: tl.constexpr):
    """Merges the split-KV kernel's records ([units, splits] of them in `partials`) into out ([B,
    Hq, D]), and with EXCHANGE (several ranks) every rank's too; the module docstring says how.
    staging: int64 LL packets, two slots of `slot_numel`. Without EXCHANGE the staging and calls
    are not used."""
    blocks: tl.constexpr = D // COLUMNS
    record: tl.constexpr = record_size(GROUP, D)
    piece: tl.constexpr = record_size(GROUP, COLUMNS)
    items = units * blocks
    dl.wait_prior_kernel()  # the split-KV kernel's records, and the end of this rank's last call
    if EXCHANGE:
        epoch = call_epoch(calls_ptr)
        me = dl.rank()
        world = dl.num_ranks()
        stage = staging_ptr + (epoch % 2) * slot_numel
    for item in range(tl.program_id(0), items, tl.num_programs(0)):
        unit = item // blocks
        column = (item % blocks) * COLUMNS
        acc, m, l = merge_records(partials_ptr + unit * splits * record, record, splits, D, column, 0, GROUP, COLUMNS,
                                  ROWS, False)
        o, lse = finish_record(acc, m, l)
        if EXCHANGE:
            send_piece(o, lse, stage + (me * items + item) * piece, epoch, local_world_size, GROUP, COLUMNS)
        else:
            store_output(out_ptr, unit, column, o, GROUP, D)
    if EXCHANGE:
        for item in range(tl.program_id(0), items, tl.num_programs(0)):
            acc, m, l = merge_records(stage + item * piece, items * piece, world, COLUMNS, 0, epoch, GROUP, COLUMNS,
                                      RANK_ROWS, True)
            o, _ = finish_record(acc, m, l)
            store_output(out_ptr, item // blocks, (item % blocks) * COLUMNS, o, GROUP, D)
        if world > local_world_size:  # puts to other nodes complete before the kernel ends
            dl.shmem.quiet()
        finish_call(calls_ptr)
