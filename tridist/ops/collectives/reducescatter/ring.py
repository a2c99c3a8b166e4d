"""Reduce-scatter method "ring" (any topology): partial sums pass around the ring of ranks.

Protocol. Program s passes slice s of the partial sums around the ring in world-1 steps: at step k a
rank adds its own part of chunk rank-1-k to the partial it received (none at step 0), stores it in
its row k of sent partials and pushes it to rank+1 (row k of rank+1's received partials, flag (k, s)
raised to the call's epoch); after the last step the partial of its own chunk has passed every other
rank and it adds its own part into `out`. Partials travel in fp32 (twice the bytes of a 16-bit
input), so the result is rounded once. A slot's staging holds world-1 received partials, then the
world-1 sent ones, `row` apart; two slots and call epochs (`protocol`) need no handshake.

A program stores each partial and pushes it from memory in another layout, so it syncs its threads
between (`protocol.sync_program`).
"""
import torch
import triton
import triton.language as tl

import tridist.language as dl
from tridist.runtime.jit import jit

from ... import sizing
from ...protocol import Workspace, after_flags, call_epoch, finish_call, in_slot, push_slice, split_bounds, sync_program
from ...sizing import row_stride
from ...method import Method


@triton.jit
def _add_slice(x_ptr, partial_ptr, with_partial, dst_ptr, start, stop, BLOCK: tl.constexpr):
    """dst[start:stop] = x + partial (x alone unless `with_partial`), summed in fp32."""
    offsets = tl.arange(0, BLOCK)
    for offset in range(start, stop, BLOCK):
        mask = offset + offsets < stop
        total = tl.load(x_ptr + offset + offsets, mask=mask).to(tl.float32)
        if with_partial:
            total += tl.load(partial_ptr + offset + offsets, mask=mask).to(tl.float32)
        tl.store(dst_ptr + offset + offsets, total.to(dst_ptr.dtype.element_ty), mask=mask)


@jit
def reduce_scatter_ring_kernel(x_ptr, out_ptr, staging_ptr, flags_ptr, calls_ptr, m, row, slot_numel,
                               local_world_size, splits, BLOCK: tl.constexpr, group=None):
    """A slot of `staging` (fp32) holds world-1 received partials, then the world-1 this rank
    sends, `row` apart; flag (step, split) says received partial `step` is here. Ranks are
    `group`'s, if given."""
    epoch = call_epoch(calls_ptr)
    me = dl.rank(group)
    world = dl.num_ranks(group)
    successor = (me + 1) % world
    split = tl.program_id(0)
    start, stop = split_bounds(m, split, splits, BLOCK)
    received = in_slot(staging_ptr, epoch, slot_numel)
    sent = received + (world - 1) * row
    flags = in_slot(flags_ptr, epoch, world * splits)
    for step in range(world):
        partial = received + (step - 1) * row
        if step > 0:
            partial = after_flags(partial, flags + (step - 1) * splits + split, 1, epoch)
        if step < world - 1:
            chunk = (me + world - 1 - step) % world
            _add_slice(x_ptr + chunk * m, partial, step > 0, sent + step * row, start, stop, BLOCK)
            sync_program()
            push_slice(sent + step * row, received + step * row, start, stop, flags + step * splits + split, epoch,
                       successor, local_world_size, BLOCK, group=group)
        else:  # the partial of this rank's chunk has been through every other rank
            _add_slice(x_ptr + me * m, partial, step > 0, out_ptr, start, stop, BLOCK)
    dl.shmem.quiet()
    finish_call(calls_ptr)


class Ring(Method):
    """The ring reduce-scatter among `ranks` (an `ops.ranks.Ranks`), built for `numel` elements of
    `dtype` per rank, on at most `programs` programs (one per slice)."""

    name = "ring"

    def __init__(self, numel: int, dtype: torch.dtype, programs: int, ranks):
        super().__init__()
        self.ranks = ranks
        self.chunk = numel // ranks.world_size
        self.block, self.splits, self.warps = sizing.steps_for(self.chunk, dtype.itemsize, programs)
        self.row = row_stride(self.chunk)
        # fp32 partials: world-1 received and world-1 sent rows
        self.workspace = self.own(Workspace(2 * max(1, ranks.world_size - 1) * self.row, torch.float32,
                                            ranks.world_size * self.splits, name="reduce_scatter ring",
                                            group=ranks.group))

    def launch(self, x: torch.Tensor, out: torch.Tensor) -> None:
        ws = self.workspace
        reduce_scatter_ring_kernel[(self.splits,)](
            x_ptr=x, out_ptr=out, staging_ptr=ws.staging, flags_ptr=ws.flags, calls_ptr=ws.calls, m=self.chunk,
            row=self.row, slot_numel=ws.slot_numel, local_world_size=self.ranks.local_world_size,
            splits=self.splits, BLOCK=self.block, num_warps=self.warps, group=self.ranks.group)
