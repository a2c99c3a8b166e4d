"""`tridist.ops.rotary_qkv` against transformers' arithmetic on random data: the split of one fused
projection into heads, Qwen3's per-head RMSNorm of q and k (or none, as Llama), the rotary embedding
(transformers' `apply_rotary_pos_emb`), and the static-cache write at a position read on the device;
bf16 and fp16, head sizes 16 and 64, cos and sin per sequence or broadcast; outputs and caches
poisoned first (v and every cache position not written: exact); bad input refused before any
launch. A local op: world 1 only."""
import pytest
import torch

from tridist import ops
from tridist.bench.results import relative_error

transformers = pytest.importorskip("transformers")

# q and k: each step rounded to the dtype as transformers rounds it (the norm's two, the rotary's
# two products and their sum); the emulator's interpreter truncates fp32 to bf16 where GPUs round to
# nearest (docs/guide/emulator.md), up to an ulp of each intermediate: in bf16 a few ulps of the
# largest value (2.5e-2 of it at D = 16 with the norms, in the emulator).
TOLERANCE = {torch.bfloat16: 2 ** -5, torch.float16: 2 ** -9}
POISON = -7.0


def _inputs(batch, seq, heads, kv_heads, head_dim, dtype, broadcast, seed):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(batch, seq, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    angles = torch.rand(1 if broadcast else batch, seq, head_dim // 2, generator=g) * 6.0
    angles = torch.cat([angles, angles], dim=-1)
    norms = [(1.0 + 0.1 * torch.randn(head_dim, generator=g)).to(dtype) for _ in range(2)]
    return qkv, angles.cos().to(dtype), angles.sin().to(dtype), norms


def _reference(qkv, cos, sin, heads, kv_heads, norms, eps):
    """transformers' Qwen3 attention before its cache update (Llama's without `norms`)."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    batch, seq, _ = qkv.shape
    head_dim = qkv.shape[-1] // (heads + 2 * kv_heads)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.reshape(batch, seq, -1, head_dim) for t in (q, k, v))
    if norms is not None:
        for i, weight in enumerate(norms):
            norm = Qwen3RMSNorm(head_dim, eps).to(qkv.dtype)
            norm.weight.data.copy_(weight)
            q, k = (norm(q), k) if i == 0 else (q, norm(k))
    q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos.expand(batch, -1, -1),
                                sin.expand(batch, -1, -1))
    return q, k, v.transpose(1, 2)


# (dtype, D, norms, cos broadcast, tokens a sequence): 2 x 37 tokens are a prefill's tiles, the last
# one partly past the tokens (`rotary.tile`)
CASES = [(torch.bfloat16, 64, True, False, 5), (torch.float16, 64, False, True, 5), (torch.bfloat16, 16, True, True, 5),
         (torch.bfloat16, 64, True, False, 37), (torch.float16, 16, False, True, 37)]


def _rotary(w):
    batch, heads, kv_heads, start, eps = 2, 4, 2, 6, 1e-6
    for seed, (dtype, head_dim, norm, broadcast, seq) in enumerate(CASES):
        capacity = start + seq + 1
        qkv, cos, sin, norms = _inputs(batch, seq, heads, kv_heads, head_dim, dtype, broadcast, seed)
        want_q, want_k, want_v = _reference(qkv, cos, sin, heads, kv_heads, norms if norm else None, eps)
        on = [t.to(w.device) for t in (qkv, cos, sin)]
        norm_args = dict(q_norm=norms[0].to(w.device), k_norm=norms[1].to(w.device)) if norm else {}
        what = f"{dtype}, D={head_dim}, norm={norm}, broadcast cos={broadcast}, {seq} tokens"

        q, k, v = ops.rotary_qkv(*on, heads, kv_heads, eps=eps, **norm_args)
        for name, got, want in (("q", q, want_q), ("k", k, want_k)):
            assert got.shape == want.shape, f"{what}: {name} {tuple(got.shape)}"
            error = relative_error(got.cpu(), want)
            assert error <= TOLERANCE[dtype], f"{what}: {name} off by {error:.2e}"
        assert torch.equal(v.cpu(), want_v), f"{what}: v is not the input's v heads"
        assert q.transpose(1, 2).is_contiguous(), f"{what}: q's memory is not [B, S, heads, D]"

        caches = [torch.full((batch, kv_heads, capacity, head_dim), POISON, dtype=dtype, device=w.device)
                  for _ in range(2)]
        index = torch.tensor([start], device=w.device)
        q_cached, none_k, none_v = ops.rotary_qkv(*on, heads, kv_heads, eps=eps, cache=(*caches, index), **norm_args)
        assert none_k is None and none_v is None
        assert torch.equal(q_cached, q), f"{what}: q differs with a cache"
        written = slice(start, start + seq)
        assert torch.equal(caches[0][:, :, written], k), f"{what}: the cache's k"
        assert torch.equal(caches[1][:, :, written].cpu(), want_v), f"{what}: the cache's v"
        for cache in caches:
            assert (cache[:, :, :start] == POISON).all() and (cache[:, :, start + seq:] == POISON).all(), \
                f"{what}: a position outside {start} ... {start + seq - 1} was written"


@pytest.mark.worlds("1")
def test_rotary_qkv(world):
    world.run(_rotary)


def _bad_input(w):
    qkv = torch.zeros(1, 2, 4 * 64, dtype=torch.bfloat16, device=w.device)
    cos = sin = torch.zeros(1, 2, 64, dtype=torch.bfloat16, device=w.device)
    weight = torch.ones(64, dtype=torch.bfloat16, device=w.device)
    with pytest.raises(ValueError, match="qkv must be"):
        ops.rotary_qkv(qkv, cos, sin, 3, 1)  # 5 heads do not divide 256 columns
    with pytest.raises(ValueError, match="cos must be"):
        ops.rotary_qkv(qkv, cos[..., :32], sin, 2, 1)
    with pytest.raises(ValueError, match="q_norm and k_norm both"):
        ops.rotary_qkv(qkv, cos, sin, 2, 1, q_norm=weight)
    with pytest.raises(ValueError, match="k_cache must be"):
        cache = torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16, device=w.device)  # 2 KV heads, not 1
        ops.rotary_qkv(qkv, cos, sin, 2, 1, cache=(cache, cache, torch.zeros(1, dtype=torch.int64, device=w.device)))


@pytest.mark.worlds("1")
def test_rotary_qkv_bad_input(world):
    world.run(_bad_input)


def _custom_ops(w):
    """`torch.ops.tridist.rotary_qkv` and `rotary_qkv_cache` under torch.compile (AOT's
    functionalization, which must see the caches change): the function's bits."""
    qkv, cos, sin, norms = _inputs(2, 5, 4, 2, 64, torch.bfloat16, False, 9)
    qkv, cos, sin, *norms = (t.to(w.device) for t in (qkv, cos, sin, *norms))
    want_q, want_k, want_v = ops.rotary_qkv(qkv, cos, sin, 4, 2, q_norm=norms[0], k_norm=norms[1])

    def returned(qkv):
        return torch.ops.tridist.rotary_qkv(qkv, cos, sin, 4, 2, norms[0], norms[1], 1e-6)

    def cached(qkv, k_cache, v_cache, index):
        return torch.ops.tridist.rotary_qkv_cache(qkv, cos, sin, 4, 2, k_cache, v_cache, index, norms[0], norms[1], 1e-6)

    got = torch.compile(returned, backend="aot_eager", fullgraph=True)(qkv)
    assert all(torch.equal(g, e) for g, e in zip(got, (want_q, want_k, want_v)))
    caches = [torch.full((2, 2, 8, 64), POISON, dtype=torch.bfloat16, device=w.device) for _ in range(2)]
    q = torch.compile(cached, backend="aot_eager", fullgraph=True)(qkv, *caches, torch.tensor([1], device=w.device))
    assert torch.equal(q, want_q) and torch.equal(caches[0][:, :, 1:6], want_k) and torch.equal(caches[1][:, :, 1:6], want_v)
    assert (caches[0][:, :, 6:] == POISON).all() and (caches[0][:, :, :1] == POISON).all()


@pytest.mark.worlds("1")
def test_rotary_qkv_custom_ops_under_torch_compile(world):
    world.run(_custom_ops)
