"""The combine kernel: it merges the split-KV kernel's records (`_records`) into the output,
across the ranks too.

The split-KV kernel leaves a record of D columns per (unit, chunk) in `partials`, a unit being a
(sequence b, KV head h) pair, unit = b * Hkv + h. The combine kernel's work items are (unit,
column block): COLUMNS of the unit's D output columns (`policy.combine_shape`), so that many
programs share each unit's merge and each loads all of the unit's chunks at once, or in few rounds
(benchmarks/NOTES.md, "Moved from the code's docstrings (issue 41)", attention/combine.py). Program
t takes items t, t + programs, ...:
- one rank: it merges each item's chunks, in chunk order, into its columns of `out`;
- several ranks: it merges each item's chunks into a piece and sends it to every rank as LL
  packets (`dl.ll`: each word with e, the call's epoch, as its flag), this one first: into row
  `rank` of the item's pieces in slot e % 2 of each rank's staging (through `dl.symm_at` on this
  node; to another, an NVSHMEM put of its own row's packets). Once all of its items are sent, it
  waits for each item's packets from every rank and merges the world pieces, in rank order, into
  `out`: every rank computes the same bits. The pieces it waits for are sent by the same program
  of every rank before that program waits, so the launch is co-resident: those programs are
  running. Packets need no fence and no separate flag, whose round trips would cost most of the
  exchange (measured: the same section of the notes).

The combine is launched as the split-KV kernel's programmatic dependent (`launch_pdl`, sm_90): its
programs start on the SMs the split-KV kernel's last wave leaves free, and wait there
(`dl.wait_prior_kernel`) for that kernel to end, so that the second launch's latency is hidden.

Epochs and slots are `protocol`'s: the kernel counts its calls, and a rank sends into slot e % 2
in call e only after its call e - 1 has seen every rank's packets of call e - 1, which each rank
sent after its call e - 2, the last reader of that slot, had ended.
"""
import triton
import triton.language as tl

import tridist.language as dl
from tridist.runtime.jit import jit

from ..protocol import call_epoch, finish_call, in_slot, sync_program
from ._records import finish_record, merge_records, record_size


@triton.jit
def store_output(out_ptr, unit, first_column, o, GROUP: tl.constexpr, D: tl.constexpr):
    """The first GROUP rows of o ([rows, columns]) into columns first_column... of rows
    unit * GROUP... of out ([B, Hq, D])."""
    heads = tl.arange(0, o.shape[0])[:, None]
    columns = first_column + tl.arange(0, o.shape[1])[None, :]
    tl.store(out_ptr + (unit * GROUP + heads) * D + columns, o.to(out_ptr.dtype.element_ty), mask=heads < GROUP)


@triton.jit
def send_piece(o, lse, piece, epoch, local_world_size, GROUP: tl.constexpr, COLUMNS: tl.constexpr, group):
    """This rank's piece (o, lse) as LL packets flagged `epoch` to every rank (this one first) at
    `piece`, this rank's address in a symmetric packet buffer, laid out as `store_record` lays out
    a record. Ranks of `group` (None: the world's)."""
    me = dl.rank(group)
    world = dl.num_ranks(group)
    heads = tl.arange(0, o.shape[0])[:, None]
    mask = heads < GROUP
    outputs = heads * COLUMNS + tl.arange(0, COLUMNS)[None, :]
    for step in range(world):
        peer = (me + step) % world
        if peer // local_world_size == me // local_world_size:
            to = dl.symm_at(piece, peer, group)
            dl.ll.send(to + outputs, o.to(tl.int32, bitcast=True), epoch, mask)
            dl.ll.send(to + GROUP * COLUMNS + heads, lse.to(tl.int32, bitcast=True), epoch, mask)
        else:  # this rank's own packets, sent at step 0, once every thread's are stored and visible
            sync_program()
            dl.fence("sys")
            dl.shmem.putmem_nbi_block(piece, piece, record_size(GROUP, COLUMNS) * 8, peer, group)


@jit
def flash_decode_combine_kernel(partials_ptr, out_ptr, staging_ptr, calls_ptr, units, splits, slot_numel,
                                local_world_size, GROUP: tl.constexpr, D: tl.constexpr, COLUMNS: tl.constexpr,
                                ROWS: tl.constexpr, RANK_ROWS: tl.constexpr, EXCHANGE: tl.constexpr, group=None):
    """Merges the split-KV kernel's records ([units, splits] of them in `partials`) into out ([B,
    Hq, D]), and with EXCHANGE (several ranks) every rank's too; the module docstring says how.
    staging: int64 LL packets, two slots of `slot_numel`. Without EXCHANGE the staging and calls
    are not used. `group` (a `tridist.Group`, None for the world): the ranks it merges across,
    `local_world_size` of them a node."""
    blocks: tl.constexpr = D // COLUMNS
    record: tl.constexpr = record_size(GROUP, D)
    piece: tl.constexpr = record_size(GROUP, COLUMNS)
    items = units * blocks
    dl.wait_prior_kernel()  # the split-KV kernel's records, and the end of this rank's last call
    if EXCHANGE:
        epoch = call_epoch(calls_ptr)
        me = dl.rank(group)
        world = dl.num_ranks(group)
        stage = in_slot(staging_ptr, epoch, slot_numel)
    for item in range(tl.program_id(0), items, tl.num_programs(0)):
        unit = item // blocks
        column = (item % blocks) * COLUMNS
        acc, m, l = merge_records(partials_ptr + unit * splits * record, record, splits, D, column, 0, GROUP, COLUMNS,
                                  ROWS, False)
        o, lse = finish_record(acc, m, l)
        if EXCHANGE:
            send_piece(o, lse, stage + (me * items + item) * piece, epoch, local_world_size, GROUP, COLUMNS, group)
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
