"""`rotary_qkv`: what happens to one GEMM's fused q, k and v projections before attention, in one
kernel: the split into heads, the per-head RMSNorm of q and k (Qwen3's `q_norm`/`k_norm`), the
rotary position embedding of q and k, and, for a decode step over a static cache, the write of k
and v into the cache at the cache's own write position.

The unfused reference, as transformers' Llama and Qwen3 attention computes it (every step rounded
to the dtype, as there):

    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], -1), each viewed [B, S, heads, D]
    q, k = q_norm(q), k_norm(k)                     # if given: RMSNorm over D (fp32 variance)
    q, k = q * cos + rotate_half(q) * sin, ...       # cos, sin [B, S, D]; rotate_half(x) = [-x2, x1]
    cache.update(k, v)                              # or returned

Program (i, j) takes head j of BLOCK_T tokens: j < Hq a query head, then the key heads, then the
value heads, so that a decode step (few tokens, one a program, dozens of heads) still spreads over
many programs, and a prefill's programs each move enough bytes to pay for their start (`tile`). Positions: token s of sequence b is written at `index + s` of sequence b's cache, `index`
read on the device (transformers' static cache layer counts its positions in a device tensor,
`cumulative_length`, which the caller advances after the step), so a step needs no host value and
captures in a CUDA graph.
"""
import torch
import triton
import triton.language as tl

from tridist.runtime.jit import jit

from ..checks import check_input

DTYPES = (torch.bfloat16, torch.float16)
DECODE_TOKENS = 64
"""Up to this many tokens (a decode batch) a program takes one token's head, in one warp (64
elements a half at D = 128, two a thread); past it, PREFILL_BLOCK_T tokens' in PREFILL_WARPS warps:
a prefill's programs of one token's head each moved too few bytes to pay for their start
(benchmarks/NOTES.md, "The MoE model's prefill")."""
PREFILL_BLOCK_T = 16
PREFILL_WARPS = 4


def tile(tokens: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_T, num_warps) of a call of `tokens` tokens of heads of `head_dim`."""
    if tokens <= DECODE_TOKENS:
        return 1, 1
    return PREFILL_BLOCK_T, max(1, min(PREFILL_WARPS, PREFILL_BLOCK_T * head_dim // 512))


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """x rounded to `dtype` and back to fp32: a 16-bit tensor op's result, as torch rounds it."""
    return x.to(dtype).to(tl.float32)


