"""tridist's decoder layer: what `parallelize` puts in place of each of a transformers model's
decoder layers (Llama, Qwen3, Qwen3-MoE), its forward our own, around transformers' model, caches,
masks and `generate`.

A layer, tensor-parallel over the ranks (of the world or a group; at world size 1, one GPU):

    h, residual = all_reduce_rms_norm(x, residual, input_norm)   # the previous layer's sum, fused
    q, k, v = rotary_qkv(qkv(h))                                 # one GEMM; norms, rotary, cache write
    a = o_proj(attention(q, cache))                              # this rank's heads; a partial sum
    h, residual = all_reduce_rms_norm(a, residual, post_norm)
    x = mlp(h)                                                   # gate_up with SiLU * up, down: a partial sum

The residual stream passes from layer to layer as a `ResidualStream` (the last output, not yet
added, and the residual), so that the sum over the ranks, the residual add and the next norm are
one kernel (`ops.all_reduce_rms_norm`), as vLLM's layers pass (hidden, residual). transformers'
model loop hands each layer's output to the next unchanged; `FinalNorm`, in place of the model's
final norm, ends the stream. An MoE block's output is already summed and replicated
(`ParallelSparseMoeBlock`): the stream says so, and the next norm adds it without an exchange.

A decode step (one new token per sequence) over transformers' static cache runs its attention in
tridist's kernels alone: `rotary_qkv` writes k and v into the cache at the cache layer's own write
position (its device counter `cumulative_length`, which `DecodeStep` advances once for all layers
at the step's end, as the layers' `update` would have), and `decode_attention` reads the cache in
place with the step's mask; no host read, so the step captures in one CUDA graph. Other steps
(prefill, dynamic caches) use the cache's own `update` and, for several tokens, transformers' SDPA
attention.
"""
from typing import NamedTuple

import torch
from torch import nn

from tridist import ops

from .linear import ColumnParallelLinear, RowParallelLinear
from .moe import ParallelSparseMoeBlock

HEAD_DIMS = (64, 128)  # the head sizes decode_attention takes; others decode through SDPA
MAX_GROUP = 32  # and the most query heads per KV head


class ResidualStream(NamedTuple):
    """What one decoder layer hands the next: `x`, its last block's output, not yet added to the
    `residual`; `summed`: x is the same on every rank (an MoE block's output), or False: each rank
    holds its partial product, summed over the ranks by the next norm."""
    x: torch.Tensor
    residual: torch.Tensor
    summed: bool


class RMSNorm(nn.Module):
    """The norm that ends a residual stream's step: `forward(x, residual, summed)` is
    `ops.all_reduce_rms_norm` (x a partial sum over the ranks of `group`) or `ops.add_rms_norm` (x
    summed already, or no residual yet), on `[..., hidden]` rows. Returns (y, new residual)."""

    def __init__(self, weight: torch.Tensor, eps: float, group=None):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.eps, self.group = eps, group

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, summed: bool):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        residual = None if residual is None else residual.reshape(-1, shape[-1])
        if summed or residual is None:
            y, residual = ops.add_rms_norm(x, residual, self.weight, self.eps)
        else:
            y, residual = ops.all_reduce_rms_norm(x, residual, self.weight, self.eps, group=self.group)
        return y.view(shape), residual.view(shape)

    def extra_repr(self) -> str:
        """The size, in the module's printout."""
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class DecodeStep:
    """What the layers of one model share within a step: the attention's positions, worked out
    once from the step's mask, and the static cache layers whose write position the step's fused
    cache writes will have moved (`advance`), moved at its end (`finish`) by one kernel for all."""

    def __init__(self):
        self._mask, self._length, self._positions = None, None, None
        self._ends = None  # 1 ... length, each position's end, kept across steps
        self._advanced: list[torch.Tensor] = []

    def positions(self, mask: torch.Tensor | None, batch: int, length: int, device: torch.device):
        """(seqlens int32 [B], mask bool [B, length] or None) of a one-token step over `length`
        cached positions: transformers' boolean mask ([B, 1, 1, n], True where attended; None:
        every position) as decode_attention takes it, and each sequence's last attended position
        + 1, so that nothing past it is read. Worked out at the first layer of the step (the
        layers get the same mask object)."""
        if mask is not self._mask or length != self._length or self._positions is None:
            if mask is None:
                seqlens = torch.full((batch,), length, dtype=torch.int32, device=device)
                allowed = None
            else:
                allowed = mask[:, 0, -1, :length]
                if self._ends is None or self._ends.shape[0] != length or self._ends.device != device:
                    self._ends = torch.arange(1, length + 1, dtype=torch.int32, device=device)
                seqlens = torch.where(allowed, self._ends, 0).amax(dim=-1).to(torch.int32)
            self._mask, self._length, self._positions = mask, length, (seqlens, allowed)
        return self._positions

    def advance(self, counter: torch.Tensor) -> None:
        """A static cache layer's write position (`cumulative_length`), to move by one at the step's end."""
        self._advanced.append(counter)

    def finish(self) -> None:
        """Move every advanced write position by one (the step's one token), in one kernel."""
        if self._advanced:
            torch._foreach_add_(self._advanced, 1)
            self._advanced = []
        self._mask, self._positions = None, None


