"""# 08. Expert parallelism: all-to-all and MoE dispatch

A mixture-of-experts layer replaces one MLP with many, the experts, and a router that sends each
token to a few of them (its top k). With expert parallelism each rank holds some of the experts
whole, so every layer moves tokens twice: to the ranks that hold their experts (the *dispatch*),
and the experts' outputs back to the tokens' ranks, where each token adds up its k outputs with
its routing weights (the *combine*).

Both are all-to-alls in which every rank sends a different number of rows to every other, and
those numbers come out of the router, on the GPU, at every step. An all-to-all whose split sizes
are host integers (`torch.distributed.all_to_all_single`) has to copy them to the host first:
the CPU stops until the GPU has routed, the queue of kernels runs dry, and such a layer cannot be
captured in a CUDA graph. And the receiver does not know how many rows are coming, so the usual
answer is two exchanges, the counts and then the rows.

tridist's all-to-alls take their counts on the device and need one exchange, because a sender
never has to learn where its rows will land in the receiver's output. Every receiver keeps, in
symmetric memory, a *staging* area with one region per source rank, as large as the most rows that
source may send. A sender writes its rows into its own region of each peer's staging, then the
counts, then raises a flag on the peer. A receiver waits for every source's flag; then it has
every count, lays out its output from them (packed in rank order, or by expert) and copies the
rows out of staging. Flags are never reset: each call waits for its own epoch, one more than the
last call's. And since every call waits for a flag from every peer, no rank gets more than a call
ahead of another, so two staging slots, used in turn, let calls run back to back with no
handshake.

You will learn:

- `all_to_all_v`: rows routed on the device, counts that never go to the host;
- the two-dimensional layouts of expert parallelism, `all_to_all_v_2d` (by rank and expert, out by
  expert) and `all_to_all_v_2d_offset`, which brings every row back to where it started;
- `EPBuffer`, dispatch and combine for top-k routing, in its normal mode (a token travels once to
  each rank it needs) and its low-latency mode (once per expert, received grouped by expert);
- the low-latency receive hook: sending, computing, then receiving.

Run: `tridist run -n 2 tutorials/08-expert-parallel-dispatch.py`

Any number of ranks works, on one node or across nodes (`--nnodes`): to another node the rows go
as NVSHMEM puts, on this one as stores through `dl.symm_at`, with the same protocol.
"""
import sys

import torch

import tridist
from tridist import ops

# %%
# ## Rows that say where they come from
#
# Every row of the all-to-alls is two int32: the rank it starts on and its index there. A row that
# lands in the wrong place, or arrives twice, cannot pass the checks below, which are exact.
#
# The "router" is any function of a row computed on the device. This one sends rows unevenly, so
# that ranks send different numbers of rows to each peer, and some none.
ROWS = 12  # rows of x on every rank


def rows_of(rank: int) -> torch.Tensor:
    return torch.stack([torch.full((ROWS,), rank), torch.arange(ROWS)], dim=1).to(torch.int32)


