"""All-gather method "2d" (for several nodes): each shard crosses to every other node once.

Protocol. With L ranks per node and N nodes, each slice of a shard travels by `spread_tasks` = L +
2 (N - 1) programs. The rank stores its shard into the staging of every rank of its own node, and
puts it (with the signal attached) to the rank with its local index on every other node; a rank
forwards each shard it received from another node to the other ranks of its node once that shard's
flag has arrived. Flag (p, s) on a rank says slice s of rank p's shard is in its staging (row p,
`row` elements apart), raised to the call's epoch once per call by whoever wrote it; then each
program waits for a few of those flags and copies those rows into `out`. On one node this is "push"
with the copy-outs spread differently. Two slots and call epochs (`protocol`) need no handshake.

A program may wait for a shard that a program after it in the grid forwards, so the kernel launches
co-resident (`kernel[grid](..., coresident=True)`), with fewer splits if its grid would not all be
resident (asked at the first call: the number of programs counts the call epochs, so it is fixed
from then on). `ag_gemm` (comm="sm") runs the same kernel without the copy-out (COPY_OUT=False): its
GEMM reads the staging itself.
"""
import torch
import triton.language as tl

import tridist.language as dl
from tridist.runtime.jit import jit

from ... import sizing
from ...protocol import (Workspace, after_flags, call_epoch, copy_slice, finish_call, in_slot, placement, push_slice,
                         split_bounds)
from ...sizing import row_stride
from ...method import Method


@jit
def all_gather_2d_kernel(x_ptr, out_ptr, staging_ptr, flags_ptr, calls_ptr, n, row, slot_numel, local_world_size,
                         COPY_OUT: tl.constexpr, splits, BLOCK: tl.constexpr, group=None):
    """Program (task, split) moves slice `split`. With L ranks per node and N nodes, the grid's
    L + 2 (N - 1) tasks (`spread_tasks`) spread this rank's shard into row `rank` of every rank's
    staging (rows `row` apart):
    - task < L: to local rank `task` of this node (this rank included);
    - task = L + j, j < N - 1: to the rank with this local index on node (node + 1 + j) % N;
    - task = L + N - 1 + j: waits until the shard of the rank with this local index on node
      (node + 1 + j) % N has arrived here, then forwards it to the other ranks of this node.
    With COPY_OUT, task t then copies rows t, t + L + 2 (N - 1), ... into `out` as they arrive.
    Ranks, nodes and `local_world_size` are `group`'s, if given (its members numbered node by node)."""
    epoch = call_epoch(calls_ptr)
    me, world, nodes, node, local = placement(local_world_size, group)
    task = tl.program_id(0)
    split = tl.program_id(1)
    start, stop = split_bounds(n, split, splits, BLOCK)
    stage = in_slot(staging_ptr, epoch, slot_numel)
    flags = in_slot(flags_ptr, epoch, world * splits)
    direct = local_world_size + nodes - 1
    if task < direct:
        peer = node * local_world_size + task
        if task >= local_world_size:
            peer = ((node + 1 + task - local_world_size) % nodes) * local_world_size + local
        push_slice(x_ptr, stage + me * row, start, stop, flags + me * splits + split, epoch, peer, local_world_size,
                   BLOCK, group=group)
    else:
        source = ((node + 1 + task - direct) % nodes) * local_world_size + local
        flag = flags + source * splits + split
        received = after_flags(stage + source * row, flag, 1, epoch)
        for other in range(local_world_size):
            if other != local:
                push_slice(received, stage + source * row, start, stop, flag, epoch, node * local_world_size + other,
                           local_world_size, BLOCK, group=group)
    if COPY_OUT:
        for source in range(task, world, tl.num_programs(0)):
            copy_slice(after_flags(stage + source * row, flags + source * splits + split, 1, epoch),
                       out_ptr + source * n, start, stop, BLOCK)
    dl.shmem.quiet()
    finish_call(calls_ptr)


def spread_tasks(ranks) -> int:
    """Spreading programs per slice in `all_gather_2d_kernel` among `ranks` (a `tridist.World` or an
    `ops.ranks.Ranks`): one per rank of the node, one put and one forward per other node."""
    return ranks.local_world_size + 2 * (ranks.nnodes - 1)


class TwoD(Method):
    """The two-level all-gather among `ranks` (an `ops.ranks.Ranks`), built for shards of `numel`
    elements of `dtype`, on at most `programs` programs (`spread_tasks` per slice); fewer splits at
    the first call if not all of them can be resident."""

    name = "2d"

    def __init__(self, numel: int, dtype: torch.dtype, programs: int, ranks):
        super().__init__()
        self.ranks = ranks
        self.numel = numel
        self.tasks = spread_tasks(ranks)
        self.block, self.splits, self.warps = sizing.steps_for(numel, dtype.itemsize,
                                                                  max(1, programs // self.tasks))
        self.row = row_stride(numel)
        self.workspace = self.own(Workspace(ranks.world_size * self.row, dtype, ranks.world_size * self.splits,
                                            name="all_gather 2d", group=ranks.group))
        self.send = self.send_buffer(ranks, numel, dtype, "all_gather 2d")
        self.fitted = False  # `splits` is fitted to what can be resident at the first call

    def launch(self, x: torch.Tensor, out: torch.Tensor) -> None:
        ws = self.workspace
        x = self.sendable(x, self.send)
        arguments = dict(x_ptr=x, out_ptr=out, staging_ptr=ws.staging, flags_ptr=ws.flags, calls_ptr=ws.calls,
                    n=self.numel, row=self.row, slot_numel=ws.slot_numel,
                    local_world_size=self.ranks.local_world_size, COPY_OUT=True, BLOCK=self.block,
                    num_warps=self.warps, group=self.ranks.group)
        if not self.fitted:  # fewer splits use fewer of the workspace's flags
            self.splits = sizing.fit_coresident(all_gather_2d_kernel, self.splits, self.tasks,
                                                   splits=self.splits, **arguments)
            self.fitted = True
        all_gather_2d_kernel[(self.tasks, self.splits)](splits=self.splits, coresident=True, **arguments)