def _static_layer(cache, layer_idx: int):
    """transformers' static cache layer `layer_idx` of `cache` once it holds its tensors, or None (no
    cache, a dynamic or sliding one, or one not yet filled, whose `update` allocates it)."""
    layers = getattr(cache, "layers", None)
    if layers is None or layer_idx >= len(layers):
        return None
    layer = layers[layer_idx]
    if type(layer).__name__ != "StaticLayer" or not getattr(layer, "is_initialized", False):
        return None
    return layer


class ParallelAttention(nn.Module):
    """Self-attention with the heads split over the ranks: this rank's query heads and the KV heads
    they read (GQA groups stay whole), q, k and v as one column-parallel GEMM, the output
    projection row-parallel, its sum left to the next norm.

    Args:
        qkv: this rank's q, k and v heads (`ColumnParallelLinear.from_linears`, parts q, k, v).
        o_proj: this rank's columns of the output projection (`sum_output=False`).
        num_heads: this rank's query heads.
        num_kv_heads: this rank's KV heads.
        head_dim: of every head.
        layer_idx: the layer's index in transformers' cache.
        scaling: of the scores.
        step: the model's `DecodeStep`.
        q_norm: RMSNorm weight `[head_dim]` of q's heads (Qwen3), or None (Llama).
        k_norm: the same of k's heads.
        norm_eps: their epsilon.
    """

    is_causal = True  # read by transformers' SDPA attention, which a prefill runs

    def __init__(self, qkv: ColumnParallelLinear, o_proj: RowParallelLinear, num_heads: int, num_kv_heads: int,
                 head_dim: int, layer_idx: int, scaling: float, step: DecodeStep,
                 q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, norm_eps: float = 1e-6):
        super().__init__()
        self.qkv, self.o_proj = qkv, o_proj
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.num_key_value_groups = num_heads // num_kv_heads  # read by transformers' SDPA attention
        self.layer_idx, self.scaling, self.step, self.norm_eps = layer_idx, scaling, step, norm_eps
        self.q_norm = None if q_norm is None else nn.Parameter(q_norm.detach().clone(), requires_grad=False)
        self.k_norm = None if k_norm is None else nn.Parameter(k_norm.detach().clone(), requires_grad=False)
        self.decodes = head_dim in HEAD_DIMS and self.num_key_value_groups <= MAX_GROUP

    def forward(self, x: torch.Tensor, position_embeddings, attention_mask, cache) -> torch.Tensor:
        """x `[B, S, hidden]` (replicated); returns this rank's partial `[B, S, hidden]` of the
        attention block's output."""
        batch, tokens, _ = x.shape
        cos, sin = position_embeddings
        norms = dict(q_norm=self.q_norm, k_norm=self.k_norm, eps=self.norm_eps)
        layer = _static_layer(cache, self.layer_idx) if tokens == 1 and self.decodes else None
        if layer is not None:
            q, _, _ = ops.rotary_qkv(self.qkv(x), cos, sin, self.num_heads, self.num_kv_heads,
                                     cache=(layer.keys, layer.values, layer.cumulative_length), **norms)
            self.step.advance(layer.cumulative_length)
            keys, values = layer.keys, layer.values
        else:
            q, keys, values = ops.rotary_qkv(self.qkv(x), cos, sin, self.num_heads, self.num_kv_heads, **norms)
            if cache is not None:
                keys, values = cache.update(keys, values, self.layer_idx)
        if tokens == 1 and self.decodes:
            seqlens, mask = self.step.positions(attention_mask, batch, keys.shape[2], x.device)
            out = ops.decode_attention(q.view(batch, self.num_heads, self.head_dim), keys.transpose(1, 2),
                                       values.transpose(1, 2), seqlens, sm_scale=self.scaling, mask=mask)
        else:
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            out, _ = sdpa_attention_forward(self, q, keys, values, attention_mask, dropout=0.0, scaling=self.scaling)
        return self.o_proj(out.reshape(batch, tokens, self.num_heads * self.head_dim))

    def extra_repr(self) -> str:
        """The sizes, in the module's printout."""
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads} (on this rank), head_dim="
                f"{self.head_dim}, qk_norm={self.q_norm is not None}")


