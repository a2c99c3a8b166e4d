"""# 06. AllGather-GEMM: tiles that wait on tokens

In a tensor-parallel layer the tokens are split over the ranks by rows, and the first projection
needs all of them: `out = all_gather(a_shard) @ b`, with `b` this rank's columns of the weight.
Done in sequence, the GEMM waits for the whole all-gather. Done in one kernel, the GEMM starts on
the rows it already has, this rank's own shard, while the peers' shards are on their way, and
each tile of a peer's rows waits only for that peer's shard.

You will learn:

- overlapping communication with compute inside one kernel: every program first sends its part
  of the shard, then computes tiles, its own shard's first;
- a wait per tile, whose token guards exactly the loads of that tile (`dl.consume_token`);
- why a kernel whose programs wait on each other's ranks needs all of its programs running at
  once.

Run: `tridist run -n 2 tutorials/06-allgather-gemm.py`
"""
import sys

import torch
import triton.language as tl

import tridist
import tridist.language as dl
from tridist import ops

M_SHARD, K, N = 32, 64, 32  # a_shard is M_SHARD x K on every rank, b is K x N
BLOCK_M, BLOCK_N, BLOCK_K = 16, 16, 32
PROGRAMS = 4  # a persistent grid: few enough that every program runs at once
CALLS = 2


def operands(rank: int, call: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quarters from -1 to 1, exact in bf16, whose products and sums are exact in fp32: the
    kernel's result must equal the reference bit for bit, whatever the order of its additions."""
    g = torch.Generator().manual_seed(100 * call + rank)
    a_shard = torch.randint(-4, 5, (M_SHARD, K), generator=g) / 4
    b = torch.randint(-4, 5, (K, N), generator=torch.Generator().manual_seed(call)) / 4
    return a_shard.to(torch.bfloat16), b.to(torch.bfloat16)


# %%
# ## The kernel
#
# `gathered` is symmetric, two slots of `world_size * M_SHARD` rows (alternating by epoch, as in
# tutorial 02's pull); flag `(slot, s)` on a rank says shard `s` has arrived there.
#
# 1. **Send.** Program `i` stores this rank's shard into the `gathered` buffer of peers
#    `rank + 1 + i`, `rank + 1 + i + PROGRAMS`, ... and raises its flag there.
# 2. **Own shard.** The tiles of this rank's rows come straight from `a_shard`: no wait.
# 3. **Peers' shards**, in the order they are likely to arrive (`rank + 1`, `rank + 2`, ...):
#    each tile first waits for its shard's flag. The A pointer of the tile goes through
#    `dl.consume_token`, so its loads cannot be hoisted above the wait; once the flag is up, the
#    wait is a single load, so a program pays for it once per shard in practice.
#
# The programs wait for flags that other ranks' programs raise in step 1, which every program
# does before it waits for anything. If some programs of a rank could not start until others
# ended (more programs than the GPU runs at once, or SMs taken by another kernel), a waiting
# program could hold the SM that a sender needs. So the grid is persistent: a few programs, each
# looping over tiles, all resident at once. The library's `ag_gemm` keeps the senders off the
# GEMM's SMs altogether (copy engines, or programs of their own).
@tridist.jit(do_not_specialize=["epoch"])
def ag_gemm(a_shard_ptr, b_ptr, out_ptr, gathered_ptr, flags_ptr, m_shard, N, K, epoch, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, COPY_BLOCK: tl.constexpr):
    me = dl.rank()
    world = dl.num_ranks()
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    slot = gathered_ptr + (epoch % 2) * world * m_shard * K
    flags = flags_ptr + (epoch % 2) * world

    # 1. send this rank's shard to the peers this program serves
    offsets = tl.arange(0, COPY_BLOCK)
    for step in range(1 + pid, world, programs):
        peer = (me + step) % world
        dest = dl.symm_at(slot, peer) + me * m_shard * K
        for start in range(0, m_shard * K, COPY_BLOCK):
            mask = start + offsets < m_shard * K
            tl.store(dest + start + offsets, tl.load(a_shard_ptr + start + offsets, mask=mask), mask=mask)
        dl.notify(flags + me, peer, signal=epoch)

    # 2 and 3. every output tile, shard by shard, this rank's own first
    tiles_m = m_shard // BLOCK_M
    tiles_n = N // BLOCK_N
    per_shard = tiles_m * tiles_n
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    for tile in range(pid, world * per_shard, programs):
        shard = (me + tile // per_shard) % world
        tm = (tile % per_shard) // tiles_n
        tn = (tile % per_shard) % tiles_n
        if shard == me:
            a_rows = a_shard_ptr + tm * BLOCK_M * K
        else:
            token = dl.wait(flags + shard, 1, scope="sys", waitValue=epoch)
            a_rows = dl.consume_token(slot + (shard * m_shard + tm * BLOCK_M) * K, token)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in range(0, K, BLOCK_K):
            a = tl.load(a_rows + rows[:, None] * K + (k + ks)[None, :])
            b = tl.load(b_ptr + (k + ks)[:, None] * N + tn * BLOCK_N + cols[None, :])
            acc = dl.dot(a, b, acc)
        out_rows = shard * m_shard + tm * BLOCK_M + rows
        tl.store(out_ptr + out_rows[:, None] * N + tn * BLOCK_N + cols[None, :], acc)


# %%
# ## Running it
#
# Sizes are whole tiles here (the kernel has no masks in its GEMM). `dl.dot` is `tl.dot`, which in
# the emulator multiplies in fp32 so that bf16 products come out exact.
def main():
    w = tridist.init()
    if w.nnodes > 1:
        sys.exit("this tutorial reaches its peers through dl.symm_at, on one node (tutorial 03 crosses nodes)")
    n = w.world_size
    gathered = tridist.symm_empty((2, n * M_SHARD, K), torch.bfloat16)
    flags = tridist.signals(2 * n)
    for call in range(1, CALLS + 1):
        a_shard, b = operands(w.rank, call)
        out = torch.full((n * M_SHARD, N), float("nan"), device=w.device)
        ag_gemm[(PROGRAMS,)](a_shard.to(w.device), b.to(w.device), out, gathered, flags, M_SHARD, N, K, call,
                             BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, COPY_BLOCK=1024)
        a = torch.cat([operands(r, call)[0] for r in range(n)])
        if not torch.equal(out.cpu(), a.float() @ b.float()):
            sys.exit(f"rank {w.rank}: call {call}: wrong product")
    check_library(w)
    print(f"rank {w.rank}: AllGather-GEMM over {n} ranks correct, and the library's")
    tridist.finalize()


# %%
# ## The library's AllGather-GEMM
#
# `tridist.ops.ag_gemm(a_shard, b)` does the same with a persistent TMA GEMM, shards sent by the
# copy engines on one node (or by a few programs of their own, across nodes), device-side
# epochs, and fp8 as well as bf16. Its output is bf16, so the check allows bf16 rounding.
def check_library(w) -> None:
    a_shard, b = operands(w.rank, CALLS)
    result = ops.ag_gemm(a_shard.to(w.device), b.to(w.device))
    a = torch.cat([operands(r, CALLS)[0] for r in range(w.world_size)])
    try:
        torch.testing.assert_close(result.cpu().float(), a.float() @ b.float(), rtol=2 ** -7, atol=0)
    except AssertionError as error:
        sys.exit(f"rank {w.rank}: tridist.ops.ag_gemm: {error}")


if __name__ == "__main__":
    main()
