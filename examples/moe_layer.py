"""One mixture-of-experts block, run three ways: `tridist run -n 4 examples/moe_layer.py`.

The block: a router scores each token against every expert, keeps its top-k experts and weighs them
with a softmax over those k scores; each expert is a small MLP, relu(x @ w1[e]) @ w2[e]; a token's
output is the weighted sum of its experts' outputs. The tokens are split by rows over the ranks
(each rank routes its own), and the experts are spread over the ranks in one of two ways:

- **expert parallel**: rank r holds whole experts, E_local of them. `EPBuffer.dispatch` sends each
  token to the ranks that hold its experts, the local experts run as grouped GEMMs, and
  `EPBuffer.combine` brings the outputs back to the token's rank, once in the normal mode
  (prefill, training: a token travels once per rank) and once in the low-latency mode (decode:
  once per (token, expert) pair, received grouped by expert);
- **tensor parallel**: every rank holds a slice of every expert, its columns of w1 and its rows
  of w2. `ag_moe` gathers every rank's tokens while it multiplies them by this rank's columns;
  after the activation `moe_rs` multiplies by this rank's rows, sums each token's top-k results
  with their weights and the partial sums over the ranks, handing each rank back its own tokens.

Each way is checked against the whole block computed in one process from the same seeded weights;
every rank prints its relative error for each, and the run exits non-zero if one is too large.
"""
import sys

import torch

import tridist
from tridist import ops

TOKENS = 4             # tokens per rank
HIDDEN = 64
INNER_PER_RANK = 16    # inner = 16 x world: the tensor-parallel slices (grouped GEMM: N a multiple of 8)
EXPERTS_PER_RANK = 2
TOPK = 2
DTYPE = torch.bfloat16
# The experts' outputs and their sums are rounded to bf16 (8 significant bits) on the way: errors
# relative to the largest value of the reference.
TOLERANCE = 3e-2


def make_block(world_size: int) -> dict:
    """The tokens of every rank and the whole layer's weights; every rank draws the same tensors from
    one seed, then keeps its part."""
    experts, inner = EXPERTS_PER_RANK * world_size, INNER_PER_RANK * world_size
    g = torch.Generator().manual_seed(0)
    return {
        "x": torch.randn(TOKENS * world_size, HIDDEN, generator=g).to(DTYPE),
        "gate": torch.randn(HIDDEN, experts, generator=g),
        "w1": (torch.randn(experts, HIDDEN, inner, generator=g) / HIDDEN ** 0.5).to(DTYPE),
        "w2": (torch.randn(experts, inner, HIDDEN, generator=g) / inner ** 0.5).to(DTYPE),
    }


