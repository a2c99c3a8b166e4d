"""tridist's ops as PyTorch custom ops, `torch.ops.tridist.<name>`, so that torch.compile can trace
through them: each one calls the op's function, and its fake (what torch.compile runs on tensors
without data) gives the shapes of what it returns.

They run on the world: a custom op's schema has no type for a process group. Within a group, call the
functions of `tridist.ops` with `group=`.
"""
import torch

import tridist

from .attention import decode_attention, rotary_qkv
from .collectives import all_gather, all_reduce, all_reduce_, reduce_scatter
from .gemm import ag_gemm, gemm_ar, gemm_rs, linear, persistent
from .moe import ag_moe, all_to_all_v, all_to_all_v_2d, all_to_all_v_2d_offset, moe_local, moe_route, moe_rs
from .moe.tensor_parallel.routing import MoEHandle
from .norm import add_rms_norm, all_reduce_rms_norm


def _custom_op(name: str, fake, mutates_args=()):
    """Register the decorated function as `torch.ops.tridist.<name>`, with `fake` (the same
    signature) giving the shapes of its results."""
    def register(function):
        op = torch.library.custom_op(f"tridist::{name}", mutates_args=mutates_args)(function)
        op.register_fake(fake)
        return op
    return register


def _world_size() -> int:
    return tridist.world().world_size


# ---- collectives ----------------------------------------------------------------------------------
def _gathered(x: torch.Tensor, method: str = "auto") -> torch.Tensor:
    n = _world_size()
    return x.new_empty((n * x.shape[0], *x.shape[1:]) if x.dim() else (n,))


@_custom_op("all_gather", _gathered)
def all_gather_op(x: torch.Tensor, method: str = "auto") -> torch.Tensor:
    return all_gather(x, method=method)


