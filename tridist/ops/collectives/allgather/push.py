"""All-gather method "push" (any topology): each rank stores its shard into every peer's staging.

Protocol. The shard (n elements) is cut in slices (`sizing.slices_for`, about 128 KB each). In a
grid of (world_size, splits) programs, program (p, s) for a peer p stores slices s, s + splits, ...
of this rank's shard into row `rank` of rank p's staging (through p's pointer on this node, an
NVSHMEM put with the signal attached on another node), raising p's flag (rank, slice) to the call's
epoch after each. Program (rank, s) copies those slices of every rank's shard into `out`: this
rank's from x, a peer's once its flag is up, so copying out overlaps sending. A slot's staging has a
row per rank, `row` elements (n rounded up to 64) apart, and world_size * slices flags; two slots and
call epochs (`protocol`) need no handshake.
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
def all_gather_push_kernel(x_ptr, out_ptr, staging_ptr, flags_ptr, calls_ptr, n, row, slot_numel, local_world_size,
                           slices, BLOCK: tl.constexpr, group=None):
    """Program (p, s) for a peer p sends slices s, s + splits, ... of this rank's shard into row
    `rank` of p's staging, each followed by flag (rank, slice) there; program (rank, s) copies the
    same slices of this rank's shard into `out`, then of each peer's as its flag arrives. Staging
    rows are `row` (n rounded up to 64) elements apart. Ranks are `group`'s, if given."""
    epoch = call_epoch(calls_ptr)
    me = dl.rank(group)
    world = dl.num_ranks(group)
    peer = tl.program_id(0)
    stage = in_slot(staging_ptr, epoch, slot_numel)
    flags = in_slot(flags_ptr, epoch, world * slices)
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
                       BLOCK, group=group)
    dl.shmem.quiet()
    finish_call(calls_ptr)


class Push(Method):
    """The sliced push among `ranks` (an `ops.ranks.Ranks`), built for shards of `numel` elements
    of `dtype`, on at most `programs` programs (world_size destinations share them)."""

    name = "push"

    def __init__(self, numel: int, dtype: torch.dtype, programs: int, ranks):
        super().__init__()
        self.ranks = ranks
        self.numel = numel
        self.block, self.splits, self.warps = sizing.steps_for(numel, dtype.itemsize,
                                                                  max(1, programs // ranks.world_size))
        self.slices = sizing.slices_for(numel, dtype.itemsize, self.splits)
        self.row = row_stride(numel)
        self.workspace = self.own(Workspace(ranks.world_size * self.row, dtype, ranks.world_size * self.slices,
                                            name="all_gather push", group=ranks.group))
        self.send = self.send_buffer(ranks, numel, dtype, "all_gather push")

    def launch(self, x: torch.Tensor, out: torch.Tensor) -> None:
        ws, ranks = self.workspace, self.ranks
        x = self.sendable(x, self.send)
        all_gather_push_kernel[(ranks.world_size, self.splits)](
            x_ptr=x, out_ptr=out, staging_ptr=ws.staging, flags_ptr=ws.flags, calls_ptr=ws.calls, n=self.numel,
            row=self.row, slot_numel=ws.slot_numel, local_world_size=ranks.local_world_size, slices=self.slices,
            BLOCK=self.block, num_warps=self.warps, group=ranks.group)
