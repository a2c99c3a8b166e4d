"""The low-latency (LL) sum that reduce-scatter "ll" and all-reduce "ll" share.

Protocol. Each rank's `PacketRows` hold, per slot, a row of packets for every rank (`dl.ll`: a
4-byte word with the low 32 bits of the call's epoch as its flag, in 8 bytes). A rank writes the
words a peer sums into row `rank` of that peer's packets, and reads its peers' words from its own
rows once their flags equal this call's epoch: no separate signal, no fence. Two slots suffice for
the reason `protocol` gives: every call receives a packet from every peer.

Words are summed in rank order in fp32 (a 4-byte word is one fp32 or two 16-bit floats), so every
rank gets the same bits.
"""
import torch
import triton.language as tl

import tridist.language as dl
from tridist.runtime.jit import jit

from .. import checks
from ..protocol import LL_BLOCK, PacketRows, call_epoch, finish_call, in_slot, pack_halves, split_bounds, unpack_halves


@jit
def reduce_ll_kernel(x_ptr, out_ptr, packets_ptr, calls_ptr, n, peer_stride, row, slot_numel, DTYPE: tl.constexpr,
                     splits, BLOCK: tl.constexpr, group=None):
    """x and out are viewed as int32 words, each one fp32 or two 16-bit floats of DTYPE. Rank p gets
    the sum over ranks of the n words at x + p * peer_stride: peer_stride is 0 for an all-reduce
    (every rank sums all of x) and n for a reduce-scatter (rank p sums chunk p). Program s sends
    its slice of what each peer sums to row `rank` of that peer's packets, then sums its slice over
    the ranks in rank order (its own words straight from x), so every rank gets the same bits.
    Ranks are `group`'s, if given."""
    epoch = call_epoch(calls_ptr)
    me = dl.rank(group)
    world = dl.num_ranks(group)
    stage = in_slot(packets_ptr, epoch, slot_numel)
    start, stop = split_bounds(n, tl.program_id(0), splits, BLOCK)
    offsets = tl.arange(0, BLOCK)
    for step in range(1, world):
        peer = (me + step) % world
        remote = dl.symm_at(stage + me * row, peer, group)
        source = x_ptr + peer * peer_stride
        for offset in range(start, stop, BLOCK):
            mask = offset + offsets < stop
            dl.ll.send(remote + offset + offsets, tl.load(source + offset + offsets, mask=mask), epoch, mask)
    mine = x_ptr + me * peer_stride
    for offset in range(start, stop, BLOCK):
        mask = offset + offsets < stop
        own = tl.load(mine + offset + offsets, mask=mask)
        low = tl.zeros([BLOCK], tl.float32)
        high = tl.zeros([BLOCK], tl.float32)
        for peer in range(world):
            words = own
            if peer != me:
                words = dl.ll.recv(stage + peer * row + offset + offsets, epoch, mask)
            if DTYPE == tl.float32:
                low += tl.cast(words, tl.float32, bitcast=True)
            else:
                peer_low, peer_high = unpack_halves(words, DTYPE)
                low += peer_low
                high += peer_high
        if DTYPE == tl.float32:
            total = tl.cast(low, tl.int32, bitcast=True)
        else:
            total = pack_halves(low, high, DTYPE)
        tl.store(out_ptr + offset + offsets, total, mask=mask)
    finish_call(calls_ptr)


def reduce_packets(packets: PacketRows, x: torch.Tensor, out: torch.Tensor, peer_stride: int, ranks) -> None:
    """Launch `reduce_ll_kernel` on `packets`' programs: `out` = the sum over `ranks` (an
    `ops.ranks.Ranks`, those `packets` were allocated among) of `packets.words` words of x from
    `rank * peer_stride`."""
    reduce_ll_kernel[(packets.splits,)](
        x_ptr=x.view(-1).view(torch.int32), out_ptr=out.view(-1).view(torch.int32), packets_ptr=packets.staging,
        calls_ptr=packets.calls, n=packets.words, peer_stride=peer_stride, row=packets.row,
        slot_numel=packets.slot_numel, DTYPE=checks.TRITON_DTYPES[x.dtype], splits=packets.splits, BLOCK=LL_BLOCK,
        group=ranks.group)
