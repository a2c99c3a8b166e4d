"""# 05. A reduce-scatter, with epochs kept on the device

A reduce-scatter sums a tensor over the ranks and leaves each rank one chunk of the sum: `x`
has `world_size` chunks, and rank `r` gets the sum over ranks of chunk `r`
(`torch.distributed.reduce_scatter_tensor`). It is the first half of an all-reduce and the
collective behind a row-parallel layer.

The kernel here is the one-shot method: each rank pushes chunk `p` of its `x` to rank `p`, and
each rank sums what it received. The new part is where the epoch comes from. Until now the host
passed it as an argument, which breaks in a CUDA graph: a graph replays the launch with the
arguments it was captured with, so every replay would wait for the same epoch. Here every
launch computes its epoch on the device, from a counter of its own calls.

You will learn:

- a call counter on the device (`dl.ld`, `dl.atomic_add`), and why it gives every program of a
  launch the same epoch with no handshake;
- summing bf16 in fp32 in rank order and rounding once, as the library's reductions do;
- replaying the kernel in a CUDA graph (on GPUs), and calling the library's
  `tridist.ops.reduce_scatter`.

Run: `tridist run -n 3 tutorials/05-reduce-scatter.py`
"""
import sys

import torch
import triton
import triton.language as tl

import tridist
import tridist.language as dl
from tridist import ops

M = 200  # elements of each chunk: x has world_size * M
BLOCK = 256
CALLS = 3


def x_of(rank: int, call: int, world_size: int) -> torch.Tensor:
    """Random multiples of 1/8 below 4 in magnitude: a sum of up to 8 ranks' values needs at most
    8 significant bits, which bf16 holds exactly, so the check can demand the exact result."""
    g = torch.Generator().manual_seed(1000 * call + rank)
    return (torch.randint(-31, 32, (world_size * M,), generator=g) / 8).to(torch.bfloat16)


def reference(call: int, world_size: int, rank: int) -> torch.Tensor:
    """Chunk `rank` of the sum over ranks."""
    total = torch.zeros(M)
    for r in range(world_size):
        total = total + x_of(r, call, world_size)[rank * M:(rank + 1) * M].float()
    return total.to(torch.bfloat16)


# %%
# ## Epochs from a counter
#
# Every program adds 1 to the counter `calls` as its last act. A launch of `P` programs starts
# only after the previous launch on its stream has ended, so when any program of call `e` reads
# the counter it finds `(e - 1) * P` plus the programs of call `e` that already ended, fewer
# than `P`: dividing by `P` gives `e - 1` in every program, whichever runs first. A relaxed
# atomic is enough, since a launch's end makes its writes visible to the next launch. The counter
# is an ordinary tensor on this rank's device; graph replays count like any other launch.
@triton.jit
def call_epoch(calls_ptr):
    return dl.ld(calls_ptr, scope="gpu", semantic="relaxed") // tl.num_programs(0) + 1


@triton.jit
def finish_call(calls_ptr):
    dl.atomic_add(calls_ptr, 1, scope="gpu", semantic="relaxed")


# %%
# ## The kernel
#
# One program per rank. Program `p` of another rank stores chunk `p` of `x` into row `rank` of
# rank `p`'s staging and raises `p`'s flag `rank`. The program for this rank waits for every
# peer's flag, then sums chunk `rank` over the ranks in rank order: its own term from `x`, the
# others from staging. Two staging slots and two sets of flags alternate by epoch, as in
# tutorial 02.
@tridist.jit
def reduce_scatter(x_ptr, out_ptr, staging_ptr, flags_ptr, calls_ptr, m, BLOCK: tl.constexpr):
    epoch = call_epoch(calls_ptr)
    me = dl.rank()
    world = dl.num_ranks()
    peer = tl.program_id(0)
    stage = staging_ptr + (epoch % 2) * world * m
    flags = flags_ptr + (epoch % 2) * world
    offsets = tl.arange(0, BLOCK)
    if peer != me:
        row = dl.symm_at(stage, peer) + me * m
        for start in range(0, m, BLOCK):
            mask = start + offsets < m
            tl.store(row + start + offsets, tl.load(x_ptr + peer * m + start + offsets, mask=mask), mask=mask)
        dl.notify(flags + me, peer, signal=epoch)
    else:
        for source in range(world):
            if source != me:
                token = dl.wait(flags + source, 1, scope="sys", waitValue=epoch)
                stage = dl.consume_token(stage, token)
        for start in range(0, m, BLOCK):
            mask = start + offsets < m
            total = tl.zeros([BLOCK], tl.float32)
            for source in range(world):
                if source == me:
                    term = tl.load(x_ptr + me * m + start + offsets, mask=mask, other=0.0)
                else:
                    term = tl.load(stage + source * m + start + offsets, mask=mask, other=0.0)
                total += term.to(tl.float32)
            tl.store(out_ptr + start + offsets, total.to(tl.bfloat16), mask=mask)
    finish_call(calls_ptr)


# %%
# ## Back to back, and in a CUDA graph
#
# The host launches every call with the same arguments. The first call compiles the kernel; on
# GPUs the launch is then captured once in a CUDA graph and replayed with new data copied into
# its input: each replay is a new call for the device counter, so it waits for its own epoch.
# (In the emulator, which has no graphs, the loop calls the kernel again.)
def main():
    w = tridist.init()
    if w.nnodes > 1:
        sys.exit("this tutorial reaches its peers through dl.symm_at, on one node (tutorial 03 crosses nodes)")
    n = w.world_size
    staging = tridist.symm_empty((2, n, M), torch.bfloat16)
    flags = tridist.signals(2 * n)
    calls = torch.zeros(1, dtype=torch.int64, device=w.device)
    x = torch.empty(n * M, dtype=torch.bfloat16, device=w.device)
    out = torch.empty(M, dtype=torch.bfloat16, device=w.device)

    def launch():
        reduce_scatter[(n,)](x, out, staging, flags, calls, M, BLOCK=BLOCK)

    graph = None
    for call in range(1, CALLS + 1):
        x.copy_(x_of(w.rank, call, n))
        out.fill_(float("nan"))
        graph.replay() if graph is not None else launch()
        if not torch.equal(out.cpu(), reference(call, n, w.rank)):
            sys.exit(f"rank {w.rank}: call {call}: wrong sums")
        if call == 1 and w.device.type == "cuda":
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                launch()
    check_library(w)
    print(f"rank {w.rank}: {CALLS} reduce-scatters over {n} ranks correct, and the library's")
    tridist.finalize()


# %%
# ## The library's reduce-scatter
#
# `tridist.ops.reduce_scatter` picks its method by size and topology (here LL packets; for
# large messages a sliced one-shot like the kernel above, whose consumers sum each slice as it
# lands) and also sums in fp32 in rank order, rounding once.
def check_library(w) -> None:
    result = ops.reduce_scatter(x_of(w.rank, CALLS, w.world_size).to(w.device))
    if not torch.equal(result.cpu(), reference(CALLS, w.world_size, w.rank)):
        sys.exit(f"rank {w.rank}: tridist.ops.reduce_scatter gave wrong sums")


if __name__ == "__main__":
    main()
