"""Reduce-scatter method "one_shot" (any topology): every rank pushes chunk p of x to rank p, which
sums the chunks as they arrive.

Protocol. x is world_size chunks of m elements; chunk p is cut in slices (`sizing.slices_for`,
about 128 KB each). In a grid of (world_size, splits) programs, program (p, s) for a peer p pushes
slices s, s + splits, ... of chunk p into row `rank` of p's staging, raising p's flag (rank, slice)
to the call's epoch after each (`_sums.send_chunks`, 2-byte stores); program (rank, s) sums those
slices of this rank's chunk over the ranks, in rank order and in fp32, as every peer's arrive
(`_sums.sum_slice`), so the sums overlap the sending. A slot's staging has a row per rank, `row`
elements apart, and world_size * slices flags; two slots and call epochs (`protocol`) need no
handshake.
"""
import torch
import triton.language as tl

import tridist.language as dl
from tridist.runtime.jit import jit

from ... import sizing
from ...protocol import Workspace, call_epoch, finish_call, in_slot, split_bounds
from ...sizing import row_stride
from ...method import Method
from .._sums import send_chunks, sum_slice


@jit
def reduce_scatter_kernel(x_ptr, out_ptr, staging_ptr, flags_ptr, calls_ptr, m, row, slot_numel, local_world_size,
                          slices, BLOCK: tl.constexpr, group=None):
    """Program (p, s) for a peer p sends p's chunk of x (`send_chunks`); program (rank, s) sums
    slices s, s + splits, ... of this rank's chunk as they arrive. Ranks are `group`'s, if given."""
    epoch = call_epoch(calls_ptr)
    me = dl.rank(group)
    stage = in_slot(staging_ptr, epoch, slot_numel)
    flags = in_slot(flags_ptr, epoch, dl.num_ranks(group) * slices)
    if tl.program_id(0) == me:
        for j in range(tl.program_id(1), slices, tl.num_programs(1)):
            start, stop = split_bounds(m, j, slices, BLOCK)
            sum_slice(x_ptr + me * m, stage, row, flags, epoch, slices, j, out_ptr, start, stop, BLOCK, group)
    else:
        send_chunks(x_ptr, stage, flags, epoch, m, row, slices, local_world_size, BLOCK, WIDE=False, group=group)
    dl.shmem.quiet()
    finish_call(calls_ptr)


class OneShot(Method):
    """The sliced one-shot reduce-scatter among `ranks` (an `ops.ranks.Ranks`), built for `numel`
    elements of `dtype` per rank, on at most `programs` programs (world_size destinations share
    them)."""

    name = "one_shot"

    def __init__(self, numel: int, dtype: torch.dtype, programs: int, ranks):
        super().__init__()
        self.ranks = ranks
        self.chunk = numel // ranks.world_size
        self.block, self.splits, self.warps = sizing.steps_for(self.chunk, dtype.itemsize,
                                                                  max(1, programs // ranks.world_size))
        self.slices = sizing.slices_for(self.chunk, dtype.itemsize, self.splits)
        self.row = row_stride(self.chunk)
        self.workspace = self.own(Workspace(ranks.world_size * self.row, dtype, ranks.world_size * self.slices,
                                            name="reduce_scatter one_shot", group=ranks.group))
        self.send = self.send_buffer(ranks, numel, dtype, "reduce_scatter one_shot")

    def launch(self, x: torch.Tensor, out: torch.Tensor) -> None:
        ws, ranks = self.workspace, self.ranks
        x = self.sendable(x, self.send)
        reduce_scatter_kernel[(ranks.world_size, self.splits)](
            x_ptr=x, out_ptr=out, staging_ptr=ws.staging, flags_ptr=ws.flags, calls_ptr=ws.calls, m=self.chunk,
            row=self.row, slot_numel=ws.slot_numel, local_world_size=ranks.local_world_size,
            slices=self.slices, BLOCK=self.block, num_warps=self.warps, group=ranks.group)
