"""All-reduce method "one_shot" (any topology; while latency dominates): every rank sends all of x
to every peer, then sums what it received.

Protocol. Program s pushes slice s of x into row `rank` of every rank's staging (its own included),
raising that rank's flag (rank, s) to the call's epoch, then waits for every rank's flag (p, s) here
and sums the rows it received, in rank order and in fp32. One step, world_size - 1 copies of the
data received per rank. A slot's staging has a row per rank, `row` elements apart, and
world_size * splits flags; two slots and call epochs (`protocol`) need no handshake.
"""
import torch
import triton.language as tl

import tridist.language as dl
from tridist.runtime.jit import jit

from ... import sizing
from ...protocol import Workspace, after_flags, call_epoch, finish_call, in_slot, push_slice, split_bounds
from ...sizing import row_stride
from ...method import Method
from .._sums import sum_rows


@jit
def all_reduce_one_shot_kernel(x_ptr, out_ptr, staging_ptr, flags_ptr, calls_ptr, n, row, slot_numel,
                               local_world_size, splits, BLOCK: tl.constexpr, group=None):
    """Program s sends slice s of x to every rank, then sums it over the ranks (of `group`, if given)."""
    epoch = call_epoch(calls_ptr)
    me = dl.rank(group)
    world = dl.num_ranks(group)
    stage = in_slot(staging_ptr, epoch, slot_numel)
    flags = in_slot(flags_ptr, epoch, world * splits)
    split = tl.program_id(0)
    start, stop = split_bounds(n, split, splits, BLOCK)
    for step in range(world):
        peer = (me + step) % world
        push_slice(x_ptr, stage + me * row, start, stop, flags + me * splits + split, epoch, peer, local_world_size,
                   BLOCK, group=group)
    for peer in range(world):
        stage = after_flags(stage, flags + peer * splits + split, 1, epoch)
    sum_rows(stage, row, world, out_ptr, start, stop, BLOCK)
    dl.shmem.quiet()
    finish_call(calls_ptr)


class OneShot(Method):
    """The one-shot all-reduce among `ranks` (an `ops.ranks.Ranks`), built for `numel` elements of
    `dtype` per rank, on at most `programs` programs."""

    name = "one_shot"

    def __init__(self, numel: int, dtype: torch.dtype, programs: int, ranks):
        super().__init__()
        self.ranks = ranks
        self.numel = numel
        self.block, self.splits, self.warps = sizing.steps_for(numel, dtype.itemsize, programs)
        self.row = row_stride(numel)
        self.workspace = self.own(Workspace(ranks.world_size * self.row, dtype, ranks.world_size * self.splits,
                                            name="all_reduce one_shot", group=ranks.group))
        self.send = self.send_buffer(ranks, numel, dtype, "all_reduce one_shot")

    def launch(self, x: torch.Tensor, out: torch.Tensor) -> None:
        ws = self.workspace
        x = self.sendable(x, self.send)
        all_reduce_one_shot_kernel[(self.splits,)](
            x_ptr=x, out_ptr=out, staging_ptr=ws.staging, flags_ptr=ws.flags, calls_ptr=ws.calls, n=self.numel,
            row=self.row, slot_numel=ws.slot_numel, local_world_size=self.ranks.local_world_size,
            splits=self.splits, BLOCK=self.block, num_warps=self.warps, group=self.ranks.group)
