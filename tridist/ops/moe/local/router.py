"""The router of a top-k MoE layer in one kernel (`moe_route`): from the router's logits, each
token's top-k experts and their weights, as transformers' Qwen3-MoE router computes them.

The unfused reference (transformers' `Qwen3MoeTopKRouter` after its linear layer):
`probs = softmax(logits, dim=-1, dtype=float32)`, `weights, idx = topk(probs, k)`, with
`norm_topk_prob` `weights /= weights.sum(-1, keepdim=True)`, then `weights.to(dtype)` (the
logits' dtype in transformers). The kernel returns those weights as float32 (what the MoE layers
take), holding the values of `dtype`.

`moe_route_kernel`: a program per BLOCK_T tokens holds their logits ([BLOCK_T, E_PAD], fp32) and
computes, row by row: the maximum, exp(logit - maximum) (libdevice's expf on GPUs, as torch's
softmax; the emulator's numpy exp), their sum, the probabilities (a division, as torch's); then k
times the largest probability left and its expert, the lowest id among equal probabilities, which
is then set aside (torch.topk leaves the order of equal values unsaid, and its CPU and GPU kernels
differ). The k weights come out in descending order, as torch.topk's; with NORM they are divided
by their sum, taken in that order; then rounded to DTYPE. Probabilities equal to the last bit and
sums taken in another order than torch's may round differently: the experts chosen are torch's
wherever no two probabilities tie, the weights equal to within a rounding of DTYPE.
"""
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from tridist.runtime.jit import jit

ROUTE_TOKENS = 16  # tokens a program routes: rows of E_PAD logits each, in registers


@jit
def moe_route_kernel(logits_ptr, idx_ptr, weights_ptr, tokens, E, TOPK: tl.constexpr, NORM: tl.constexpr,
                 DTYPE: tl.constexpr, PRECISE: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr,
                 BLOCK_T: tl.constexpr):
    """idx (int64 [T, TOPK]) and weights (float32 [T, TOPK]) of logits [T, E] (row-major).
    PRECISE: libdevice's exp (GPUs; the emulator has none)."""
    token = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    expert = tl.arange(0, E_PAD)
    inside = (token < tokens)[:, None] & (expert < E)[None, :]
    logits = tl.load(logits_ptr + token.to(tl.int64)[:, None] * E + expert[None, :], mask=inside,
                     other=-float("inf")).to(tl.float32)
    logits = tl.where((token < tokens)[:, None], logits, 0.0)  # rows past T: no -inf - -inf
    shifted = logits - tl.max(logits, 1)[:, None]
    if PRECISE:
        numerators = libdevice.exp(shifted)
    else:
        numerators = tl.exp(shifted)
    numerators = tl.where((expert < E)[None, :], numerators, 0.0)
    probs = numerators / tl.sum(numerators, 1)[:, None]
    probs = tl.where((expert < E)[None, :], probs, -1.0)  # never chosen: every probability is at least 0
    j = tl.arange(0, K_PAD)
    chosen = tl.zeros((BLOCK_T, K_PAD), dtype=tl.int32)
    values = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
    total = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for k in tl.static_range(TOPK):
        best = tl.max(probs, 1)
        pick = tl.min(tl.where(probs == best[:, None], expert[None, :], E_PAD), 1)
        chosen = tl.where(j[None, :] == k, pick[:, None], chosen)
        values = tl.where(j[None, :] == k, best[:, None], values)
        total += best
        probs = tl.where(expert[None, :] == pick[:, None], -1.0, probs)
    if NORM:
        values = values / total[:, None]
    out = token.to(tl.int64)[:, None] * TOPK + j[None, :]
    mask = (token < tokens)[:, None] & (j < TOPK)[None, :]
    tl.store(idx_ptr + out, chosen.to(tl.int64), mask=mask)
    tl.store(weights_ptr + out, values.to(DTYPE).to(tl.float32), mask=mask)


TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool, dtype: torch.dtype) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
    """(idx int64 [T, top_k], weights float32 [T, top_k]) of checked logits [T, E]: one launch."""
    tokens, experts = logits.shape
    idx = torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    if tokens:
        moe_route_kernel[(triton.cdiv(tokens, ROUTE_TOKENS),)](
            logits_ptr=logits, idx_ptr=idx, weights_ptr=weights, tokens=tokens, E=experts, TOPK=top_k,
            NORM=norm_topk_prob, DTYPE=TL_DTYPES[dtype], PRECISE=logits.device.type == "cuda",
            E_PAD=triton.next_power_of_2(experts), K_PAD=triton.next_power_of_2(top_k), BLOCK_T=ROUTE_TOKENS)
    return idx, weights