def _scattered(x: torch.Tensor, method: str = "auto") -> torch.Tensor:
    return x.new_empty((x.shape[0] // _world_size(), *x.shape[1:]))


@_custom_op("reduce_scatter", _scattered)
def reduce_scatter_op(x: torch.Tensor, method: str = "auto") -> torch.Tensor:
    return reduce_scatter(x, method=method)


def _like_x(x: torch.Tensor, method: str = "auto") -> torch.Tensor:
    return torch.empty_like(x)


@_custom_op("all_reduce", _like_x)
def all_reduce_op(x: torch.Tensor, method: str = "auto") -> torch.Tensor:
    """Out of place."""
    return all_reduce(x, method=method)


def _nothing(x: torch.Tensor, method: str = "auto") -> None:
    return None


@_custom_op("all_reduce_", _nothing, mutates_args=("x",))
def all_reduce_in_place_op(x: torch.Tensor, method: str = "auto") -> None:
    """In place: torch.compile knows it mutates `x`."""
    all_reduce_(x, method=method)


# ---- overlapped GEMMs -----------------------------------------------------------------------------
def _ag_gemm_out(a_shard: torch.Tensor, b: torch.Tensor, comm: str = "auto", scale_a: torch.Tensor | None = None,
                 scale_b: torch.Tensor | None = None) -> torch.Tensor:
    return a_shard.new_empty((_world_size() * a_shard.shape[0], b.shape[1]), dtype=persistent.out_dtype(a_shard.dtype))


@_custom_op("ag_gemm", _ag_gemm_out)
def ag_gemm_op(a_shard: torch.Tensor, b: torch.Tensor, comm: str = "auto", scale_a: torch.Tensor | None = None,
               scale_b: torch.Tensor | None = None) -> torch.Tensor:
    return ag_gemm(a_shard, b, comm=comm, scale_a=scale_a, scale_b=scale_b)


def _gemm_rs_out(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor | None = None,
                 scale_b: torch.Tensor | None = None) -> torch.Tensor:
    return a.new_empty((a.shape[0] // _world_size(), b.shape[1]), dtype=persistent.out_dtype(a.dtype))


@_custom_op("gemm_rs", _gemm_rs_out)
def gemm_rs_op(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor | None = None,
               scale_b: torch.Tensor | None = None) -> torch.Tensor:
    return gemm_rs(a, b, scale_a=scale_a, scale_b=scale_b)


def _gemm_ar_out(a: torch.Tensor, b: torch.Tensor, method: str = "auto", scale_a: torch.Tensor | None = None,
                 scale_b: torch.Tensor | None = None) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[1]), dtype=persistent.out_dtype(a.dtype))


@_custom_op("gemm_ar", _gemm_ar_out)
def gemm_ar_op(a: torch.Tensor, b: torch.Tensor, method: str = "auto", scale_a: torch.Tensor | None = None,
               scale_b: torch.Tensor | None = None) -> torch.Tensor:
    return gemm_ar(a, b, method=method, scale_a=scale_a, scale_b=scale_b)


# ---- MoE: the all-to-alls return a new `out` of `out_rows` rows and its splits and offsets --------
def _rows(x: torch.Tensor, out_rows: int) -> torch.Tensor:
    return x.new_empty((out_rows, *x.shape[1:]))


def _all_to_all_v_out(x: torch.Tensor, in_splits: torch.Tensor, out_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _rows(x, out_rows), in_splits.new_empty((2, _world_size()))


@_custom_op("all_to_all_v", _all_to_all_v_out)
def all_to_all_v_op(x: torch.Tensor, in_splits: torch.Tensor, out_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    out = _rows(x, out_rows)
    return out, all_to_all_v(x, in_splits, out)


def _all_to_all_v_2d_out(x: torch.Tensor, in_splits: torch.Tensor, out_rows: int,
                         major_align: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return _rows(x, out_rows), in_splits.new_empty((2, in_splits.shape[0]))


@_custom_op("all_to_all_v_2d", _all_to_all_v_2d_out)
def all_to_all_v_2d_op(x: torch.Tensor, in_splits: torch.Tensor, out_rows: int,
                       major_align: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    out = _rows(x, out_rows)
    return out, all_to_all_v_2d(x, in_splits, out, major_align)


def _all_to_all_v_2d_offset_out(x: torch.Tensor, in_splits_offsets: torch.Tensor,
                                out_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _rows(x, out_rows), in_splits_offsets.new_empty(tuple(in_splits_offsets.shape))


@_custom_op("all_to_all_v_2d_offset", _all_to_all_v_2d_offset_out)
def all_to_all_v_2d_offset_op(x: torch.Tensor, in_splits_offsets: torch.Tensor,
                              out_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    out = _rows(x, out_rows)
    return out, all_to_all_v_2d_offset(x, in_splits_offsets, out)


# ---- MoE, tensor parallel: ag_moe returns h and its handle's `layout`, which moe_rs takes ---------
def _ag_moe_out(x_shard: torch.Tensor, topk_idx_shard: torch.Tensor, w_shard: torch.Tensor,
                comm: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    world_size = _world_size()
    (tokens, topk), (experts, _, n) = topk_idx_shard.shape, w_shard.shape
    return (x_shard.new_empty((world_size * tokens * topk, n)),
            x_shard.new_empty((MoEHandle.numel(world_size, tokens, topk, experts),), dtype=torch.int32))


@_custom_op("ag_moe", _ag_moe_out)
def ag_moe_op(x_shard: torch.Tensor, topk_idx_shard: torch.Tensor, w_shard: torch.Tensor,
              comm: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    h, handle = ag_moe(x_shard, topk_idx_shard, w_shard, comm=comm)
    return h, handle.layout


def _moe_rs_out(h: torch.Tensor, w_shard: torch.Tensor, layout: torch.Tensor,
                topk_weights_shard: torch.Tensor) -> torch.Tensor:
    return h.new_empty((topk_weights_shard.shape[0], w_shard.shape[2]))


@_custom_op("moe_rs", _moe_rs_out)
def moe_rs_op(h: torch.Tensor, w_shard: torch.Tensor, layout: torch.Tensor,
              topk_weights_shard: torch.Tensor) -> torch.Tensor:
    (tokens, topk), experts = topk_weights_shard.shape, w_shard.shape[0]
    return moe_rs(h, w_shard, MoEHandle(layout, _world_size(), tokens, topk, experts), topk_weights_shard)


# ---- MoE, local: the router's (topk_idx, topk_weights), the experts' y (on this rank alone) -------
def _routed(logits: torch.Tensor, top_k: int, norm_topk_prob: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (logits.shape[0], top_k)
    return logits.new_empty(shape, dtype=torch.int64), logits.new_empty(shape, dtype=torch.float32)


@_custom_op("moe_route", _routed)
def moe_route_op(logits: torch.Tensor, top_k: int, norm_topk_prob: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights rounded to the logits' dtype."""
    return moe_route(logits, top_k, norm_topk_prob)


def _local_out(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
               w_down: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@_custom_op("moe_local", _local_out)
def moe_local_op(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
                 w_down: torch.Tensor) -> torch.Tensor:
    return moe_local(x, topk_idx, topk_weights, w_gate_up, w_down)


# ---- the decoder layer's norm: (y, new_residual), new tensors both ---------------------------------
def _normed(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
            eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


@_custom_op("all_reduce_rms_norm", _normed)
def all_reduce_rms_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    return all_reduce_rms_norm(x, residual, weight, eps)


@_custom_op("add_rms_norm", _normed)
def add_rms_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """With a residual only: a custom op returns no input as it is (the function's `residual=None`)."""
    return add_rms_norm(x, residual, weight, eps)


# ---- the decoder layer's local ops: the decode GEMM, rotary (with the cache write in place), attention
def _linear_out(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                activation: str | None = None) -> torch.Tensor:
    columns = weight.shape[0] // 2 if activation == "swiglu" else weight.shape[0]
    return x.new_empty((*x.shape[:-1], columns))


@_custom_op("linear", _linear_out)
def linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              activation: str | None = None) -> torch.Tensor:
    return linear(x, weight, bias, activation=activation)


def _rotated(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
             q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
             eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, seq_len, columns = qkv.shape
    head_dim = columns // (num_heads + 2 * num_kv_heads)
    q = qkv.new_empty((batch, seq_len, num_heads, head_dim)).transpose(1, 2)  # rotary_qkv's layout
    return q, *(qkv.new_empty((batch, num_kv_heads, seq_len, head_dim)) for _ in range(2))


@_custom_op("rotary_qkv", _rotated)
def rotary_qkv_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                  q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                  eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return rotary_qkv(qkv, cos, sin, num_heads, num_kv_heads, q_norm=q_norm, k_norm=k_norm, eps=eps)


def _rotated_into_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, index: torch.Tensor,
                        q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                        eps: float = 1e-6) -> torch.Tensor:
    return _rotated(qkv, cos, sin, num_heads, num_kv_heads)[0]


@_custom_op("rotary_qkv_cache", _rotated_into_cache, mutates_args=("k_cache", "v_cache"))
def rotary_qkv_cache_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, index: torch.Tensor,
                        q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                        eps: float = 1e-6) -> torch.Tensor:
    """k and v written into the caches at `index` (torch.compile knows they change); returns q."""
    q, _, _ = rotary_qkv(qkv, cos, sin, num_heads, num_kv_heads, q_norm=q_norm, k_norm=k_norm, eps=eps,
                         cache=(k_cache, v_cache, index))
    return q


def _attended(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqlens: torch.Tensor,
              block_table: torch.Tensor | None = None, sm_scale: float | None = None,
              mask: torch.Tensor | None = None) -> torch.Tensor:
    return torch.empty_like(q)


@_custom_op("decode_attention", _attended)
def decode_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqlens: torch.Tensor,
                        block_table: torch.Tensor | None = None, sm_scale: float | None = None,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
    return decode_attention(q, k_cache, v_cache, seqlens, block_table, sm_scale, mask)
