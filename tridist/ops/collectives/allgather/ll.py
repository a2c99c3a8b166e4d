"""All-gather method "ll" (one node, small messages): the exchange in low-latency packets.

Protocol. x and out are viewed as int32 words. Each rank's `PacketRows` hold, per slot, a row of
packets for every rank (`dl.ll`: a word with the low 32 bits of the call's epoch as its flag, in 8
bytes). In a grid of (world_size, splits) programs, program (p, s) for a peer p writes slice s of
this rank's words into row `rank` of p's packets, then reads slice s of p's words from row p of its
own packets once their flags equal this call's epoch; program (rank, s) copies slice s of x into
`out`. No separate signal, no fence. Two slots suffice for the reason `protocol` gives: every call
receives a packet from every peer. The shard must be whole 4-byte words.
"""
import torch
import triton.language as tl

import tridist.language as dl
from tridist.runtime.jit import jit

from ...protocol import LL_BLOCK, PacketRows, call_epoch, copy_slice, finish_call, in_slot, split_bounds
from ...method import Method


@jit
def all_gather_ll_kernel(x_ptr, out_ptr, packets_ptr, calls_ptr, n, row, slot_numel, splits,
                         BLOCK: tl.constexpr, group=None):
    """x and out are viewed as int32 words; program (p, s) exchanges slice s of the shards with rank
    p (of `group`, if given). Staging rows are `row` packets apart."""
    epoch = call_epoch(calls_ptr)
    me = dl.rank(group)
    peer = tl.program_id(0)
    start, stop = split_bounds(n, tl.program_id(1), splits, BLOCK)
    stage = in_slot(packets_ptr, epoch, slot_numel)
    offsets = tl.arange(0, BLOCK)
    if peer == me:
        copy_slice(x_ptr, out_ptr + me * n, start, stop, BLOCK)
    else:
        remote = dl.symm_at(stage + me * row, peer, group)
        for offset in range(start, stop, BLOCK):
            mask = offset + offsets < stop
            dl.ll.send(remote + offset + offsets, tl.load(x_ptr + offset + offsets, mask=mask), epoch, mask)
        for offset in range(start, stop, BLOCK):
            mask = offset + offsets < stop
            words = dl.ll.recv(stage + peer * row + offset + offsets, epoch, mask)
            tl.store(out_ptr + peer * n + offset + offsets, words, mask=mask)
    finish_call(calls_ptr)


class Packets(Method):
    """The LL exchange among `ranks` (an `ops.ranks.Ranks`), built for shards of `numel` elements
    of `dtype` (whole 4-byte words), on at most `programs` programs (world_size peers share them).

    Raises:
        ValueError: the shard is not whole 4-byte words.
    """

    name = "ll"
    one_node = True

    def __init__(self, numel: int, dtype: torch.dtype, programs: int, ranks):
        super().__init__()
        self.ranks = ranks
        self.workspace = self.own(PacketRows("all_gather", numel * dtype.itemsize, max(1, programs // ranks.world_size),
                                             ranks=ranks))

    def launch(self, x: torch.Tensor, out: torch.Tensor) -> None:
        ws = self.workspace
        all_gather_ll_kernel[(self.ranks.world_size, ws.splits)](
            x_ptr=x.view(-1).view(torch.int32), out_ptr=out.view(-1).view(torch.int32), packets_ptr=ws.staging,
            calls_ptr=ws.calls, n=ws.words, row=ws.row, slot_numel=ws.slot_numel, splits=ws.splits, BLOCK=LL_BLOCK,
            group=self.ranks.group)
