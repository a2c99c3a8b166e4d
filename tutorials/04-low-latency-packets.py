"""# 04. Low-latency packets: an all-reduce without signals

For small messages the cost of a collective is not bandwidth but round trips. The flag protocol
of tutorials 01-03 pays one after the data: the writer's release (which waits until its stores
have landed) and then the signal's own trip. *Low-latency (LL) packets* remove it: every 4-byte
data word travels with a 4-byte flag in the same 8-byte store, which lands whole, and the reader
polls the data itself until every word carries the flag it expects. No signal, no fence, at the
price of half the bandwidth: the method of choice up to about a megabyte.

`dl.ll.send(dest, data, flag, mask)` stores int32 words as packets, and
`dl.ll.recv(source, flag, mask)` waits until all packets carry `flag` and returns the words.

You will learn:

- the LL protocol, and why the flag must change every call (the call's epoch);
- why a packet buffer still needs two slots, although no flag is ever reset;
- summing in rank order, so that every rank gets the same bits.

Run: `tridist run -n 2 tutorials/04-low-latency-packets.py`
"""
import sys

import torch
import triton.language as tl

import tridist
import tridist.language as dl
from tridist import ops

N = 300  # fp32 elements per rank: 1.2 KB, a decode step's all-reduce
BLOCK = 512
CALLS = 4


def values(rank: int, call: int) -> torch.Tensor:
    """Integers in fp32, so the sums are exact and the check can demand equal bits."""
    return call * 1e4 + rank * 1e3 + torch.arange(N, dtype=torch.float32)


# %%
# ## The kernel
#
# One program per rank. Program `p` of another rank sends this rank's `x` to rank `p` as packets,
# into row `rank` of `p`'s packet buffer. The program for this rank receives every peer's row
# and sums all ranks' values in rank order, its own straight from `x`: every rank adds the same
# numbers in the same order and ends with the same bits.
#
# The flag is the call's epoch: packets left in the buffer by an earlier call carry an older
# flag and never look fresh. (Packets carry the flag's low 32 bits: `dl.ll` compares those on
# both sides, so epochs past 2^31 still work.) The buffer starts zeroed, so nothing carries
# epoch 1 before call 1 has sent it.
#
# Two slots (`epoch % 2`), as for tutorial 02's pull: a sender in call `e + 1` must not
# overwrite the packets of call `e` before their reader has seen them, or that reader would find
# flag `e + 1` where it waits for `e`, and wait forever. With two slots, a rank overwrites call
# `e`'s packets only in call `e + 2`, after it received every peer's packets of call `e + 1`,
# which each peer sent after finishing call `e`.
@tridist.jit(do_not_specialize=["epoch"])
def all_reduce_ll(x_ptr, out_ptr, packets_ptr, n, epoch, BLOCK: tl.constexpr):
    me = dl.rank()
    world = dl.num_ranks()
    peer = tl.program_id(0)
    slot = packets_ptr + (epoch % 2) * world * n  # packets[slot, source, element]
    offsets = tl.arange(0, BLOCK)
    if peer != me:
        row = dl.symm_at(slot, peer) + me * n
        for start in range(0, n, BLOCK):
            mask = start + offsets < n
            words = tl.load(x_ptr + start + offsets, mask=mask).to(tl.int32, bitcast=True)
            dl.ll.send(row + start + offsets, words, epoch, mask)
    else:
        for start in range(0, n, BLOCK):
            mask = start + offsets < n
            total = tl.zeros([BLOCK], tl.float32)
            for source in range(world):
                if source == me:
                    term = tl.load(x_ptr + start + offsets, mask=mask, other=0.0)
                else:
                    words = dl.ll.recv(slot + source * n + start + offsets, epoch, mask)
                    term = words.to(tl.float32, bitcast=True)
                total += term
            tl.store(out_ptr + start + offsets, total, mask=mask)


# %%
# ## Running it
#
# Back to back, no host synchronisation: call `e` only ever waits for packets flagged `e`. The
# packet buffer holds int64 words, two rows per rank. The reference adds the ranks' values in
# rank order in fp32, like the kernel.
#
# Last, the library's all-reduce with `method="ll"` (what `tridist.ops.all_reduce` picks for
# small messages on one node) sums in rank order too, so its bits must equal ours.
def main():
    w = tridist.init()
    if w.nnodes > 1:
        sys.exit("this tutorial reaches its peers through dl.symm_at, on one node (tutorial 03 crosses nodes)")
    packets = tridist.symm_zeros((2, w.world_size, N), torch.int64)
    outs = []
    for call in range(1, CALLS + 1):
        out = torch.full((N,), float("nan"), device=w.device)
        all_reduce_ll[(w.world_size,)](values(w.rank, call).to(w.device), out, packets, N, call, BLOCK=BLOCK)
        outs.append(out)
    for call, out in enumerate(outs, start=1):
        expected = values(0, call)
        for r in range(1, w.world_size):
            expected = expected + values(r, call)
        if not torch.equal(out.cpu(), expected):
            sys.exit(f"rank {w.rank}: call {call}: wrong sums")
    library = ops.all_reduce(values(w.rank, CALLS).to(w.device), method="ll")
    if not torch.equal(library.cpu(), outs[-1].cpu()):
        sys.exit(f"rank {w.rank}: tridist.ops.all_reduce(method='ll') disagrees with the tutorial's kernel")
    print(f"rank {w.rank}: {CALLS} LL all-reduces of {w.world_size} ranks correct, bit for bit")
    tridist.finalize()


if __name__ == "__main__":
    main()