def route(x: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's TOPK experts (int64) and their weights (float32, summing to 1), wherever x is: on
    the ranks' devices, the routing never goes through the host."""
    scores, topk_idx = (x.float() @ gate).topk(TOPK, dim=1)
    return topk_idx, scores.softmax(dim=1)


def reference(block: dict) -> torch.Tensor:
    """The whole block in float32 on the host: every expert on every token, weighted by the token's
    weight for that expert (0 where it was not chosen)."""
    x = block["x"].float()
    topk_idx, topk_weights = route(block["x"], block["gate"])
    y = torch.zeros_like(x)
    for e, (w1, w2) in enumerate(zip(block["w1"].float(), block["w2"].float())):
        share = (topk_weights * (topk_idx == e)).sum(dim=1, keepdim=True)
        y += share * (torch.relu(x @ w1) @ w2)
    return y


# ---- expert parallel -----------------------------------------------------------------------------
def local_experts(w, block):
    """This rank's whole experts: r * E_local ... (r + 1) * E_local - 1, as EPBuffer places them."""
    mine = slice(w.rank * EXPERTS_PER_RANK, (w.rank + 1) * EXPERTS_PER_RANK)
    return block["w1"][mine].contiguous().to(w.device), block["w2"][mine].contiguous().to(w.device)


def pair_experts(recv_x, recv_idx, recv_per_expert, w1, w2):
    """For every received token t and k < TOPK, relu(recv_x[t] @ w1[e]) @ w2[e] with e = recv_idx[t, k]
    (a row t * TOPK + k); zeros where e is -1 (an expert of another rank, or a row past those received).

    grouped_gemm wants its rows sorted by expert, with offs the cumulative row ends: a stable sort on
    the device groups the pairs (those with no expert last, past offs[-1], where the GEMMs neither
    compute nor write), and the outputs go back to the pairs' order. recv_per_expert (pairs per
    local expert) comes from the dispatch, so nothing is read back on the host."""
    pairs = recv_idx.reshape(-1)
    order = torch.argsort(torch.where(pairs >= 0, pairs, len(w1)), stable=True)
    offs = recv_per_expert.cumsum(0).to(torch.int32)
    h = ops.grouped_gemm(recv_x[order // TOPK], w1, offs)
    y = ops.grouped_gemm(torch.relu(h), w2, offs, out=recv_x.new_zeros(pairs.shape[0], HIDDEN))
    out = torch.empty_like(y)
    out[order] = y
    return out


def expert_parallel(buffer, w, block, x, topk_idx, topk_weights):
    """Normal mode: each token arrives once on every rank that holds one of its experts, with its
    expert ids made local (-1: another rank's) and its weights. The received (token, local expert)
    pairs run through the grouped GEMMs; each received token's output is the weighted sum of its
    pairs' (those with no expert here are zeros), which `combine` returns to the token's rank and
    adds up over the ranks."""
    w1, w2 = local_experts(w, block)
    recv_x, recv_idx, recv_weights, recv_per_expert, handle = buffer.dispatch(x, topk_idx, topk_weights)
    y = pair_experts(recv_x, recv_idx, recv_per_expert, w1, w2).float().view(-1, TOPK, HIDDEN)
    return buffer.combine((y * recv_weights[..., None]).sum(dim=1).to(DTYPE), handle)


def expert_parallel_low_latency(buffer, w, block, x, topk_idx, topk_weights):
    """Low-latency mode: recv_x[e] holds local expert e's pairs, packed from row 0, recv_count[e] of
    them, in a block of room for every rank's tokens. A single grouped GEMM needs its groups back to
    back; here they sit in blocks with padding between them, so each expert gets a call of its own,
    with one group whose end is its count (offs = recv_count[e:e+1]): only the pairs received are
    multiplied, nothing is copied, and the rows past the count, which `low_latency_combine` never
    reads, stay as they are. The combine applies the routing weights itself."""
    w1, w2 = local_experts(w, block)
    recv_x, recv_count, handle, _ = buffer.low_latency_dispatch(x, topk_idx)
    y = torch.empty_like(recv_x)
    for e in range(EXPERTS_PER_RANK):
        h = ops.grouped_gemm(recv_x[e], w1[e:e + 1], recv_count[e:e + 1])
        ops.grouped_gemm(torch.relu(h), w2[e:e + 1], recv_count[e:e + 1], out=y[e])
    return buffer.low_latency_combine(y, topk_idx, topk_weights, handle)


# ---- tensor parallel -----------------------------------------------------------------------------
def tensor_parallel(w, block, x, topk_idx, topk_weights):
    """Every expert split over the ranks: this rank's columns of w1 and rows of w2."""
    columns = slice(w.rank * INNER_PER_RANK, (w.rank + 1) * INNER_PER_RANK)
    w1 = block["w1"][:, :, columns].contiguous().to(w.device)
    w2 = block["w2"][:, columns].contiguous().to(w.device)
    h, handle = ops.ag_moe(x, topk_idx, w1)
    return ops.moe_rs(torch.relu(h), w2, handle, topk_weights)


WAYS = ("expert parallel", "expert parallel, low latency", "tensor parallel")


def moe_block(w, ways=WAYS) -> dict:
    """Runs the block each of `ways` (all of WAYS by default) on this rank's tokens; returns
    {way: relative error of this rank's output}."""
    block = make_block(w.world_size)
    rows = slice(w.rank * TOKENS, (w.rank + 1) * TOKENS)
    x = block["x"][rows].to(w.device)
    topk_idx, topk_weights = route(x, block["gate"].to(w.device))
    expected = reference(block)[rows]
    buffer = ops.EPBuffer(EXPERTS_PER_RANK * w.world_size, HIDDEN, TOKENS, DTYPE)  # staging: at a mode's first call
    args = (w, block, x, topk_idx, topk_weights)
    run = {"expert parallel": lambda: expert_parallel(buffer, *args),
           "expert parallel, low latency": lambda: expert_parallel_low_latency(buffer, *args),
           "tensor parallel": lambda: tensor_parallel(*args)}
    errors = {}
    for way in ways:
        y = run[way]()
        errors[way] = ((y.float().cpu() - expected).abs().max() / expected.abs().max()).item()
    buffer.free()
    return errors


def main():
    w = tridist.init()
    errors = moe_block(w)
    for way, error in errors.items():
        verdict = "ok" if error < TOLERANCE else f"WRONG (tolerance {TOLERANCE:.0e})"
        print(f"rank {w.rank} of {w.world_size}, MoE block of {TOKENS} tokens a rank, {way}: relative error "
              f"{error:.1e}, {verdict}")
    tridist.finalize()
    if max(errors.values()) >= TOLERANCE:
        sys.exit(1)


if __name__ == "__main__":
    main()
