"""All-gather method "ring" (any topology): each slice passes around the ring of ranks.

Protocol. Program s carries slice s of every shard. It pushes this rank's slice to rank+1 (row
`rank` of its staging, flag (rank, s) raised to the call's epoch), then world-1 times waits for the
slice of the next source along the ring (rank-1, rank-2, ...) under flag (source, s), forwards it
to rank+1 (unless rank+1 is that source) and copies it to `out`. Each rank sends and receives
(n-1)/n of the output once, whatever the topology; the slices move independently, so the steps
overlap. Staging rows are `row` elements apart; two slots and call epochs (`protocol`) need no
handshake.
"""
import torch
import triton.language as tl

import tridist.language as dl
from tridist.runtime.jit import jit

from ... import sizing
from ...protocol import Workspace, after_flags, call_epoch, copy_slice, finish_call, in_slot, push_slice, split_bounds
from ...sizing import row_stride
from ...method import Method


@jit
def all_gather_ring_kernel(x_ptr, out_ptr, staging_ptr, flags_ptr, calls_ptr, n, row, slot_numel, local_world_size,
                           splits, BLOCK: tl.constexpr, group=None):
    """Program s carries slice s of every shard one hop along the ring (of `group`'s ranks, if
    given); staging rows are `row` apart."""
    epoch = call_epoch(calls_ptr)
    me = dl.rank(group)
    world = dl.num_ranks(group)
    successor = (me + 1) % world
    split = tl.program_id(0)
    start, stop = split_bounds(n, split, splits, BLOCK)
    stage = in_slot(staging_ptr, epoch, slot_numel)
    flags = in_slot(flags_ptr, epoch, world * splits)
    push_slice(x_ptr, stage + me * row, start, stop, flags + me * splits + split, epoch, successor, local_world_size,
               BLOCK, group=group)
    copy_slice(x_ptr, out_ptr + me * n, start, stop, BLOCK)
    for step in range(1, world):
        source = (me + world - step) % world
        flag = flags + source * splits + split
        received = after_flags(stage + source * row, flag, 1, epoch)
        if source != successor:  # forward first: the rest of the ring waits for it
            push_slice(received, stage + source * row, start, stop, flag, epoch, successor, local_world_size, BLOCK,
                       group=group)
        copy_slice(received, out_ptr + source * n, start, stop, BLOCK)
    dl.shmem.quiet()
    finish_call(calls_ptr)


class Ring(Method):
    """The ring all-gather among `ranks` (an `ops.ranks.Ranks`), built for shards of `numel`
    elements of `dtype`, on at most `programs` programs (one per slice)."""

    name = "ring"

    def __init__(self, numel: int, dtype: torch.dtype, programs: int, ranks):
        super().__init__()
        self.ranks = ranks
        self.numel = numel
        self.block, self.splits, self.warps = sizing.steps_for(numel, dtype.itemsize, programs)
        self.row = row_stride(numel)
        self.workspace = self.own(Workspace(ranks.world_size * self.row, dtype, ranks.world_size * self.splits,
                                            name="all_gather ring", group=ranks.group))
        self.send = self.send_buffer(ranks, numel, dtype, "all_gather ring")

    def launch(self, x: torch.Tensor, out: torch.Tensor) -> None:
        ws = self.workspace
        x = self.sendable(x, self.send)
        all_gather_ring_kernel[(self.splits,)](
            x_ptr=x, out_ptr=out, staging_ptr=ws.staging, flags_ptr=ws.flags, calls_ptr=ws.calls, n=self.numel,
            row=self.row, slot_numel=ws.slot_numel, local_world_size=self.ranks.local_world_size,
            splits=self.splits, BLOCK=self.block, num_warps=self.warps, group=self.ranks.group)
