"""# 09. Flash decoding across ranks

Generating a token attends one query per sequence over every position of that sequence's KV cache.
There is almost no arithmetic: the time goes into reading K and V once, so a decode step is as fast
as the memory it reads. With a context of a million positions the cache of one sequence no longer
fits one GPU, or reading it takes too long, and it is split by position across GPUs (context
parallelism): rank r holds some of the positions, every rank holds the same query.

Softmax over the union of the slices does not need the slices in one place. Attention over a set
of positions can be summarised by two things: the output `o` (already divided by its own softmax
denominator) and the log of that denominator, the log-sum-exp `lse`. Two summaries of disjoint sets
merge exactly: weigh each output by `exp(lse_r - max lse)`, add, divide by the sum of the weights.
So each rank attends over its own slice, and the ranks exchange one small record per (sequence,
head): the merge costs nothing next to reading the cache.

`tridist.ops.flash_decode(q, k_cache, v_cache, seqlens, block_table=None)` does this in two kernels
and no host round trip. The first reads this rank's slice with every SM busy: each sequence is cut
into chunks (a split-KV or "flash decoding" kernel), the query heads that share a KV head (grouped
query attention) share a program so K and V are read once, and each chunk leaves its record. The
second merges each (sequence, KV head)'s records, many programs to one (a block of output columns
each, so that each loads every chunk at once), sends the merged piece to every rank, waits for
every rank's and merges them in rank order, so every rank ends with the same bits (the kernels:
`tridist/ops/attention/split_kv.py` and `combine.py`, the records they share: `_records.py`). This
tutorial checks the merge rule in plain PyTorch, then runs the op on a contiguous and on a paged
cache.

Run: `tridist run -n 2 tutorials/09-flash-decoding.py`
"""
# %%
# The merge rule, in plain PyTorch on one rank. `attend` returns a summary of attention over some
# positions; `merge` combines summaries of disjoint positions. Attention over the whole sequence and
# the merge of attention over its two halves agree.
import sys

import torch
import torch.nn.functional as F

import tridist
from tridist import ops


def attend(q, k, v):
    """q [H, D], k and v [N, H, D] -> (o [H, D], lse [H]) over the N positions."""
    scores = torch.einsum("hd,nhd->hn", q, k) / q.shape[-1] ** 0.5
    lse = torch.logsumexp(scores, dim=-1)
    return torch.einsum("hn,nhd->hd", torch.exp(scores - lse[:, None]), v), lse


def merge(summaries):
    """Summaries of disjoint position sets -> the summary of their union."""
    outputs = torch.stack([o for o, _ in summaries])
    lses = torch.stack([lse for _, lse in summaries])
    top = lses.max(dim=0).values
    weights = torch.exp(lses - top)
    return (weights[..., None] * outputs).sum(0) / weights.sum(0)[..., None], top + torch.log(weights.sum(0))


def check_merge_rule() -> bool:
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(4, 16, generator=g), torch.randn(30, 4, 16, generator=g), torch.randn(30, 4, 16, generator=g)
    whole, _ = attend(q, k, v)
    halves, _ = merge([attend(q, k[:12], v[:12]), attend(q, k[12:], v[12:])])
    return torch.allclose(whole, halves, atol=1e-6)


# %%
# Each rank's slice. Every rank builds the whole cache from one seed (so that each can compute the
# reference below) and keeps its own slice: rank r holds 20 + 9r positions of each sequence, a
# contiguous cache [B, L, Hkv, D] with `seqlens[b]` positions of sequence b. Eight query heads share
# two KV heads (GQA 4).
BATCH, Q_HEADS, KV_HEADS, HEAD_DIM = 2, 8, 2, 64


def whole_problem(world_size: int):
    """q [B, Hq, D] and every rank's (K, V) slice [B, L_r, Hkv, D], in bf16 on the CPU."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(BATCH, Q_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    slices = [tuple(torch.randn(BATCH, 20 + 9 * r, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
                    for _ in range(2)) for r in range(world_size)]
    return q, slices


def reference(q, slices):
    """SDPA in fp32 on the gathered cache: [B, Hkv, N, D], every rank's positions one after the other."""
    k = torch.cat([k for k, _ in slices], dim=1).transpose(1, 2).float()
    v = torch.cat([v for _, v in slices], dim=1).transpose(1, 2).float()
    return F.scaled_dot_product_attention(q[:, :, None].float(), k, v, enable_gqa=True)[:, :, 0]


# %%
# The op on the contiguous slice. It is a collective: every rank calls it with the same q, and every
# rank gets the whole answer. bf16 keeps 8 significant bits, so the result is within 1% of the fp32
# reference. `all_gather` of the output's bits shows that every rank holds the very same bits.
def contiguous(w, q, slices):
    k, v = (t.to(w.device) for t in slices[w.rank])
    seqlens = torch.full((BATCH,), k.shape[1], dtype=torch.int32, device=w.device)
    out = ops.flash_decode(q.to(w.device), k, v, seqlens)
    error = (out.float().cpu() - reference(q, slices)).abs().max().item()
    bits = ops.all_gather(out.view(torch.int16).reshape(-1)).view(w.world_size, -1)
    return error < 1e-2 and bool((bits == bits[0]).all())


# %%
# A paged cache, as vLLM keeps it: a pool of blocks of `page` positions [num_blocks, page, Hkv, D]
# and a block table [B, max_blocks] naming each sequence's blocks in order. Here the slice's blocks
# sit in the pool in reverse order; the kernel gathers them through the table.
def paged(w, q, slices, page=4):
    k, v = slices[w.rank]
    length = k.shape[1]
    blocks = -(-length // page)
    table = torch.arange(BATCH * blocks, dtype=torch.int32).flip(0).view(BATCH, blocks)
    pools = []
    for cache in (k, v):
        padded = torch.zeros(BATCH, blocks * page, KV_HEADS, HEAD_DIM, dtype=cache.dtype)
        padded[:, :length] = cache
        pool = torch.empty(BATCH * blocks, page, KV_HEADS, HEAD_DIM, dtype=cache.dtype)
        pool[table.view(-1).long()] = padded.view(BATCH * blocks, page, KV_HEADS, HEAD_DIM)
        pools.append(pool.to(w.device))
    seqlens = torch.full((BATCH,), length, dtype=torch.int32, device=w.device)
    out = ops.flash_decode(q.to(w.device), pools[0], pools[1], seqlens, table.to(w.device))
    return (out.float().cpu() - reference(q, slices)).abs().max().item() < 1e-2


# %%
def main():
    w = tridist.init()
    q, slices = whole_problem(w.world_size)
    results = {"merge rule": check_merge_rule(), "contiguous": contiguous(w, q, slices),
               "paged": paged(w, q, slices)}
    if w.rank == 0:
        for name, ok in results.items():
            print(f"{name}: {'ok' if ok else 'WRONG'}")
    tridist.finalize()
    if not all(results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