def route(x: torch.Tensor, destinations: int) -> torch.Tensor:
    """Each row's destination among `destinations`, from its contents, where x is."""
    return (x[:, 1] * x[:, 1] // 4 + x[:, 0]).long() % destinations


def counts(destination: torch.Tensor, destinations: int) -> torch.Tensor:
    """Rows for each destination, on the device. (torch.bincount would read the largest id back to
    the host on GPUs, to size its output.)"""
    return (destination[:, None] == torch.arange(destinations, device=destination.device)).sum(0)


# %%
# ## all_to_all_v
#
# x holds the rows for rank 0, then those for rank 1, ...: a stable sort by destination puts them
# in that order and keeps each destination's rows in the order they had. `in_splits[p]` rows go to
# rank p; `out` receives rank 0's rows for this rank, then rank 1's, ..., packed, and has room for
# the most that can arrive, every rank's whole x. The call returns, on the device, how many rows
# came from each rank and where they start in `out`.
#
# Inside, program (p, s) of the kernel sends its share s of the rows for rank p into region `rank`
# of p's staging, with the count, and raises flag (rank, s) there; then it waits for flag (q, s)
# of every rank q and copies share s of the rows that rank p sent here into `out`. The rows of
# `out` past those received are not written: filled with -1 here, they must still hold -1.
def check_all_to_all_v(w) -> bool:
    x = rows_of(w.rank).to(w.device)
    destination = route(x, w.world_size)
    order = torch.argsort(destination, stable=True)
    out = torch.full((w.world_size * ROWS, 2), -1, dtype=torch.int32, device=w.device)
    result = ops.all_to_all_v(x[order], counts(destination, w.world_size), out)

    # What should arrive: from each rank in turn, its rows routed here, in their order.
    arrived = [rows_of(q)[route(rows_of(q), w.world_size) == w.rank] for q in range(w.world_size)]
    expected = torch.cat(arrived)
    splits = [len(rows) for rows in arrived]
    starts = [sum(splits[:q]) for q in range(w.world_size)]
    return (torch.equal(out[:len(expected)].cpu(), expected) and bool((out[len(expected):] == -1).all())
            and result.tolist() == [splits, starts])


# %%
# ## Two dimensions: ranks and their experts
#
# With G experts a rank, the destination of a row is an expert g = p * G + e: local expert e of
# rank p. Sorting by g orders x by rank, and within a rank by expert, which is what
# `all_to_all_v_2d` takes, with `in_splits[p * G + e]` rows for chunk (p, e). It delivers them
# by expert: for local expert 0 the chunks from rank 0, 1, ..., then for expert 1 ..., each
# expert's first row at a multiple of `major_align` (a GEMM's tile height, say, so that no tile
# holds two experts) and each expert taking at least `major_align` rows, an empty one too, as
# PyTorch's `all_to_all_vdev_2d` does; the rows between experts are left as they were. `out` needs
# room for that padding. The call returns, indexed [e * world_size + s], the rows of each chunk and
# where it starts.
#
# The experts would now run on `out`. `all_to_all_v_2d_offset` is the way back: given `out` and
# what `all_to_all_v_2d` returned, it sends every chunk back to its rank, which receives them in
# the order it sent them: each row returns to the place it left from in the sorted x.
G, ALIGN = 2, 4


def check_all_to_all_v_2d(w) -> bool:
    experts = G * w.world_size
    x = rows_of(w.rank).to(w.device)
    expert = route(x, experts)
    order = torch.argsort(expert, stable=True)
    out = torch.full((w.world_size * ROWS + G * ALIGN, 2), -1, dtype=torch.int32, device=w.device)
    result = ops.all_to_all_v_2d(x[order], counts(expert, experts), out, major_align=ALIGN)

    ok = True
    for e in range(G):
        for s in range(w.world_size):
            chunk = rows_of(s)[route(rows_of(s), experts) == w.rank * G + e]
            rows, start = result[:, e * w.world_size + s].tolist()
            ok &= rows == len(chunk) and torch.equal(out[start:start + rows].cpu(), chunk)
        ok &= int(result[1, e * w.world_size]) % ALIGN == 0

    back = torch.full((ROWS, 2), -1, dtype=torch.int32, device=w.device)
    ops.all_to_all_v_2d_offset(out, result, back)
    returned = torch.empty_like(back)
    returned[order] = back  # undo the sort
    return bool(ok) and torch.equal(returned, x)


# %%
# ## EPBuffer: dispatch and combine
#
# `EPBuffer(num_experts, hidden, max_tokens_per_rank)` holds the staging of one layer's shape
# (allocated at each mode's first call, as a collective); its calls take the router's output
# as it is: `topk_idx` [T, k] (expert ids, -1 for an unused slot) and `topk_weights` [T, k]. Rank r
# holds experts r * E_local ... (r + 1) * E_local - 1. The most tokens a rank may pass sizes every
# staging region, which is why the buffer needs it. (A rank's rows for itself skip the staging: its
# dispatch copies them from x to where they land, its combine reads them where they are.)
#
# In the normal mode a token goes once to every rank that holds at least one of its experts, with
# its expert ids and weights. `dispatch` returns the received tokens (rank 0's first, each rank's
# in token order), their ids as local experts (-1 where the expert is another rank's), their
# weights, the pairs each local expert got, and a handle. `combine(y, handle)` takes one output
# per received token, its local experts' outputs already weighted and summed, sends each back to
# its rank, and every token sums what its ranks sent, in rank order, in fp32.
#
# With identity experts (an expert's output is its input) the layer computes x times the sum of
# the token's weights. A received token's weights of other ranks' experts are still there, so
# the experts of this rank are picked with `recv_topk_idx >= 0`. Tokens hold small integers and the
# weights quarters, so every product and sum is exact in bf16 and the check can ask for equality.
E_LOCAL, HIDDEN, TOKENS = 2, 64, 6


def tokens_of(rank: int) -> torch.Tensor:
    """Token t of rank r: (r, t, 2, 3, ..., HIDDEN - 1), exact in bf16."""
    x = torch.arange(HIDDEN).repeat(TOKENS, 1)
    x[:, 0], x[:, 1] = rank, torch.arange(TOKENS)
    return x.to(torch.bfloat16)


def routing_of(rank: int, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_idx: two distinct experts per token, the last token one only (-1 in its second slot);
    topk_weights: 1/2 and 1/4, in either order."""
    t = torch.arange(TOKENS)
    first = (t * t + rank) % experts
    second = (first + 1 + t % (experts - 1)) % experts
    idx = torch.stack([first, second], dim=1)
    idx[-1, 1] = -1
    weights = torch.where(t[:, None] % 2 == 0, torch.tensor([0.5, 0.25]), torch.tensor([0.25, 0.5]))
    return idx, weights


def layer_output(rank: int, experts: int) -> torch.Tensor:
    """Identity experts: each token times the sum of the weights of its real experts."""
    idx, weights = routing_of(rank, experts)
    return (tokens_of(rank).float() * torch.where(idx >= 0, weights, 0).sum(1, keepdim=True)).to(torch.bfloat16)


def check_dispatch_combine(w, buffer) -> bool:
    experts = E_LOCAL * w.world_size
    x = tokens_of(w.rank).to(w.device)
    idx, weights = (t.to(w.device) for t in routing_of(w.rank, experts))
    recv_x, recv_idx, recv_weights, recv_per_expert, handle = buffer.dispatch(x, idx, weights)
    y = recv_x.float() * torch.where(recv_idx >= 0, recv_weights, 0).sum(1, keepdim=True)
    out = buffer.combine(y.to(torch.bfloat16), handle)

    # The tokens this rank should have received: every rank's, in order, those with an expert here.
    mine = range(w.rank * E_LOCAL, (w.rank + 1) * E_LOCAL)
    received = [tokens_of(q)[t] for q in range(w.world_size) for t, ids in enumerate(routing_of(q, experts)[0])
                if any(int(e) in mine for e in ids)]
    n = len(received)
    pairs = [int(((recv_idx[:n] == e).sum())) for e in range(E_LOCAL)]
    return (torch.equal(recv_x[:n].cpu(), torch.stack(received)) and recv_per_expert.tolist() == pairs
            and torch.equal(out.cpu(), layer_output(w.rank, experts)))


# %%
# ## Low latency, and the receive hook
#
# Decoding moves a few tokens a step, and then what counts is how soon they arrive. The
# low-latency mode sends one copy of a token per (token, expert) pair, straight into the region
# of (expert, source rank) of the expert's rank, and the receiver packs each expert's regions in
# rank order: `recv_x[e]` holds local expert e's pairs, rank 0's first, `recv_count[e]` of them,
# in a block of room for every rank's tokens. Each expert's rows are together already, so its
# GEMMs need no sorting (`examples/moe_layer.py` runs them). `low_latency_combine` sends each pair's
# output back, and the token's rank sums them with the weights it kept (in k order, fp32).
#
# With `return_recv_hook=True` the dispatch only sends and returns at once; `hook()` then receives.
# In between, the GPU is free for work that does not need the tokens, here a *shared expert* that
# every token goes through (as some MoE models have), while the tokens travel. The hook must run
# before the buffer's next call. The shared expert's weights are quarters, so its products too are
# exact.
def shared_weight() -> torch.Tensor:
    return torch.randint(-2, 3, (HIDDEN, HIDDEN), generator=torch.Generator().manual_seed(0)) / 4


def check_low_latency(w, buffer) -> bool:
    experts = E_LOCAL * w.world_size
    x = tokens_of(w.rank).to(w.device)
    idx, weights = (t.to(w.device) for t in routing_of(w.rank, experts))
    recv_x, recv_count, handle, hook = buffer.low_latency_dispatch(x, idx, return_recv_hook=True)
    shared = x.float() @ shared_weight().to(w.device)
    hook()
    routed = buffer.low_latency_combine(recv_x, idx, weights, handle)  # identity experts: y = recv_x
    out = shared + routed.float()

    ok = True
    for e in range(E_LOCAL):
        expert = w.rank * E_LOCAL + e
        pairs = [tokens_of(q)[t] for q in range(w.world_size) for t, ids in enumerate(routing_of(q, experts)[0])
                 if expert in ids.tolist()]
        ok &= int(recv_count[e]) == len(pairs)
        ok &= not pairs or torch.equal(recv_x[e, :len(pairs)].cpu(), torch.stack(pairs))
    expected = tokens_of(w.rank).float() @ shared_weight() + layer_output(w.rank, experts).float()
    return bool(ok) and torch.equal(out.cpu(), expected)


# %%
def main():
    w = tridist.init()
    results = {"all_to_all_v": check_all_to_all_v(w), "all_to_all_v_2d and back": check_all_to_all_v_2d(w)}
    buffer = ops.EPBuffer(E_LOCAL * w.world_size, HIDDEN, TOKENS)
    results["EPBuffer dispatch and combine"] = check_dispatch_combine(w, buffer)
    results["low-latency dispatch, hook, combine"] = check_low_latency(w, buffer)
    buffer.free()
    for name, ok in results.items():
        print(f"rank {w.rank}: {name}: {'ok' if ok else 'WRONG'}")
    tridist.finalize()
    if not all(results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