class ParallelGatedMLP(nn.Module):
    """`down(SiLU(gate(x)) * up(x))` split over the ranks by the inner dimension: gate and up one
    column-parallel GEMM with SiLU * up in its epilogue, down row-parallel, its sum left to the next
    norm."""

    summed = False  # the output is this rank's partial product

    def __init__(self, gate_up: ColumnParallelLinear, down: RowParallelLinear):
        super().__init__()
        self.gate_up, self.down = gate_up, down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[..., hidden]` (replicated); returns this rank's partial `[..., hidden]` of the MLP's
        output (its sum left to the next norm)."""
        return self.down(self.gate_up(x))


class ParallelDecoderLayer(nn.Module):
    """One decoder layer (the module docstring's): `input_norm`, `self_attn`
    (`ParallelAttention`), `post_attention_norm`, `mlp` (`ParallelGatedMLP` or
    `ParallelSparseMoeBlock`). Called by transformers' model loop as its own layers are (keyword
    arguments of transformers 5: the cache as `cache` or `past_key_values`); takes the previous
    layer's `ResidualStream` (the first layer: the embeddings) and returns its own."""

    def __init__(self, input_norm: RMSNorm, self_attn: ParallelAttention, post_attention_norm: RMSNorm,
                 mlp: ParallelGatedMLP | ParallelSparseMoeBlock):
        super().__init__()
        self.input_norm, self.self_attn, self.post_attention_norm, self.mlp = (input_norm, self_attn,
                                                                              post_attention_norm, mlp)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, cache=None,
                past_key_values=None, **kwargs) -> ResidualStream:
        """transformers' decoder-layer call: `hidden_states` the previous layer's `ResidualStream`
        (or, at the first layer, the embeddings), the cache as `cache` or `past_key_values` (the
        keyword of transformers' version). Returns this layer's `ResidualStream`."""
        if isinstance(hidden_states, ResidualStream):
            h, residual = self.input_norm(*hidden_states)
        else:
            h, residual = self.input_norm(hidden_states, None, True)
        cache = cache if cache is not None else past_key_values
        a = self.self_attn(h, position_embeddings, attention_mask, cache)
        h, residual = self.post_attention_norm(a, residual, False)
        return ResidualStream(self.mlp(h), residual, isinstance(self.mlp, ParallelSparseMoeBlock))


class FinalNorm(nn.Module):
    """The model's final norm, ending the residual stream (`norm`: an `RMSNorm`), and the step
    (`DecodeStep.finish`): returns the normed hidden states, `[..., hidden]`, the same on every rank."""

    def __init__(self, norm: RMSNorm, step: DecodeStep):
        super().__init__()
        self.norm, self.step = norm, step

    def forward(self, stream) -> torch.Tensor:
        if isinstance(stream, ResidualStream):
            y, _ = self.norm(*stream)
        else:
            y, _ = self.norm(stream, None, True)
        self.step.finish()
        return y
