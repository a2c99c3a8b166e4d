"""All-reduce method "two_shot" (any topology; large messages), through staging: a sliced
reduce-scatter, then an all-gather of the reduced slices.

Protocol. x is world_size chunks of m elements (padded by the host when world_size does not divide
it), each cut in slices (`sizing.slices_for`, about 128 KB). In a grid of (world_size, splits)
programs, program (p, s) for a peer p pushes slices s, s + splits, ... of chunk p of x into row
`rank` of p's staging, raising p's flag (rank, slice) to the call's epoch after each
(`_sums.send_chunks`, 16-byte stores). Program (rank, s) sums those slices of this rank's chunk
over the ranks as they arrive (`_sums.sum_slice`, rank order, fp32) into `out`, then pushes each sum
into row `rank` of the second half of every peer's staging, flags in the second half of the slot's
signals; program (p, s) copies p's reduced slices from there into `out` as they arrive. Each rank
receives 2 (n-1)/n of the data instead of (n-1) x. A slot holds 2 world_size rows, `row` apart, and
2 world_size * slices flags; two slots and call epochs (`protocol`) need no handshake.

In place (out is x) is safe: chunk p of x is overwritten only by the program that sent it, after
sending it.

In place on a symmetric x on one node the two-shot needs no staging: see `two_shot_symmetric`.
"""
import torch
import triton
import triton.language as tl

import tridist
import tridist.language as dl
from tridist.runtime.jit import jit

from ... import sizing
from ...protocol import (Workspace, after_flags, call_epoch, copy_slice, finish_call, in_slot, push_slice, split_bounds,
                         sync_program)
from ...sizing import row_stride
from ...method import Method
from .._sums import send_chunks, sum_slice


@jit
def all_reduce_two_shot_kernel(x_ptr, out_ptr, staging_ptr, flags_ptr, calls_ptr, m, row, slot_numel,
                               local_world_size, slices, BLOCK: tl.constexpr, group=None):
    """x and out have world_size * m elements (padded by the host). The slot holds world rows
    (`row` apart) for the reduce-scatter, then world rows for the gather of reduced chunks, each
    with a flag per slice. Program (rank, s) sums slices s, s + splits, ... of this rank's chunk into
    `out` and sends each to every peer; program (p, s) for a peer p sends p its chunk of x
    (`send_chunks`), then copies p's reduced slices into `out` as they arrive. Ranks are
    `group`'s, if given."""
    epoch = call_epoch(calls_ptr)
    me = dl.rank(group)
    world = dl.num_ranks(group)
    peer = tl.program_id(0)
    stage = in_slot(staging_ptr, epoch, slot_numel)
    flags = in_slot(flags_ptr, epoch, 2 * world * slices)
    gathered = stage + world * row
    gather_flags = flags + world * slices
    if peer == me:
        for j in range(tl.program_id(1), slices, tl.num_programs(1)):
            start, stop = split_bounds(m, j, slices, BLOCK)
            sum_slice(x_ptr + me * m, stage, row, flags, epoch, slices, j, out_ptr + me * m, start, stop, BLOCK,
                      group)
            sync_program()
            for step in range(1, world):
                push_slice(out_ptr + me * m, gathered + me * row, start, stop, gather_flags + me * slices + j, epoch,
                           (me + step) % world, local_world_size, BLOCK, group=group)
    else:
        send_chunks(x_ptr, stage, flags, epoch, m, row, slices, local_world_size, BLOCK, WIDE=True, group=group)
        for j in range(tl.program_id(1), slices, tl.num_programs(1)):
            start, stop = split_bounds(m, j, slices, BLOCK)
            copy_slice(after_flags(gathered + peer * row, gather_flags + peer * slices + j, 1, epoch),
                       out_ptr + peer * m, start, stop, BLOCK)
    dl.shmem.quiet()
    finish_call(calls_ptr)


class TwoShot(Method):
    """The sliced two-shot all-reduce through staging among `ranks` (an `ops.ranks.Ranks`), built
    for `numel` elements of `dtype` per rank, on at most `programs` programs (world_size chunks
    share them)."""

    name = "two_shot"

    def __init__(self, numel: int, dtype: torch.dtype, programs: int, ranks):
        super().__init__()
        self.ranks = ranks
        self.numel = numel
        self.chunk = triton.cdiv(numel, ranks.world_size)
        self.block, self.splits, self.warps = sizing.steps_for(self.chunk, dtype.itemsize,
                                                                  max(1, programs // ranks.world_size))
        self.slices = sizing.slices_for(self.chunk, dtype.itemsize, self.splits)
        self.row = row_stride(self.chunk)
        self.workspace = self.own(Workspace(2 * ranks.world_size * self.row, dtype,
                                            2 * ranks.world_size * self.slices, name="all_reduce two_shot",
                                            group=ranks.group))
        # x and out padded to world_size whole chunks where they are not already. The kernel puts
        # from both, so across nodes the pair is symmetric and used unless x and out are too
        # (`Method.sendable`).
        self.padding = self.chunk * ranks.world_size != numel
        self.padded = None
        if ranks.nnodes > 1:
            self.padded = self.own(tridist.symm_zeros((2, self.chunk * ranks.world_size), dtype, group=ranks.group,
                                                      name="all_reduce two_shot send buffer"))
        elif self.padding:
            self.padded = torch.zeros(2, self.chunk * ranks.world_size, dtype=dtype, device=ranks.device)

    def launch(self, x: torch.Tensor, out: torch.Tensor) -> None:
        ws = self.workspace
        source, target = x, out
        through_padded = self.padding or (self.padded is not None and not (tridist.is_symmetric(x)
                                                                          and tridist.is_symmetric(out)))
        if through_padded:
            self.padded[0, :self.numel].copy_(x.view(-1))
            source, target = self.padded[0], self.padded[1]
        all_reduce_two_shot_kernel[(self.ranks.world_size, self.splits)](
            x_ptr=source, out_ptr=target, staging_ptr=ws.staging, flags_ptr=ws.flags, calls_ptr=ws.calls,
            m=self.chunk, row=self.row, slot_numel=ws.slot_numel, local_world_size=self.ranks.local_world_size,
            slices=self.slices, BLOCK=self.block, num_warps=self.warps, group=self.ranks.group)
        if through_padded:
            out.view(-1).copy_(target[:self.numel])
