"""Mixture-of-experts layers: gated MLP experts, `act(x @ W_gate[e]) * (x @ W_up[e]) @ W_down[e]`,
each token's output the sum of its top-k experts' outputs weighted by its routing weights.

Both layers take this rank's tokens with their routing (computed by the caller's router) and
return this rank's tokens' outputs; they run over the ranks of the world or, with `group=`, of a
process group ("world size" and "rank" below are then the group's). Every rank passes the same
number of tokens (pad with rows
routed nowhere: `padding_expert`, weight 0), which also picks the kernels, so every rank runs the
same ones.

- `ExpertParallelMoE` holds whole experts: `E / world_size` of them per rank (rank r experts
  r * E_local ... (r + 1) * E_local - 1). Up to `LOW_LATENCY_TOKENS` tokens a rank (decode) it
  runs `EPBuffer`'s low-latency dispatch and combine (a token once per expert, received grouped by
  expert); more (prefill), the normal mode (a token once per rank). The local experts run as
  grouped GEMMs (`ops.grouped_gemm`). Neither mode reads anything back on the host.
- `TensorParallelMoE` holds a slice of every expert: its columns of W_gate and W_up and its rows
  of W_down. `ops.ag_moe` gathers every rank's tokens behind the grouped up-projection, and
  `ops.moe_rs` sums each token's top-k and the ranks' partial products back to the token's rank.

At world size 1 (of the layer's group) both hold every expert whole and run the local MoE,
`ops.moe_local`, with no exchange and no symmetric memory: two kernels, SiLU(gate) * up fused into
the first, the weighting and each token's top-k sum into the second; an activation other than
SiLU runs the experts unfused (`unfused_experts`).
"""
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import tridist
from tridist import ops
from tridist.ops import checks
from tridist.ops.ranks import ranks_of

from .linear import split

# Tokens per rank up to which `ExpertParallelMoE` runs the low-latency dispatch and combine: the
# decode batches (the low-latency staging holds every expert's share of them, E x tokens rows).
LOW_LATENCY_TOKENS = 128
MODES = ("normal", "low_latency")

# The EPBuffers of each layer shape (mode, experts, hidden size, dtype, group), shared by every
# ExpertParallelMoE of that shape: a model's layers run one after another, and a buffer per layer
# would multiply the symmetric staging by the layers (48 layers of Qwen3-30B-A3B's at 8192 tokens a
# rank would not fit the default heap). {shape: (tokens a rank it has room for, buffer)}.
_shared: dict[tuple, tuple[int, ops.EPBuffer]] = {}


def shared_buffer(mode: str, num_experts: int, hidden: int, dtype: torch.dtype, tokens: int,
                  group=None) -> ops.EPBuffer:
    """The EPBuffer the layers of this shape share in `mode` over the ranks of `group` (a
    `tridist.Group`, None for the world), with room for `tokens` tokens a rank. When it has less,
    a collective of those ranks replaces it with one of room for the next power of two (each
    mode's staging allocated at its first call), after the calls in flight on each of them are done."""
    key = (mode, num_experts, hidden, dtype, group)
    room, buffer = _shared.get(key, (0, None))
    if room < tokens:
        if buffer is not None:
            tridist.barrier_all(group)  # a peer's kernel may still be writing into it
            buffer.free()
        room = 1 << (tokens - 1).bit_length()
        buffer = ops.EPBuffer(num_experts, hidden, room, dtype, group=group)
        _shared[key] = (room, buffer)
    return buffer


def free_buffers() -> None:
    """Give back every shared EPBuffer this rank holds (a collective of the ranks of each buffer's
    group, after the calls in flight on them are done); a layer's next call allocates anew."""
    for (*_, group), (_, buffer) in _shared.items():  # in the order they were made: the same on every member
        tridist.barrier_all(group)  # a peer's kernel may still be writing into it
        buffer.free()
    _shared.clear()


def gated(h: torch.Tensor, activation: Callable) -> torch.Tensor:
    """act(gate) * up for h = [gate columns | up columns]."""
    gate, up = h.chunk(2, dim=-1)
    return activation(gate) * up


