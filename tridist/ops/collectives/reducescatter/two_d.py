"""Reduce-scatter method "2d" (for several nodes): summed within each node first, so that each
chunk's partial sum crosses to its owner's node once.

Protocol. With L ranks per node and N nodes, rank (node a, local index l) owns chunk a*L + l; each
program moves slice `split` of every chunk. First, within the node, every rank pushes to local rank
l the chunks owned by the ranks with local index l on every node (row (n, j) of l's staging: local
rank j's chunk n*L + l; flag (split, n, j)). Then rank (a, l) sums, for each node n, the L rows (n,
*) in fp32, the other nodes first so that their puts are on their way early: the sum for its own
node stays here as node sum a; the sum for another node n is put (with the signal) to rank (n, l)
as that rank's node sum a, flag (split, a) of the second block of flags. Last, it sums its N node
sums into `out`. Node sums are fp32 (a separate symmetric buffer, `sums`, two slots as the
workspace), so the result is rounded once. Flags and all buffers are raised to and indexed by the
call's epoch (`protocol`): two slots need no handshake.

A program stores sums and reads them back in another layout, so it syncs its threads between
(`protocol.sync_program`).
"""
import torch
import triton.language as tl

import tridist
import tridist.language as dl
from tridist.runtime.jit import jit

from ... import sizing
from ...protocol import (Workspace, after_flags, call_epoch, finish_call, in_slot, placement, push_slice, split_bounds,
                         sync_program)
from ...sizing import row_stride
from ...method import Method
from .._sums import sum_rows


@jit
def reduce_scatter_2d_kernel(x_ptr, out_ptr, staging_ptr, sums_ptr, flags_ptr, calls_ptr, m, row, slot_numel,
                             local_world_size, splits, BLOCK: tl.constexpr, group=None):
    """A slot of `staging` (x's dtype) holds world rows (n, j), a slot of `sums` (fp32) the N node
    sums of this rank's chunk, then N rows from which this rank puts its node's sums to the other
    nodes. Rows are `row` apart. Flags per slot: (split, n, j) for the rows, then (split, n) for
    the node sums. Ranks, nodes and `local_world_size` are `group`'s, if given (its members
    numbered node by node)."""
    epoch = call_epoch(calls_ptr)
    me, world, nodes, node, local = placement(local_world_size, group)
    split = tl.program_id(0)
    start, stop = split_bounds(m, split, splits, BLOCK)
    gathered = in_slot(staging_ptr, epoch, slot_numel)
    node_sums = in_slot(sums_ptr, epoch, 2 * nodes * row)
    outgoing = node_sums + nodes * row
    flags = in_slot(flags_ptr, epoch, (world + nodes) * splits)
    gathered_flags = flags + split * world
    sum_flags = flags + world * splits + split * nodes
    for step in range(local_world_size):
        j = (local + step) % local_world_size
        for n in range(nodes):
            push_slice(x_ptr + (n * local_world_size + j) * m, gathered + (n * local_world_size + local) * row, start,
                       stop, gathered_flags + n * local_world_size + local, epoch, node * local_world_size + j,
                       local_world_size, BLOCK, group=group)
    for step in range(nodes):  # the other nodes first, so that their puts are on their way early
        n = (node + 1 + step) % nodes
        rows = after_flags(gathered + n * local_world_size * row, gathered_flags + n * local_world_size,
                           local_world_size, epoch)
        if n == node:  # this node's sum of this rank's chunk stays here
            sum_rows(rows, row, local_world_size, node_sums + node * row, start, stop, BLOCK)
        else:
            sum_rows(rows, row, local_world_size, outgoing + n * row, start, stop, BLOCK)
            sync_program()
            push_slice(outgoing + n * row, node_sums + node * row, start, stop, sum_flags + node, epoch,
                       n * local_world_size + local, local_world_size, BLOCK, group=group)
    for n in range(nodes):
        if n != node:
            node_sums = after_flags(node_sums, sum_flags + n, 1, epoch)
    sync_program()  # this node's sum, stored above
    sum_rows(node_sums, row, nodes, out_ptr, start, stop, BLOCK)
    dl.shmem.quiet()
    finish_call(calls_ptr)


class TwoD(Method):
    """The two-level reduce-scatter among `ranks` (an `ops.ranks.Ranks`), built for `numel`
    elements of `dtype` per rank, on at most `programs` programs (one per slice)."""

    name = "2d"

    def __init__(self, numel: int, dtype: torch.dtype, programs: int, ranks):
        super().__init__()
        self.ranks = ranks
        self.chunk = numel // ranks.world_size
        self.block, self.splits, self.warps = sizing.steps_for(self.chunk, dtype.itemsize, programs)
        self.row = row = row_stride(self.chunk)
        # flags for the rows, then for the node sums
        self.workspace = self.own(Workspace(ranks.world_size * row, dtype,
                                            (ranks.world_size + ranks.nnodes) * self.splits,
                                            name="reduce_scatter 2d", group=ranks.group))
        self.sums = self.own(tridist.symm_empty((2, 2 * ranks.nnodes * row), torch.float32, ranks.group,
                                                name="reduce_scatter 2d sums"))

    def launch(self, x: torch.Tensor, out: torch.Tensor) -> None:
        ws = self.workspace
        reduce_scatter_2d_kernel[(self.splits,)](
            x_ptr=x, out_ptr=out, staging_ptr=ws.staging, sums_ptr=self.sums, flags_ptr=ws.flags, calls_ptr=ws.calls,
            m=self.chunk, row=self.row, slot_numel=ws.slot_numel, local_world_size=self.ranks.local_world_size,
            splits=self.splits, BLOCK=self.block, num_warps=self.warps, group=self.ranks.group)
