"""The local MoE: a mixture-of-experts layer whose experts are all on this rank, with no exchange
(what `tridist.nn`'s MoE layers run at world size 1), and the router that feeds it.

- `moe_route(logits, top_k, norm_topk_prob)`: softmax, top-k and renormalisation in one kernel
  (`router`), as transformers' Qwen3-MoE router computes them.
- `moe_local(x, topk_idx, topk_weights, w_gate_up, w_down)`: every routed pair through its expert's
  SwiGLU MLP, weighted and summed per token (`experts`): a gate/up kernel with SiLU(gate) * up in
  its epilogue, then a down kernel whose epilogue weights each pair and sums each token's pairs.
  Decode batches (up to `policy.DENSE_TOKENS` tokens) take a tile per used expert over every token
  and need no sort; larger calls sort the pairs by expert on the device first. Nothing is read back
  on the host, the shapes of every launch follow from the arguments' shapes alone, and the output
  is the same bits every run: a CUDA graph captures a call.

Both are local ops: no process group, no collective, no symmetric memory.
"""
import torch
import torch.nn.functional as F

from ... import checks
from ...gemm import grouped
from . import experts, policy, router

DTYPES = (torch.bfloat16, torch.float16)


def moe_route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool = True,
              dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top-k experts and their weights, in one kernel.

    Args:
        logits: `[T, E]` router logits (bf16, fp16 or float32), contiguous.
        top_k: experts per token, 1 ... E.
        norm_topk_prob: divide the k weights by their sum (Qwen3-MoE's `norm_topk_prob`).
        dtype: the weights are rounded to it (transformers rounds them to the logits' dtype);
            the logits' dtype if None.

    Returns:
        `(topk_idx, topk_weights)`: int64 `[T, top_k]`, in descending order of probability, the
        lowest id first among equal ones; float32 `[T, top_k]`, holding values of `dtype`.
        transformers' ids wherever no two probabilities tie; its weights to within a rounding
        of `dtype` (`router` says where they can differ).

    Raises:
        ValueError: logits not a contiguous matrix of those dtypes on this rank's device; top_k
            outside 1 ... E; a dtype other than bf16, fp16, float32.
    """
    checks.check_input(logits, "logits", (*DTYPES, torch.float32))
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must be [tokens, experts] with at least one expert; got {tuple(logits.shape)}")
    if not isinstance(top_k, int) or not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"top_k must be an int in 1 ... {logits.shape[1]} (the experts); got {top_k!r}")
    dtype = logits.dtype if dtype is None else dtype
    if dtype not in router.TL_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(map(str, router.TL_DTYPES))}; got {dtype}")
    return router.route(logits, top_k, bool(norm_topk_prob), dtype)


def moe_local(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
              w_down: torch.Tensor, out: torch.Tensor | None = None,
              config: tuple[dict, dict] | None = None) -> torch.Tensor:
    """The experts of an MoE layer on this rank: for each token t,
    `y[t] = sum_j topk_weights[t, j] * (silu(x[t] @ W_gate[e]) * (x[t] @ W_up[e])) @ W_down[e]`
    over its pairs j whose id e = topk_idx[t, j] is an expert, in fp32, in j order, each pair's
    term rounded to x's dtype first (h too: `moe_local_reference`).

    Args:
        x: `[T, hidden]`, bf16 or fp16, contiguous.
        topk_idx: int64 `[T, k]`: expert ids; one outside 0 ... E-1 (-1: none) names no expert
            (checked to be in -1 ... E-1 where the host may read it: `checks.host_reads`).
        topk_weights: float32 `[T, k]`.
        w_gate_up: `[E, hidden, 2I]` of x's dtype: each expert's W_gate columns, then its W_up's.
        w_down: `[E, I, hidden]` of x's dtype.
        out: `[T, hidden]` of x's dtype; new if None.
        config: (the gate/up kernel's, the down kernel's) tile dicts, as `policy.configs` gives
            them; None for those.

    Returns:
        `out`: each token's sum rounded once to x's dtype; zeros for a token with no expert.

    hidden and I must be multiples of 8 (TMA reads the weights' rows). The result is the same
    bits on every run with the same inputs (`experts`: each token's sum in j order, whichever
    pair finishes last).

    Raises:
        ValueError: shapes, dtypes, layouts or devices it does not take; ids out of range (where
            read).
    """
    for name, tensor in (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        checks.check_input(tensor, name, {"x": DTYPES, "topk_idx": (torch.int64,),
                                          "topk_weights": (torch.float32,)}[name])
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, hidden]; got shape {tuple(x.shape)}")
    tokens, hidden = x.shape
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        grouped.check_weights(w, name, (x.dtype,))
    experts_n, inner = w_down.shape[:2]
    if tuple(w_gate_up.shape) != (experts_n, hidden, 2 * inner) or w_down.shape[2] != hidden:
        raise ValueError(f"w_gate_up must be [E, hidden, 2I] and w_down [E, I, hidden] with x's hidden {hidden}: got "
                         f"{tuple(w_gate_up.shape)} and {tuple(w_down.shape)}")
    if topk_idx.dim() != 2 or topk_idx.shape[0] != tokens or topk_idx.shape[1] == 0 \
            or tuple(topk_weights.shape) != tuple(topk_idx.shape):
        raise ValueError(f"topk_idx and topk_weights must both be [{tokens}, k] (k >= 1); got "
                         f"{tuple(topk_idx.shape)} and {tuple(topk_weights.shape)}")
    if out is None:
        out = torch.empty_like(x)
    checks.check_output(out, (tokens, hidden), x.dtype)
    if checks.host_reads(topk_idx) and topk_idx.numel():
        low, high = topk_idx.min().item(), topk_idx.max().item()
        if low < -1 or high >= experts_n:
            raise ValueError(f"topk_idx must hold expert ids in -1 ... {experts_n - 1} (-1: none); got {low} ... "
                             f"{high}")
    if tokens == 0:
        return out
    if config is None:
        config = policy.configs(x.device, tokens, topk_idx.shape[1], experts_n, inner, hidden)
    experts.launch(x, topk_idx, topk_weights, w_gate_up, w_down, out, config)
    return out


def moe_local_reference(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
                        w_down: torch.Tensor) -> torch.Tensor:
    """`moe_local`'s meaning in float32 with torch (h and each pair's weighted term rounded to x's
    dtype, as the kernels keep them): the reference its tests and benchmark check against."""
    tokens, hidden = x.shape
    experts_n, inner = w_down.shape[:2]
    y = torch.zeros(tokens, hidden, dtype=torch.float32, device=x.device)
    for j in range(topk_idx.shape[1]):
        for e in topk_idx[:, j].unique().tolist():
            if not 0 <= e < experts_n:
                continue
            rows = topk_idx[:, j] == e
            gate, up = (x[rows].float() @ w_gate_up[e].float()).split(inner, dim=-1)
            h = (F.silu(gate) * up).to(x.dtype).float()
            y[rows] += (topk_weights[rows, j, None] * (h @ w_down[e].float())).to(x.dtype).float()
    return y


__all__ = ["moe_route", "moe_local", "moe_local_reference"]