def computes_silu(activation: Callable, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `activation` is SiLU (`F.silu`, `nn.SiLU`, transformers' `SiLUActivation`), which
    `ops.moe_local` fuses, judged by its values on a probe of `dtype` on `device`."""
    probe = torch.linspace(-8, 8, 33, device=device).to(dtype)
    return torch.equal(activation(probe), F.silu(probe))


def unfused_experts(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
                    w_down: torch.Tensor, activation: Callable) -> torch.Tensor:
    """Each token's pairs through their experts as grouped GEMMs on the pairs sorted by expert
    (on the device), then weighted and summed in fp32: x `[T, hidden]`, topk_idx `[T, k]` (ids
    outside 0 ... E-1 name none), topk_weights float32 `[T, k]`; returns `[T, hidden]`."""
    experts, top_k = w_down.shape[0], topk_idx.shape[1]
    pairs = topk_idx.reshape(-1)
    real = (pairs >= 0) & (pairs < experts)
    order = torch.argsort(torch.where(real, pairs, experts), stable=True)
    offs = (pairs[:, None] == torch.arange(experts, device=x.device)).sum(0).cumsum(0).to(torch.int32)
    h = ops.grouped_gemm(x[order // top_k], w_gate_up, offs)
    y = torch.empty(pairs.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    # rows of no expert: zeros (grouped_gemm leaves the rows past the last expert's as they are)
    y[order] = ops.grouped_gemm(gated(h, activation), w_down, offs, out=torch.zeros_like(y))
    weights = torch.where(real.view_as(topk_weights), topk_weights, 0.0)
    return (y.view(-1, top_k, x.shape[1]).float() * weights[..., None]).sum(dim=1).to(x.dtype)


def local_forward(layer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """A layer's forward at world size 1, where it holds every expert whole: `ops.moe_local`, or
    `unfused_experts` for an activation other than SiLU."""
    if layer.fused:
        return ops.moe_local(x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous(), layer.w_gate_up,
                             layer.w_down)
    return unfused_experts(x, topk_idx, topk_weights, layer.w_gate_up, layer.w_down, layer.activation)


class ExpertParallelMoE(nn.Module):
    """Whole experts on each rank, tokens sent to their experts' ranks and back (`EPBuffer`).

    Args:
        num_experts: experts of the layer; a multiple of the world size.
        hidden_size: a token's size (even).
        intermediate_size: an expert's inner size (I).
        max_tokens_per_rank: the most tokens a rank passes to one call; `reserve` raises it. The
            symmetric buffers are shared by the layers of one shape (`shared_buffer`):
            `free_buffers()` gives them back. At world size 1 there are none (`local_forward`).
        activation: of the gate, SiLU by default (SwiGLU experts).
        group: a `torch.distributed.ProcessGroup` or `tridist.Group` whose members hold the
            layer's experts (they build and call it together; the other ranks take no part),
            None for the world.
        dtype: bf16 or fp16.
        device: the world's device by default.

    Attributes:
        w_gate_up: `[E_local, hidden_size, 2 * I]`, this rank's experts' W_gate columns, then W_up's.
        w_down: `[E_local, I, hidden_size]`.
        padding_expert: the expert id (-1: none) of a padding token.
        fused: the activation is SiLU, which the local kernels fuse (`local_forward`, world size 1).

    Raises:
        ValueError: experts not a multiple of the world size; sizes EPBuffer does not take; a
            `group` this rank is not a member of.
    """

    padding_expert = -1

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, max_tokens_per_rank: int, *,
                 activation: Callable = F.silu, group=None, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | None = None):
        super().__init__()
        ranks = ranks_of(group)
        self.world_size, self.rank, self.group = ranks.world_size, ranks.rank, ranks.group
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.local_experts = split(num_experts, ranks.world_size, "num_experts")
        self.activation, self.dtype = activation, dtype
        device = ranks.device if device is None else device
        self.w_gate_up = nn.Parameter(torch.empty(self.local_experts, hidden_size, 2 * intermediate_size, dtype=dtype,
                                                  device=device), requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(self.local_experts, intermediate_size, hidden_size, dtype=dtype,
                                               device=device), requires_grad=False)
        self.fused = computes_silu(activation, dtype, device)
        self.max_tokens_per_rank = 0
        self.reserve(max_tokens_per_rank)

    def load(self, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> None:
        """Take this rank's experts from the whole layer's weights, the same on every rank:
        w_gate_up `[E, hidden_size, 2 * I]` (W_gate's columns, then W_up's), w_down `[E, I, hidden_size]`."""
        mine = slice(self.rank * self.local_experts, (self.rank + 1) * self.local_experts)
        with torch.no_grad():
            self.w_gate_up.copy_(w_gate_up[mine])
            self.w_down.copy_(w_down[mine])

    def reserve(self, max_tokens_per_rank: int) -> None:
        """Make room for calls of up to `max_tokens_per_rank` tokens a rank: a collective that may
        grow the shared buffers (see `shared_buffer`), outside any CUDA-graph capture."""
        self.max_tokens_per_rank = max(self.max_tokens_per_rank, max_tokens_per_rank)
        if self.world_size > 1:
            for mode in MODES:
                self._buffer(mode)

    def _buffer(self, mode: str) -> ops.EPBuffer:
        tokens = self.max_tokens_per_rank if mode == "normal" else min(self.max_tokens_per_rank, LOW_LATENCY_TOKENS)
        return shared_buffer(mode, self.num_experts, self.hidden_size, self.dtype, tokens, self.group)

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x `[T, hidden_size]`, this rank's tokens (the same T on every rank, at most
        max_tokens_per_rank); topk_idx int64 `[T, k]` (-1: none); topk_weights float32 `[T, k]`.
        Returns `[T, hidden_size]`: each token's experts' outputs, weighted and summed in fp32."""
        if x.shape[0] > self.max_tokens_per_rank:
            raise ValueError(f"{x.shape[0]} tokens on rank {self.rank}, past max_tokens_per_rank "
                             f"{self.max_tokens_per_rank}: call reserve() first, on every rank")
        if self.world_size == 1:
            return local_forward(self, x, topk_idx, topk_weights)
        if x.shape[0] <= LOW_LATENCY_TOKENS:
            # The low-latency mode sizes its pairs by T: a rank with more tokens than its peers would
            # lose pairs, and one with none would leave them waiting.
            checks.agree("ExpertParallelMoE", None, {"tokens a rank (T, the same on every rank)": x.shape[0]},
                         group=self.group)
        if x.shape[0] == 0:
            return x.new_empty(0, self.hidden_size)
        if x.shape[0] <= LOW_LATENCY_TOKENS:
            return self._low_latency(x, topk_idx, topk_weights)
        return self._normal(x, topk_idx, topk_weights)

    def extra_repr(self) -> str:
        """The sizes, in the module's printout."""
        return (f"num_experts={self.num_experts} ({self.local_experts} on this rank), hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, max_tokens_per_rank={self.max_tokens_per_rank}")

    def _experts(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """Rows of x grouped by local expert (offs: cumulative ends, int32) through their experts;
        rows from offs[-1] on come out as zeros."""
        h = ops.grouped_gemm(x, self.w_gate_up, offs)
        return ops.grouped_gemm(gated(h, self.activation), self.w_down, offs,
                                out=x.new_zeros(x.shape[0], self.hidden_size))

    def _normal(self, x, topk_idx, topk_weights) -> torch.Tensor:
        """Each token once on every rank holding one of its experts; the received (token, local
        expert) pairs sorted by expert on the device for the grouped GEMMs, then back."""
        buffer = self._buffer("normal")
        recv_x, recv_idx, recv_weights, _, handle = buffer.dispatch(x, topk_idx, topk_weights)
        # recv_idx holds local expert ids, -1 past the pairs received (whose weights are unspecified)
        return buffer.combine(unfused_experts(recv_x, recv_idx, recv_weights, self.w_gate_up, self.w_down,
                                              self.activation), handle)

    def _low_latency(self, x, topk_idx, topk_weights) -> torch.Tensor:
        """Each (token, expert) pair received in expert e's block of recv_x, packed from its start,
        recv_count[e] of them. The blocks' pairs are packed back to back for one grouped GEMM per
        projection and put back in their blocks, by indices computed on the device: static shapes,
        for the decode step's CUDA graph."""
        buffer = self._buffer("low_latency")
        recv_x, recv_count, handle, _ = buffer.low_latency_dispatch(x, topk_idx)
        experts, block, _ = recv_x.shape
        slots = experts * block
        # At most a pair per (token, local expert) of each rank's T tokens (the same T on every rank):
        # k pairs a token, or fewer local experts. Sized by this call's T, not by the buffer's room, so
        # that a decode step's gathers, zeros and GEMM grids are as small as its tokens.
        packed = min(slots, self.world_size * x.shape[0] * min(topk_idx.shape[1], experts))
        offs = recv_count.cumsum(0).to(torch.int32)
        position = torch.arange(packed, device=x.device, dtype=torch.int32)
        expert = torch.searchsorted(offs, position, right=True)
        starts = torch.cat([offs.new_zeros(1), offs])  # expert e's first packed position; offs[-1] for e = E_local
        slot = expert * block + (position - starts[expert])
        # Positions past the pairs read any row (the GEMMs skip them) and write a spare row, never read.
        source = recv_x.reshape(slots, -1)[slot.clamp(max=slots - 1)]
        slot = torch.where(expert < experts, slot, slots)
        y = torch.empty(slots + 1, self.hidden_size, dtype=x.dtype, device=x.device)
        y.index_copy_(0, slot, self._experts(source, offs))
        return buffer.low_latency_combine(y[:slots].view(experts, block, -1), topk_idx, topk_weights, handle)


class TensorParallelMoE(nn.Module):
    """Every expert split over the ranks (`ops.ag_moe`, `ops.moe_rs`): rank r holds columns
    r * I_local ... (r + 1) * I_local - 1 of every expert's W_gate and W_up and those rows of W_down.

    Args:
        num_experts: experts of the layer.
        hidden_size: a token's size; a multiple of 8.
        intermediate_size: an expert's inner size (I); I / world_size a multiple of 8.
        activation: of the gate, SiLU by default (SwiGLU experts).
        group: a `torch.distributed.ProcessGroup` or `tridist.Group` whose members hold the
            layer's experts (they build and call it together; the other ranks take no part),
            None for the world.
        dtype: bf16 or fp16.
        device: the world's device by default.

    Attributes:
        w_gate_up: `[E, hidden_size, 2 * I_local]`: this rank's W_gate columns, then W_up's.
        w_down: `[E, I_local, hidden_size]`.
        padding_expert: the expert id of a padding token (its weight 0): ag_moe routes every row.
        fused: the activation is SiLU, which the local kernels fuse (`local_forward`, world size 1).

    Raises:
        ValueError: I not a multiple of the world size; a `group` this rank is not a member of.
    """

    padding_expert = 0

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, activation: Callable = F.silu,
                 group=None, dtype: torch.dtype = torch.bfloat16, device: torch.device | None = None):
        super().__init__()
        ranks = ranks_of(group)
        self.world_size, self.rank, self.group = ranks.world_size, ranks.rank, ranks.group
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.intermediate_local = split(intermediate_size, ranks.world_size, "intermediate_size")
        self.activation = activation
        device = ranks.device if device is None else device
        self.w_gate_up = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * self.intermediate_local, dtype=dtype,
                                                  device=device), requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(num_experts, self.intermediate_local, hidden_size, dtype=dtype,
                                               device=device), requires_grad=False)
        self.fused = computes_silu(activation, dtype, device)

    def load(self, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> None:
        """Take this rank's slice of the whole layer's weights, the same on every rank: w_gate_up
        `[E, hidden_size, 2 * I]` (W_gate's columns, then W_up's), w_down `[E, I, hidden_size]`."""
        inner, local = self.intermediate_size, self.intermediate_local
        mine = slice(self.rank * local, (self.rank + 1) * local)
        with torch.no_grad():
            self.w_gate_up[..., :local].copy_(w_gate_up[..., :inner][..., mine])
            self.w_gate_up[..., local:].copy_(w_gate_up[..., inner:][..., mine])
            self.w_down.copy_(w_down[:, mine])

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x `[T, hidden_size]`, this rank's tokens (the same T on every rank); topk_idx int64
        `[T, k]` in [0, E); topk_weights float32 `[T, k]`. Returns `[T, hidden_size]`."""
        if self.world_size == 1:
            return local_forward(self, x, topk_idx, topk_weights)
        if x.shape[0] == 0:
            return x.new_empty(0, self.hidden_size)
        h, handle = ops.ag_moe(x.contiguous(), topk_idx, self.w_gate_up, group=self.group)
        return ops.moe_rs(gated(h, self.activation).contiguous(), self.w_down, handle, topk_weights, group=self.group)

    def extra_repr(self) -> str:
        """The sizes, in the module's printout."""
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, intermediate_size="
                f"{self.intermediate_size} ({self.intermediate_local} on this rank)")


