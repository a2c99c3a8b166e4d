"""# 07. GEMM-ReduceScatter: sending tiles from the epilogue

The second projection of a tensor-parallel layer is row-parallel: each rank holds a slice of the
inner dimension, `a` (M x K_local) and `b` (K_local x N), so each computes a *partial* product
`a @ b` of the full M x N output, and the layer's output is the sum of the partials over the
ranks. With the tokens split by rows again, rank `r` needs only rows `r * M / world_size` onward
of that sum: `reduce_scatter(a @ b)`.

Done in one kernel, the reduce-scatter disappears into the GEMM's epilogue: as soon as a tile of
the partial product is computed, it goes to the rank that owns those rows, and the owner adds
what it received to its own tile at the very end.

You will learn:

- sending results from a GEMM's epilogue, a flag per tile;
- ordering the work so that the waits come last: each rank computes the other ranks' tiles
  first and its own rows last, when the peers' partials have long arrived;
- summing the partials in rank order into the owner's accumulator.

Run: `tridist run -n 2 tutorials/07-gemm-reduce-scatter.py`
"""
import sys

import torch
import triton.language as tl

import tridist
import tridist.language as dl
from tridist import ops

ROWS, K, N = 32, 64, 32  # each rank's rows of the output; a is (world_size * ROWS) x K, b is K x N
BLOCK_M, BLOCK_N, BLOCK_K = 16, 16, 32
PROGRAMS = 4
CALLS = 2


def operands(rank: int, call: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-1, 0 and 1: each rank's partial sums are integers of at most 7 bits, exact in bf16 too, so
    only the final rounding (of the library's bf16 output) differs from the exact sum."""
    g = torch.Generator().manual_seed(100 * call + rank)
    a = torch.randint(-1, 2, (world_size * ROWS, K), generator=g).float()
    b = torch.randint(-1, 2, (K, N), generator=g).float()
    return a.to(torch.bfloat16), b.to(torch.bfloat16)


# %%
# ## The kernel
#
# `partials` is symmetric: per slot (alternating by epoch), a row of tiles for each source rank;
# tile `t` of rank `s`'s rows, computed by rank `src`, lands in `partials[slot, src, t]` on rank
# `s` as `BLOCK_M x BLOCK_N` contiguous fp32 values, and flag `(slot, src, t)` there says it has.
#
# Each program walks the output tiles shard by shard, in the order `rank + 1`, `rank + 2`, ...,
# its own rank's rows last. A tile for another rank is computed, stored into that rank's
# `partials` through `dl.symm_at`, and announced with `dl.notify` right away. A tile of this
# rank's rows is computed last, and then the partials of the other ranks are added to it, in rank
# order, each after a wait on its flag. By then every peer has had the whole rest of its GEMM to
# send it, so those waits rarely spin.
#
# (The library's `gemm_rs` sends the partials in bf16 and sums in fp32; here they travel in
# fp32, to keep the sums exact.)
@tridist.jit(do_not_specialize=["epoch"])
def gemm_rs(a_ptr, b_ptr, out_ptr, partials_ptr, flags_ptr, rows_per_rank, N, K, epoch, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    me = dl.rank()
    world = dl.num_ranks()
    tiles_n = N // BLOCK_N
    per_shard = (rows_per_rank // BLOCK_M) * tiles_n
    slot = partials_ptr + (epoch % 2) * world * per_shard * BLOCK_M * BLOCK_N
    flags = flags_ptr + (epoch % 2) * world * per_shard
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    tile_offsets = rows[:, None] * BLOCK_N + cols[None, :]  # a tile, contiguous in `partials`
    for tile in range(tl.program_id(0), world * per_shard, tl.num_programs(0)):
        owner = (me + 1 + tile // per_shard) % world
        t = tile % per_shard
        tm = t // tiles_n
        tn = t % tiles_n
        out_rows = owner * rows_per_rank + tm * BLOCK_M + rows
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in range(0, K, BLOCK_K):
            a = tl.load(a_ptr + out_rows[:, None] * K + (k + ks)[None, :])
            b = tl.load(b_ptr + (k + ks)[:, None] * N + tn * BLOCK_N + cols[None, :])
            acc = dl.dot(a, b, acc)
        if owner != me:  # the epilogue sends the partial tile to its owner
            dest = dl.symm_at(slot, owner) + (me * per_shard + t) * BLOCK_M * BLOCK_N
            tl.store(dest + tile_offsets, acc)
            dl.notify(flags + me * per_shard + t, owner, signal=epoch)
        else:  # this rank's rows: add every rank's partial, in rank order
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for src in range(world):
                if src == me:
                    total += acc
                else:
                    token = dl.wait(flags + src * per_shard + t, 1, scope="sys", waitValue=epoch)
                    tile_ptr = dl.consume_token(slot + (src * per_shard + t) * BLOCK_M * BLOCK_N, token)
                    total += tl.load(tile_ptr + tile_offsets)
            tl.store(out_ptr + (tm * BLOCK_M + rows)[:, None] * N + tn * BLOCK_N + cols[None, :], total)


# %%
# ## Running it
#
# Every rank waits for a tile from every peer in every call, which is what makes two slots
# enough: a rank that starts call `e + 2` received every peer's tiles of call `e + 1`, so every
# peer had finished call `e`, and its reads of the slot about to be reused.
def main():
    w = tridist.init()
    if w.nnodes > 1:
        sys.exit("this tutorial reaches its peers through dl.symm_at, on one node (tutorial 03 crosses nodes)")
    n = w.world_size
    per_shard = (ROWS // BLOCK_M) * (N // BLOCK_N)
    partials = tridist.symm_empty((2, n, per_shard, BLOCK_M * BLOCK_N), torch.float32)
    flags = tridist.signals(2 * n * per_shard)
    for call in range(1, CALLS + 1):
        a, b = operands(w.rank, call, n)
        out = torch.full((ROWS, N), float("nan"), device=w.device)
        gemm_rs[(PROGRAMS,)](a.to(w.device), b.to(w.device), out, partials, flags, ROWS, N, K, call,
                             BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
        if not torch.equal(out.cpu(), reference(w, call)):
            sys.exit(f"rank {w.rank}: call {call}: wrong sums")
    check_library(w)
    print(f"rank {w.rank}: GEMM-ReduceScatter over {n} ranks correct, and the library's")
    tridist.finalize()


def reference(w, call: int) -> torch.Tensor:
    """This rank's rows of the sum over ranks of a @ b."""
    total = sum(a.float() @ b.float() for a, b in (operands(r, call, w.world_size) for r in range(w.world_size)))
    return total[w.rank * ROWS:(w.rank + 1) * ROWS]


# %%
# ## The library's GEMM-ReduceScatter
#
# `tridist.ops.gemm_rs(a, b)` is this kernel grown up: a persistent TMA GEMM with one program per
# SM, partial tiles in the output dtype, a reduction in two steps across nodes (summed on the
# node first, one put per node), and fp8. It needs its whole grid resident, as this one does.
# Its partials and output are bf16: the check allows the output's rounding.
def check_library(w) -> None:
    a, b = operands(w.rank, CALLS, w.world_size)
    result = ops.gemm_rs(a.to(w.device), b.to(w.device))
    try:
        torch.testing.assert_close(result.cpu().float(), reference(w, CALLS), rtol=2 ** -7, atol=0)
    except AssertionError as error:
        sys.exit(f"rank {w.rank}: tridist.ops.gemm_rs: {error}")


if __name__ == "__main__":
    main()