@jit
def rotary_qkv_kernel(qkv_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, q_ptr, k_ptr, v_ptr, index_ptr, eps, tokens,
                      seq_len, qkv_row, cos_batch, cos_token, q_batch, q_head, q_token, kv_batch, kv_head, kv_token,
                      q_heads, kv_heads, D: tl.constexpr, NORM: tl.constexpr, CACHE: tl.constexpr,
                      BLOCK_T: tl.constexpr):
    """Program (i, j) for tokens t = i * BLOCK_T ... (t = b * seq_len + s, below `tokens`) and head j
    of the fused rows qkv[t] ([Hq + 2 Hkv] heads of D, rows `qkv_row` apart). cos and sin of (b, s)
    at b * cos_batch + s * cos_token. A head h of q is written at b * q_batch + h * q_head + s *
    q_token, of k and v likewise with the kv strides at position s, or index + s with CACHE (k and v
    are then the caches)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.program_id(1)
    inside = (t < tokens)[:, None]
    b = (t // seq_len).to(tl.int64)[:, None]
    s = (t % seq_len)[:, None]
    dtype = q_ptr.dtype.element_ty
    half = tl.arange(0, D // 2)[None, :]
    row = qkv_ptr + t.to(tl.int64)[:, None] * qkv_row + j * D
    x1 = tl.load(row + half, mask=inside).to(tl.float32)
    x2 = tl.load(row + D // 2 + half, mask=inside).to(tl.float32)
    position = s
    if CACHE:
        position += tl.load(index_ptr)
    if j < q_heads + kv_heads:
        if NORM:
            weight = tl.where(j < q_heads, q_norm_ptr, k_norm_ptr)
            scale = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / D + eps)[:, None]
            x1 = _rounded(tl.load(weight + half).to(tl.float32) * _rounded(x1 * scale, dtype), dtype)
            x2 = _rounded(tl.load(weight + D // 2 + half).to(tl.float32) * _rounded(x2 * scale, dtype), dtype)
        angles = b * cos_batch + s * cos_token
        cos1 = tl.load(cos_ptr + angles + half, mask=inside).to(tl.float32)
        cos2 = tl.load(cos_ptr + angles + D // 2 + half, mask=inside).to(tl.float32)
        sin1 = tl.load(sin_ptr + angles + half, mask=inside).to(tl.float32)
        sin2 = tl.load(sin_ptr + angles + D // 2 + half, mask=inside).to(tl.float32)
        # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]: each product rounded, then the sum
        y1 = _rounded(x1 * cos1, dtype) + _rounded(-x2 * sin1, dtype)
        y2 = _rounded(x2 * cos2, dtype) + _rounded(x1 * sin2, dtype)
        if j < q_heads:
            out = q_ptr + b * q_batch + j * q_head + s * q_token
        else:
            out = k_ptr + b * kv_batch + (j - q_heads) * kv_head + position * kv_token
        tl.store(out + half, y1.to(dtype), mask=inside)
        tl.store(out + D // 2 + half, y2.to(dtype), mask=inside)
    else:
        out = v_ptr + b * kv_batch + (j - q_heads - kv_heads) * kv_head + position * kv_token
        tl.store(out + half, x1.to(dtype), mask=inside)
        tl.store(out + D // 2 + half, x2.to(dtype), mask=inside)


def rotary_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int, *,
               q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 1e-6,
               cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Split fused q, k, v projections into heads, RMSNorm q and k per head (if `q_norm` and
    `k_norm` are given), rotate q and k by the rotary embedding, and write k and v into `cache` or
    return them (the reference: the module docstring). Local: no ranks, no collective.

    Args:
        qkv: `[B, S, (num_heads + 2 * num_kv_heads) * D]`, contiguous, bf16 or fp16: the q
            projection's columns, then k's, then v's (one GEMM's output).
        cos: `[B, S, D]` (transformers' `position_embeddings`), or a shape that broadcasts to it
            (`[1, S, D]`), the last dimension contiguous, any float dtype.
        sin: cos's shape and dtype.
        num_heads: query heads in qkv.
        num_kv_heads: key/value heads in qkv.
        q_norm: `[D]` RMSNorm weight of q's heads, with k_norm or neither, qkv's dtype.
        k_norm: `[D]` RMSNorm weight of k's heads.
        eps: the norms' epsilon.
        cache: `(k_cache, v_cache, index)`: caches `[B, num_kv_heads, L, D]` with contiguous rows
            (transformers' static cache layer's `keys` and `values`) and a one-element integer
            tensor on the device, the position at which sequence b's first token goes (the layer's
            `cumulative_length`); token s then goes to position `index + s`, which must be below L
            (not checked: it lives on the device).

    Returns:
        `(q, k, v)`: q `[B, num_heads, S, D]`, a view of `[B, S, num_heads, D]` memory (its
        transpose(1, 2) is contiguous); k and v `[B, num_kv_heads, S, D]`, or
        None where they went into `cache` (the layout transformers' attention takes).

    Raises:
        ValueError: shapes, dtypes or devices that do not fit, an odd D, norms given for one of q
            and k only, a cache of other heads, batch or head size.
    """
    def check():
        check_input(qkv, "qkv", DTYPES)
        if qkv.dim() != 3 or num_heads < 1 or num_kv_heads < 1 or qkv.shape[-1] % (num_heads + 2 * num_kv_heads):
            raise ValueError(f"qkv must be [B, S, (num_heads + 2 * num_kv_heads) * D] with num_heads {num_heads} and "
                             f"num_kv_heads {num_kv_heads}; got shape {tuple(qkv.shape)}")
        head_dim = qkv.shape[-1] // (num_heads + 2 * num_kv_heads)
        if head_dim % 2 or head_dim & (head_dim - 1):
            raise ValueError(f"rotary_qkv takes a head size that is a power of two, got {head_dim}")
        angles = []
        for name, t in (("cos", cos), ("sin", sin)):
            shape = (*qkv.shape[:2], head_dim)
            try:
                t = t.expand(shape)
            except (AttributeError, RuntimeError):
                t = None
            if t is None or t.stride(-1) != 1 or t.device != qkv.device or not t.is_floating_point():
                raise ValueError(f"{name} must be a float tensor of [B, S, D] = {shape} (or one that broadcasts to it) "
                                 f"on {qkv.device}, its last dimension contiguous; got {getattr(t, 'shape', t)}")
            angles.append(t)
        if angles[0].stride() != angles[1].stride():
            raise ValueError(f"cos and sin must have one layout, got strides {cos.stride()} and {sin.stride()}")
        if (q_norm is None) != (k_norm is None):
            raise ValueError("give q_norm and k_norm both, or neither")
        for name, weight in (("q_norm", q_norm), ("k_norm", k_norm)):
            if weight is not None and (weight.shape != (head_dim,) or weight.dtype != qkv.dtype
                                       or weight.device != qkv.device or not weight.is_contiguous()):
                raise ValueError(f"{name} must be [{head_dim}] in {qkv.dtype} on {qkv.device}, got "
                                 f"{weight.dtype} of shape {tuple(weight.shape)}")
        if cache is not None:
            k_cache, v_cache, index = cache
            want = (qkv.shape[0], num_kv_heads, head_dim)
            for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
                if t.dim() != 4 or (t.shape[0], t.shape[1], t.shape[3]) != want or t.dtype != qkv.dtype \
                        or t.device != qkv.device or t.stride(-1) != 1 or t.stride() != k_cache.stride():
                    raise ValueError(f"{name} must be [B, num_kv_heads, L, D] = [{want[0]}, {want[1]}, L, {want[2]}] "
                                     f"in {qkv.dtype}, rows contiguous, laid out as k_cache; got {t.dtype} of shape "
                                     f"{tuple(t.shape)}, strides {t.stride()}")
            if index.numel() != 1 or index.dtype not in (torch.int32, torch.int64) or index.device != qkv.device:
                raise ValueError(f"the cache's index must be one int32 or int64 element on {qkv.device}, got "
                                 f"{index.dtype} of shape {tuple(index.shape)} on {index.device}")
        return head_dim, *angles

    head_dim, cos, sin = check()
    batch, seq_len, _ = qkv.shape
    # q's memory is [B, S, heads, D]: an attention that lays its output out as its query (cuDNN's)
    # then gives the rows the output projection reads, with no copy between
    q = qkv.new_empty(batch, seq_len, num_heads, head_dim).transpose(1, 2)
    if cache is None:
        k, v = (qkv.new_empty(batch, num_kv_heads, seq_len, head_dim) for _ in range(2))
        index = None
        k_out, v_out = k, v
    else:
        k_out, v_out, index = cache
        k = v = None
    if q.numel():
        tokens = batch * seq_len
        block_t, warps = tile(tokens, head_dim)
        rotary_qkv_kernel[(triton.cdiv(tokens, block_t), num_heads + 2 * num_kv_heads)](
            qkv, cos, sin, q_norm if q_norm is not None else qkv, k_norm if k_norm is not None else qkv, q, k_out,
            v_out, index if index is not None else qkv, eps, tokens, seq_len, qkv.stride(1), *cos.stride()[:2], *q.stride()[:3],
            *k_out.stride()[:3], num_heads, num_kv_heads, D=head_dim, NORM=q_norm is not None, CACHE=cache is not None,
            BLOCK_T=block_t, num_warps=warps)
    return q, k, v