class ParallelSparseMoeBlock(nn.Module):
    """A transformers sparse MoE block (router + experts) over replicated activations: the router
    whole on every rank, the experts in `moe_layer`. Each rank routes and runs its share of the
    tokens (the tokens padded to a multiple of the world size, the padding routed nowhere), and
    the outputs are all-gathered; at world size 1, every token on the one rank, nothing gathered.

    Args:
        router_weight: `[E, hidden_size]`, the router's linear weight.
        top_k: experts per token.
        norm_topk_prob: renormalise the top-k probabilities to sum to 1.
        moe_layer: an `ExpertParallelMoE` or `TensorParallelMoE` holding this rank's experts.
    """

    def __init__(self, router_weight: torch.Tensor, top_k: int, norm_topk_prob: bool,
                 moe_layer: ExpertParallelMoE | TensorParallelMoE):
        super().__init__()
        self.router_weight = nn.Parameter(router_weight.detach().clone(), requires_grad=False)
        self.top_k, self.norm_topk_prob, self.moe_layer = top_k, norm_topk_prob, moe_layer

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts and their weights, as transformers' Qwen3-MoE router computes
        them (softmax in fp32, weights rounded to x's dtype), the weights as float32: the router's
        linear layer, then `ops.moe_route` (one kernel)."""
        return ops.moe_route(F.linear(x, self.router_weight), self.top_k, self.norm_topk_prob)

    def extra_repr(self) -> str:
        """The routing, in the module's printout."""
        return f"experts={self.router_weight.shape[0]}, top_k={self.top_k}, norm_topk_prob={self.norm_topk_prob}"

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states `[..., hidden_size]`, the same on every rank; returns the block's output,
        the same on every rank."""
        layer = self.moe_layer
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        tokens = x.shape[0]
        if tokens == 0:
            return hidden_states.clone()
        if layer.world_size == 1:  # every token here: no padding, nothing to gather
            if isinstance(layer, ExpertParallelMoE):
                layer.reserve(tokens)
            return layer(x.contiguous(), *self.route(x)).view(hidden_states.shape)
        share = -(-tokens // layer.world_size)
        first = layer.rank * share
        mine = F.pad(x[first:first + share], (0, 0, 0, share - max(0, min(share, tokens - first))))
        experts, weights = self.route(mine)
        padding = (torch.arange(share, device=x.device) + first >= tokens)[:, None]
        experts = experts.masked_fill(padding, layer.padding_expert)
        weights = weights.masked_fill(padding, 0.0)
        if isinstance(layer, ExpertParallelMoE):
            layer.reserve(share)
        y = self.gather(layer(mine.contiguous(), experts, weights).contiguous())
        return y[:tokens].view(hidden_states.shape)

    def gather(self, y: torch.Tensor) -> torch.Tensor:
        """Every rank's share of the outputs, in rank order (`ops.all_gather` over the layer's group)."""
        return ops.all_gather(y, group=self.moe_layer.group)
