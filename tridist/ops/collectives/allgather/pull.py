"""All-gather method "pull" (one node): each rank stages its own shard, and its peers read it.

Protocol. In a grid of (world_size, splits) programs, program (rank, s) copies slice s of this
rank's shard into its own staging (and into `out`), then raises flag (rank, s) to the call's epoch
on every rank of the node. Program (p, s) for a peer p waits for rank p's flag (p, s) here and reads
that slice of p's staging through `symm_at`: reads instead of writes over NVLink. A slot's staging
holds this rank's shard, its flags world_size * splits words; two slots and call epochs (`protocol`)
need no handshake.
"""
import torch
import triton.language as tl

import tridist.language as dl
from tridist.runtime.jit import jit

from ... import sizing
from ...protocol import Workspace, after_flags, call_epoch, copy_slice, finish_call, in_slot, notify_peers, split_bounds
from ...method import Method


@jit
def all_gather_pull_kernel(x_ptr, out_ptr, staging_ptr, flags_ptr, calls_ptr, n, slot_numel, splits,
                           BLOCK: tl.constexpr, group=None):
    """Staging holds this rank's shard, one per slot. Ranks are `group`'s, if given."""
    epoch = call_epoch(calls_ptr)
    me = dl.rank(group)
    world = dl.num_ranks(group)
    peer = tl.program_id(0)
    split = tl.program_id(1)
    start, stop = split_bounds(n, split, splits, BLOCK)
    stage = in_slot(staging_ptr, epoch, slot_numel)
    flags = in_slot(flags_ptr, epoch, world * splits)
    if peer == me:
        copy_slice(x_ptr, stage, start, stop, BLOCK)
        copy_slice(x_ptr, out_ptr + me * n, start, stop, BLOCK)
        notify_peers(flags + me * splits + split, epoch, group)
    else:
        copy_slice(after_flags(dl.symm_at(stage, peer, group), flags + peer * splits + split, 1, epoch),
                   out_ptr + peer * n, start, stop, BLOCK)
    finish_call(calls_ptr)


class Pull(Method):
    """The pull among `ranks` (an `ops.ranks.Ranks`), built for shards of `numel` elements of
    `dtype`, on at most `programs` programs (world_size sources share them)."""

    name = "pull"
    one_node = True

    def __init__(self, numel: int, dtype: torch.dtype, programs: int, ranks):
        super().__init__()
        self.ranks = ranks
        self.numel = numel
        self.block, self.splits, self.warps = sizing.steps_for(numel, dtype.itemsize,
                                                                  max(1, programs // ranks.world_size))
        self.workspace = self.own(Workspace(numel, dtype, ranks.world_size * self.splits, name="all_gather pull",
                                            group=ranks.group))

    def launch(self, x: torch.Tensor, out: torch.Tensor) -> None:
        ws = self.workspace
        all_gather_pull_kernel[(self.ranks.world_size, self.splits)](
            x_ptr=x, out_ptr=out, staging_ptr=ws.staging, flags_ptr=ws.flags, calls_ptr=ws.calls, n=self.numel,
            slot_numel=ws.slot_numel, splits=self.splits, BLOCK=self.block, num_warps=self.warps,
            group=self.ranks.group)
