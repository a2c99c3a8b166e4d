"""All-reduce method "two_shot" in place on a symmetric x (one node): no staging; every rank reads
and writes every rank's x through `symm_at`, as PyTorch's `two_shot_all_reduce_` does.

Protocol. x (n elements) is symmetric, the same tensor on every rank, and becomes the sum on every
rank. Rank r owns chunk r (elements r*m to (r+1)*m, fewer for the last ranks). Program 0 first
raises flag `ready` (rank) on every peer: this rank's x holds this call's input. Every program waits
for every peer's `ready`, then sums slices s, s + splits, ... of this rank's chunk over every rank's
x (in fp32, from this rank's x on) and stores the sums into every rank's x, one pass over
NVLink each way; then it raises flag (rank, s) on every peer and waits for flag (p, s) from every
peer p: the same program of p has stored its sums here. A chunk is read and written by its owner
only, so the in-place stores are safe. A slot holds world_size * (splits + 1) flags (the last
world_size are `ready`); two slots and call epochs (`protocol`) need no handshake.

From `policy.SYMMETRIC_TWO_PER_SM_BYTES` the front gives it two programs per SM unless the caller
caps them (`policy.symmetric_two_shot_programs`).
"""
import torch
import triton
import triton.language as tl

import tridist.language as dl
from tridist.runtime.jit import jit

from ... import sizing
from ...protocol import Workspace, after_flags, call_epoch, finish_call, in_slot, notify_peers, split_bounds
from ...method import Method


@jit
def all_reduce_symmetric_kernel(x_ptr, flags_ptr, calls_ptr, n, m, slices, BLOCK: tl.constexpr, group=None):
    """x (n elements) is symmetric and becomes the sum on every rank. Rank r owns chunk r (elements
    r*m to (r+1)*m, fewer for the last ranks); program s sums slices s, s + splits, ... of this
    rank's chunk over every rank's x and stores the sums into every rank's x, then raises flag
    (rank, s) on every peer and waits for flag (p, s) from every peer p: the same program's sums
    stored here. Ranks are `group`'s, if given."""
    epoch = call_epoch(calls_ptr)
    me = dl.rank(group)
    world = dl.num_ranks(group)
    split = tl.program_id(0)
    splits = tl.num_programs(0)
    flags = in_slot(flags_ptr, epoch, world * (splits + 1))
    ready = flags + world * splits
    if split == 0:
        notify_peers(ready + me, epoch, group)
    chunk = x_ptr + me * m
    for step in range(1, world):
        chunk = after_flags(chunk, ready + (me + step) % world, 1, epoch)
    length = tl.minimum(tl.maximum(n - me * m, 0), m)
    offsets = tl.arange(0, BLOCK)
    for j in range(split, slices, splits):
        start, stop = split_bounds(length, j, slices, BLOCK)
        for offset in range(start, stop, BLOCK):
            mask = offset + offsets < stop
            total = tl.zeros([BLOCK], tl.float32)
            for step in range(world):
                total += tl.load(dl.symm_at(chunk, (me + step) % world, group) + offset + offsets,
                                 mask=mask).to(tl.float32)
            total = total.to(x_ptr.dtype.element_ty)
            for step in range(world):
                tl.store(dl.symm_at(chunk, (me + step) % world, group) + offset + offsets, total, mask=mask)
    notify_peers(flags + me * splits + split, epoch, group)
    for step in range(1, world):
        dl.wait(flags + ((me + step) % world) * splits + split, 1, scope="sys", semantic="acquire", waitValue=epoch)
    finish_call(calls_ptr)


class SymmetricTwoShot(Method):
    """The two-shot all-reduce in place on a symmetric x among `ranks` (an `ops.ranks.Ranks`),
    built for `numel` elements of `dtype` per rank, on at most `programs` programs (each takes
    slices of this rank's chunk)."""

    name = "two_shot"
    one_node = True

    def __init__(self, numel: int, dtype: torch.dtype, programs: int, ranks):
        super().__init__()
        self.ranks = ranks
        self.numel = numel
        self.chunk = triton.cdiv(numel, ranks.world_size)
        self.block, self.splits, self.warps = sizing.steps_for(self.chunk, dtype.itemsize, programs)
        self.slices = sizing.slices_for(self.chunk, dtype.itemsize, self.splits)
        self.workspace = self.own(Workspace(0, dtype, ranks.world_size * (self.splits + 1),
                                            name="all_reduce symmetric two_shot", group=ranks.group))

    def launch(self, x: torch.Tensor, out: torch.Tensor) -> None:
        ws = self.workspace
        all_reduce_symmetric_kernel[(self.splits,)](
            x_ptr=x, flags_ptr=ws.flags, calls_ptr=ws.calls, n=self.numel, m=self.chunk, slices=self.slices,
            BLOCK=self.block, num_warps=self.warps, group=self.ranks.group)
