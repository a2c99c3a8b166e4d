"""`tridist bench model`: whole decoder steps of a transformers model sharded by `tridist.nn`, each
against what its hardware allows (its bound) and against other ways to run the same model in the
same run: on one GPU (`-n 1`) transformers' own model and `torch.compile` of it, on several the same
model tensor- and expert-parallel on torch + NCCL.

Models (random weights from a fixed seed, built in bf16; nothing is downloaded), the real dimensions
with `--layers` of their decoder layers (8 by default; `all`: the model's own count; the result
records how many of how many):
- dense: Qwen3-8B (hidden 4096, MLP 12288, 32 query heads over 8 KV heads of 128, vocabulary 151936,
  36 layers);
- llama: Llama-3-8B (hidden 4096, MLP 14336, 32 query heads over 8 KV heads of 128, vocabulary
  128256, 32 layers, rope theta 500000, untied embeddings);
- moe: Qwen3-30B-A3B (hidden 2048, 32 query heads over 4 KV heads of 128, 128 experts of 768, top-8,
  vocabulary 151936, 48 layers).

Systems (`--systems`), each a fresh copy of the model from the same seed. At world size 1:
- `tridist`: `tridist.nn.parallelize(model, moe=...)` (`--moe ep,tp` for both MoE modes);
- `hf`: transformers' model as built, unsharded;
- `compile`: transformers' model with its forward compiled as transformers documents for
  generation over a static cache, `model.forward = torch.compile(model.forward, mode=...,
  fullgraph=True)` (`dynamic=False`: one compile per mode and batch), decode steps only (transformers
  runs the prefill uncompiled: the `hf` rows). Each of `--compile-modes` is compiled and timed at each
  of `--compile-decode`'s batches, and the row gives the faster, saying which, with every mode's time
  and its seconds to compile (the first calls, on the GPU); where `fullgraph=True` fails, the mode is
  compiled again without it and the row says so. Modes without CUDA graphs of their own run inside
  the bench's graph as every other system does; `reduce-overhead` and `max-autotune` replay their own
  (cudagraph trees), called eagerly.
At world size 2 or more:
- `tridist` as above;
- `megatron`: the same shards with torch's GEMMs and NCCL: an all-reduce after each row-parallel
  layer, an all-gather of the vocabulary-parallel logits and of the MoE blocks' token shares, and
  for the experts the pairs sorted by expert, the counts exchanged and read on the host, NCCL
  `all_to_all_single` there and back, `torch._grouped_mm` for the local experts;
- `hf_tp`: transformers' own tensor parallelism (`tp_plan="auto"`: DTensor over NCCL), loaded from
  a checkpoint of the same weights saved to a temporary folder; where transformers refuses or
  fails, the row says why.

Checks come first: every system's logits against the whole model's (a prefill of 2 x 16 tokens and
two decode steps with a `DynamicCache`; `compile` skips these, which would compile other shapes),
then each decode step's logits against the whole model's same step, every system's `compile`
included, within `TOLERANCE` of the largest logit; at world size 1 a decode step that fails says
where it first departs, decoder layer by layer (`recorded_layers`: each layer's attention output and
output against the whole model's). tridist's MoE blocks (and the megatron baseline's) are checked
with the whole model's routing replayed, their own routers held to it on the whole model's inputs
(`replayed_routing`: a random model's routers tie often, and a tie broken the other way is another
model, not an error); transformers' own blocks, compiled or not, route by themselves. A check that fails is a row saying so (`failed`), its step (or,
for the logits, its system) untimed; the run goes on with the others, saves them, and exits with 1.
Then, timed:
- prefill of `--prefill` tokens (one sequence; the last position's logits), eagerly;
- a decode step at each `--decode` batch over a `StaticCache` of `CONTEXT` positions, in a CUDA
  graph of GRAPH_STEPS steps, or eagerly where the row says why (the megatron MoE step reads its
  splits on the host; a capture that fails). What one step does (`decode_step`): one small kernel
  sets every cache layer's write position to CONTEXT - 1 (transformers' `StaticLayer` writes an
  update at its `cumulative_length`, a device counter each update advances, not at
  `cache_position`), then the model runs `batch` tokens at position CONTEXT - 1: every step writes
  position CONTEXT - 1 and attends over all CONTEXT positions, replay after replay, in every system
  (position 0 holds the KV of the eager call that allocated the cache, the rest zeros).
`us per layer` is the step's time over the decoder layers run (embedding and logits included).

Bounds, against rates measured in the same run, before any model is built:
- the copy rate: a device-to-device copy of `timing.COPY_BYTES`, bytes read plus written
  (`timing.copy_rate`); the GEMM rate: cuBLAS's bf16 8192^3 `torch.matmul` (`timing.gemm_rate`);
- a decode row's `bound us`: the bytes the rank must read (`decode_bytes`: every weight it holds
  once, the embedding only for the step's rows, and the KV it attends; in an MoE layer only the
  experts the step's routing touches, found by transformers' model on the same step) over the copy
  rate; `of bound` is bound / time, the step's fraction of memory speed;
- a prefill row's `TFLOP/s` (`prefill_flops`: 2 x the parameters each token touches x tokens,
  attention's causal half, the last position's logits) and `of GEMM rate`.
`--kernels` gives each step's GPU time by kernel, as profiled in the way the step is timed: each
kernel's time per step, launches and share of the kernels' total; for a decode step, bandwidths by
what the kernels read: the KV attended (`kv_bytes`) over the time of the kernels named like
attention (`ATTENTION_KERNEL`: the split-KV decode and its combine, SDPA's, flash's), and the rest
of the step's bytes (the weights) over the other kernels' time, most of it the GEMMs'; each
kernel's own bytes the bench does not know.
A run stopped by SIGTERM (`timeout`, the launcher's Ctrl-C) saves the rows of the systems that
finished before it, the file marked `stopped`, and exits 1.

The baselines' attention is transformers' SDPA attention, with a decode step's grouped-query
attention reading each KV head where it is (`--attention grouped`, the default:
`grouped_decode_attention`) rather than as transformers before its `pack_gqa` ran it (`--attention
sdpa` on such a version), which copied every KV head for each of its query heads over the whole
static cache at every step, most of a large-batch step (benchmarks/NOTES.md, "The model's decode
step"). tridist's decoder layers run their own at decode steps (`tridist.nn.decoder`).
"""
import argparse
import contextlib
import copy
import functools
import os
import re
import shutil
import signal
import statistics
import tempfile
import time
import warnings
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tridist
import tridist.nn
from tridist.nn import ColumnParallelLinear, ExpertParallelMoE, ParallelSparseMoeBlock, RowParallelLinear
from tridist.nn.decoder import ResidualStream, RMSNorm
from tridist.nn.moe import free_buffers, gated
from tridist.ops.gemm.linear_gemm import reference as linear_reference

from . import shared_gpu
from .ep import torch_combine, torch_dispatch
from .norm import rms_norm, torch_add_norm
from .results import relative_error, save, table
from .timing import captured, copy_rate, gemm_rate, kernel_us, slowest, time_us

MODELS = {
    "dense": ("Qwen3-8B", "Qwen3Config", dict(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False)),
    "llama": ("Llama-3-8B", "LlamaConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False)),
    "moe": ("Qwen3-30B-A3B", "Qwen3MoeConfig", dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False)),
}
LAYERS = 8
PREFILL = (4096, 16384)
DECODE = (1, 8, 64)
CONTEXT = 4096  # positions of the static cache a decode step attends over
SYSTEMS = {1: ("tridist", "hf", "compile"), 2: ("tridist", "megatron", "hf_tp")}  # by world size: 1, or 2 and more
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")
OWN_GRAPHS = ("reduce-overhead", "max-autotune")  # torch.compile's modes that replay CUDA graphs of their own
COMPILE_CALLS = 3  # a compiled step's first calls: the compile, then (cudagraph trees) a warm-up and the recording
ELEMENT_BYTES = 2  # bf16: every weight and the KV cache
# bf16 logits against the whole model's, over the largest. Splitting the row-parallel sums over 2 ranks
# alone moves 8 random bf16 layers' logits by 2.3e-2 (plain torch); transformers' TP by 3.1e-2 (NOTES:
# "the dense model's wrong logits"). Ranks that sharded different weights were off by 1.5.
TOLERANCE = 5e-2
CHECK_BATCH, CHECK_TOKENS, CHECK_STEPS = 2, 16, 2
GRAPH_STEPS = 5  # decode steps in one CUDA-graph replay
NOTES = {"megatron moe decode": "eager: its splits are read on the host, which a CUDA graph cannot capture",
         "compile own graphs": "eager calls of the compiled step, which replays its own CUDA graphs"}
GROUPED = "tridist_bench_grouped_decode"  # the name `grouped_decode_attention` is registered under in transformers
ATTENTION = {"grouped": GROUPED, "sdpa": "sdpa"}


def grouped_decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' SDPA attention, but for a decode step (one query per sequence) of grouped-query
    attention: the query heads that share a KV head become the rows of one query block against that
    head (query [B, Hq, 1, D] -> [B, Hkv, Hq / Hkv, D]), so the cache is read where it is, never
    copied. The mask of one query ([B, 1, 1, S]) holds for every row. The same numbers as SDPA over
    the repeated heads; anything else (prefill, a per-head mask) goes to transformers' own."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, length, dim = query.shape
    if length != 1 or groups == 1 or (attention_mask is not None and attention_mask.shape[1] != 1):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    rows = query.reshape(batch, heads // groups, groups, dim)
    out = F.scaled_dot_product_attention(rows, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


def use_attention(config, attention: str):
    """`config` set to run `attention` ("grouped" or "sdpa", `ATTENTION`), registered with
    transformers first where it is ours, with SDPA's masks (a name without a mask function of its own
    gets no mask, and a decode step over a static cache would attend to its empty positions); returns
    transformers' name of it."""
    import transformers
    from transformers.masking_utils import sdpa_mask

    if attention == "grouped":
        transformers.AttentionInterface.register(GROUPED, grouped_decode_attention)
        transformers.AttentionMaskInterface.register(ATTENTION[attention], sdpa_mask)
    config._attn_implementation = ATTENTION[attention]
    return ATTENTION[attention]


# ---- the torch + NCCL baseline: tridist.nn's shards, torch's GEMMs and NCCL's collectives ----------
class NcclRowParallelLinear(RowParallelLinear):
    """The partial product (the bias on rank 0), then NCCL's all-reduce where the layer sums its
    output; a decoder layer's projections leave the sum to the next norm (`NcclRMSNorm`)."""

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias if self.rank == 0 else None)
        if self.sum_output:
            dist.all_reduce(y)
        return y


class NcclColumnParallelLinear(ColumnParallelLinear):
    """The local GEMM and its activation (torch's, `linear_reference`); the output's columns gathered
    with NCCL."""

    def forward(self, x):
        y = linear_reference(x, self.weight, self.bias, self.activation)
        if not self.gather_output:
            return y
        return nccl_all_gather(y.reshape(-1, self.out_local)).view(self.world_size, -1, self.out_local).permute(
            1, 0, 2).reshape(*y.shape[:-1], self.out_features)


class NcclRMSNorm(RMSNorm):
    """NCCL's all-reduce of a partial sum, then torch's residual add and transformers' RMSNorm."""

    def forward(self, x, residual, summed):
        if residual is None:
            return rms_norm(x, self.weight, self.eps), x
        if not summed:
            x = x.clone()
            dist.all_reduce(x)
        return torch_add_norm(x, residual, self.weight, self.eps)


class NcclSparseMoeBlock(ParallelSparseMoeBlock):
    """The token shares' outputs gathered with NCCL."""

    def gather(self, y):
        return nccl_all_gather(y)


class NcclExpertParallelMoE(ExpertParallelMoE):
    """Expert parallelism as frameworks run it on NCCL: the (token, expert) pairs sorted by expert (so
    by rank), the counts exchanged and read on the host, `all_to_all_single` of the rows and their
    experts, the local experts by `torch._grouped_mm`, and back."""

    def forward(self, x, topk_idx, topk_weights):
        topk_idx = topk_idx.clamp(min=0)  # padding (-1, weight 0) to expert 0, where it adds nothing
        rows, order = torch_dispatch(x, topk_idx)
        experts = topk_idx.reshape(-1)[order]
        counts = torch.bincount(experts // self.local_experts, minlength=self.world_size)
        arriving = torch.empty_like(counts)
        dist.all_to_all_single(arriving, counts)
        sent, received = counts.tolist(), arriving.tolist()
        recv = rows.new_empty(sum(received), self.hidden_size)
        dist.all_to_all_single(recv, rows, received, sent)
        recv_experts = experts.new_empty(sum(received))
        dist.all_to_all_single(recv_experts, experts, received, sent)
        local = recv_experts - self.rank * self.local_experts
        by_expert = local.argsort(stable=True)
        offs = torch.bincount(local, minlength=self.local_experts).cumsum(0).to(torch.int32)
        h = torch._grouped_mm(recv[by_expert], self.w_gate_up, offs=offs)
        y = torch.empty_like(recv)
        y[by_expert] = torch._grouped_mm(gated(h, self.activation), self.w_down, offs=offs)
        back = y.new_empty(sum(sent), self.hidden_size)
        dist.all_to_all_single(back, y, sent, received)
        return torch_combine(back, order, topk_weights)


NCCL_CLASSES = {RowParallelLinear: NcclRowParallelLinear, ColumnParallelLinear: NcclColumnParallelLinear,
                RMSNorm: NcclRMSNorm,
                ParallelSparseMoeBlock: NcclSparseMoeBlock, ExpertParallelMoE: NcclExpertParallelMoE}


def nccl_all_gather(y: torch.Tensor) -> torch.Tensor:
    out = y.new_empty(dist.get_world_size() * y.shape[0], *y.shape[1:])
    dist.all_gather_into_tensor(out, y.contiguous())
    return out


def megatron(model):
    """The model sharded as `tridist.nn.parallelize(model, moe="ep")` shards it, its layers computing
    with torch and NCCL instead (the same weights, the same shards)."""
    tridist.nn.parallelize(model, moe="ep")
    for module in model.modules():
        module.__class__ = NCCL_CLASSES.get(type(module), type(module))
    return model


# ---- models and steps -----------------------------------------------------------------------------
def make_config(kind: str, layers: int | None, dims: dict | None = None):
    """The transformers config of `kind` with `layers` decoder layers (None: the model's own count;
    `dims` overrides sizes: tests)."""
    import transformers

    _, class_name, sizes = MODELS[kind]
    sizes = {**sizes, **(dims or {})}
    if layers is not None:
        sizes["num_hidden_layers"] = layers
    return getattr(transformers, class_name)(**sizes)


def build(config, device) -> torch.nn.Module:
    """The model of `config` with weights drawn from seed 0 (the same on every rank), built in bf16 (a
    float32 build of the MoE model's 48 layers would need twice its 61 GB), for inference."""
    import transformers

    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.to(torch.bfloat16).eval()


@torch.no_grad()
def check_logits(model, prompt: torch.Tensor) -> list[torch.Tensor]:
    """The last position's logits after the prompt and after each of CHECK_STEPS greedy steps (each
    step fed the token the whole model chose: `prompt`'s last column)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    steps = [model(prompt[:, :CHECK_TOKENS], past_key_values=cache, use_cache=True).logits[:, -1]]
    for i in range(CHECK_STEPS):
        token = prompt[:, CHECK_TOKENS + i:CHECK_TOKENS + i + 1]
        steps.append(model(token, past_key_values=cache, use_cache=True).logits[:, -1])
    return steps


def prefill_step(model, tokens: int, vocab: int, device):
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(tokens)).to(device)

    @torch.no_grad()
    def run():
        return model(ids, use_cache=False, logits_to_keep=1).logits
    return run


def decode_step(model, batch: int, vocab: int, device):
    """One decode step of `batch` sequences over a `StaticCache` of CONTEXT positions, on static
    tensors, as a function that a CUDA graph can capture and whose every call is the same step: one
    kernel sets each cache layer's `cumulative_length` (where transformers' `StaticLayer` writes an
    update, advancing it) to CONTEXT - 1, then `model` runs at position CONTEXT - 1, so that each
    call writes position CONTEXT - 1 and attends over all CONTEXT positions. The cache is allocated
    here by one eager call of `model`, which writes position 0: make the step before `model.forward`
    is compiled, so that the cache's tensors are made, and marked static, outside the compile.
    `step.model` and `step.cache` are `model` and the cache."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=CONTEXT)
    ids = torch.randint(0, vocab, (batch, 1), generator=torch.Generator().manual_seed(batch)).to(device)
    position = torch.full((batch, 1), CONTEXT - 1, device=device)
    cache_position = torch.full((1,), CONTEXT - 1, device=device)

    @torch.no_grad()
    def forward():
        return model(ids, position_ids=position, cache_position=cache_position, past_key_values=cache,
                     use_cache=True, logits_to_keep=1).logits

    forward()
    written = [layer.cumulative_length for layer in cache.layers]  # device tensors once the layers are allocated
    last = [torch.full_like(length, CONTEXT - 1) for length in written]

    def step():
        torch._foreach_copy_(written, last)
        return forward()
    step.model, step.cache = model, cache
    return step


class Routing(NamedTuple):
    """One call of a transformers MoE block's router in the whole model: its input rows, its logits and
    what it picked, as transformers' Qwen3-MoE router picks (the top `num_experts_per_tok` of the fp32
    softmax, renormalised where the config says so, the weights rounded to the logits' dtype)."""
    x: torch.Tensor  # [T, hidden]
    logits: torch.Tensor  # [T, experts]
    ids: torch.Tensor  # int64 [T, k]
    weights: torch.Tensor  # float32 [T, k], holding values of the logits' dtype


def _is_moe_block(module) -> bool:
    """A transformers MoE block: a `gate` of weight [experts, hidden] and `experts`."""
    return hasattr(module, "gate") and hasattr(module, "experts")


@contextlib.contextmanager
def recorded_routing(model):
    """Within it, each call of a transformers MoE block of `model` appends its `Routing` to the list it
    yields, recomputed from the block's input as its router computes it (no list for a dense model)."""
    calls = []
    config = model.config

    def record(block, args):
        x = args[0].reshape(-1, args[0].shape[-1])
        logits = F.linear(x, block.gate.weight)
        weights, ids = F.softmax(logits, dim=-1, dtype=torch.float32).topk(config.num_experts_per_tok, dim=-1)
        if config.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        calls.append(Routing(x, logits, ids, weights.to(logits.dtype).float()))

    hooks = [module.register_forward_pre_hook(record) for module in model.modules() if _is_moe_block(module)]
    try:
        yield calls
    finally:
        for hook in hooks:
            hook.remove()


def routing_departure(got: tuple[torch.Tensor, torch.Tensor], call: Routing) -> str | None:
    """Why a router's `(ids, weights)` on `call.x` are not the whole model's (`call`), or None: it
    must pick experts whose logits are the whole model's top k (other experts only where logits tie,
    which transformers' `topk` and tridist's router break differently), with weights, sorted, within
    a rounding of bf16 of the whole model's."""
    ids, weights = got
    logits = call.logits.float()
    picked = logits.gather(1, ids).sort(dim=-1, descending=True).values
    top = logits.gather(1, call.ids).sort(dim=-1, descending=True).values
    wrong = (picked != top).any(dim=-1).nonzero()
    if wrong.numel():
        t = wrong[0, 0].item()
        return (f"token {t} routed to experts {sorted(ids[t].tolist())}, the whole model's top {ids.shape[1]} "
                f"{sorted(call.ids[t].tolist())} (logits {picked[t].tolist()} against {top[t].tolist()})")
    mine, theirs = weights.sort(dim=-1).values, call.weights.sort(dim=-1).values
    if not torch.allclose(mine, theirs, rtol=2 ** -7, atol=1e-6):
        return f"routing weights off by {(mine - theirs).abs().max().item():.2e}"
    return None


@contextlib.contextmanager
def replayed_routing(model, calls: list[Routing]):
    """Within it, tridist's MoE blocks of `model` (`ParallelSparseMoeBlock`, the megatron baseline's
    too) route as the whole model did, call by call (`calls`: `recorded_routing`'s, in the same
    order), each rank its share of the tokens; each block's own router is checked on the whole
    model's input of the call (`routing_departure`), and the list it yields gets a line for each
    call where it departs. The random models' router logits are bf16 values a few units apart over
    128 experts: a step's k-th and (k+1)-th often tie or differ by one rounding, and a rounding of
    the block's input picks another expert there, which moves that token's output by a whole
    expert's share (benchmarks/NOTES.md, "The MoE decode failure was a tie in the router").
    Replaying the routing compares everything else exactly as the whole model computes it; the
    router is held to the whole model's choices on the whole model's input. Models without
    tridist's blocks (transformers' own, compiled or not) route by themselves."""
    departures = []
    pending = iter(enumerate(calls))
    blocks = [module for module in model.modules() if isinstance(module, ParallelSparseMoeBlock)]

    def replay(block):
        route = block.route

        def routed(x):
            index, call = next(pending, (None, None))
            layer = block.moe_layer
            share = -(-call.x.shape[0] // layer.world_size) if call is not None else None
            if call is None or x.shape[0] != share:
                raise RuntimeError(f"MoE call {index}: {x.shape[0]} rows where the whole model's calls give "
                                   f"{share}: the systems' MoE blocks ran in another order")
            why = routing_departure(route(call.x), call)
            if why:
                departures.append(f"MoE call {index}: {why}")
            first = layer.rank * share
            ids, weights = call.ids[first:first + share], call.weights[first:first + share]
            pad = share - ids.shape[0]  # rows past the tokens, which the block routes nowhere
            return F.pad(ids, (0, 0, 0, pad)).contiguous(), F.pad(weights, (0, 0, 0, pad)).contiguous()
        return routed

    for block in blocks:
        block.route = replay(block)
    try:
        yield departures
    finally:
        for block in blocks:
            del block.route


@contextlib.contextmanager
def recorded_layers(model):
    """Within it, each call of `model`'s decoder layers (`model.model.layers`) appends to the list it
    yields (its attention's output, its output) at the last position, fp32 `[B, hidden]`: a
    transformers layer's hidden state, or a tridist layer's `ResidualStream` as residual + x (at
    world size 1, where x is whole)."""
    states = []

    def last(t):
        return t[0] if isinstance(t, tuple) and not isinstance(t, ResidualStream) else t

    def attention(module, args, output):
        states.append([last(output)[..., -1, :].float()])

    def layer(module, args, output):
        hidden = output.residual + output.x if isinstance(output, ResidualStream) else last(output)
        states[-1].append(hidden[..., -1, :].float())

    hooks = []
    for decoder_layer in model.model.layers:
        hooks += [decoder_layer.self_attn.register_forward_hook(attention), decoder_layer.register_forward_hook(layer)]
    try:
        yield states
    finally:
        for hook in hooks:
            hook.remove()


def _first_departure(model, step, expected: "Expected") -> str:
    """Where `step()` of `model` first departs from the whole model's (`expected`: its states,
    `recorded_layers`', and its routing, replayed): the first decoder layer whose attention output
    or output is off by more than TOLERANCE. Compared at world size 1 only (elsewhere a layer's
    output is a partial sum)."""
    if tridist.world().world_size > 1:
        return "layers compared at world size 1 only"
    with recorded_layers(model) as states, replayed_routing(model, expected.routing):
        step()
    for index, (got, want) in enumerate(zip(states, expected.states)):
        for what, g, e in zip(("attention output", "output"), got, want):
            error = relative_error(g, e)
            if error > TOLERANCE:
                return f"first off at decoder layer {index}'s {what} (by {error:.2e})"
    return "every decoder layer's attention output and output within the tolerance: the final norm or logits"


def hf_tensor_parallel(folder: str, attention: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto", dtype=torch.bfloat16,
                                                             attn_implementation=attention).eval()


# ---- bounds: what a step must read, what a prefill must compute ----------------------------------
class Rates(NamedTuple):
    """The rates a run's bounds divide by, measured in it: bytes read plus written per microsecond
    by a large device-to-device copy, bf16 FLOPs per microsecond of cuBLAS."""
    copy: float
    gemm: float


def _split(size: int, world_size: int) -> int:
    """A rank's share of `size` split over `world_size` ranks: the largest share, at least 1 (KV heads
    fewer than the ranks are repeated)."""
    return -(-size // world_size)


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _moe_layers(config) -> list[int]:
    """The decoder layers of `config` that are MoE layers (transformers' Qwen3-MoE rule)."""
    if not getattr(config, "num_experts", 0):
        return []
    return [i for i in range(config.num_hidden_layers)
            if i not in config.mlp_only_layers and (i + 1) % config.decoder_sparse_step == 0]


def _layer_elements(config, moe: bool, world_size: int) -> tuple[int, int]:
    """(the elements of a decoder layer's weights that a rank holds and every token uses: attention,
    norms, a dense MLP or an MoE layer's router; the elements of one expert's weights it holds, 0
    without experts). Split as every system here splits them: query heads, KV heads and the MLP's
    columns over the ranks, norms and the router whole, each expert too (its share under tensor
    parallelism, the average over the ranks under expert parallelism)."""
    hidden, dim = config.hidden_size, head_dim(config)
    q = _split(config.num_attention_heads, world_size) * dim
    kv = _split(config.num_key_value_heads, world_size) * dim
    shared = hidden * (2 * q + 2 * kv) + 2 * hidden  # q, k, v and o; the norms before attention and the MLP
    if getattr(config, "attention_bias", False):
        shared += q + 2 * kv + hidden
    if config.model_type in ("qwen3", "qwen3_moe"):
        shared += 2 * dim  # Qwen3 normalises each query and key head
    if moe:
        return shared + config.num_experts * hidden, 3 * hidden * _split(config.moe_intermediate_size, world_size)
    columns = _split(config.intermediate_size, world_size)
    return shared + 3 * hidden * columns + (2 * columns + hidden if getattr(config, "mlp_bias", False) else 0), 0


def kv_bytes(config, batch: int, positions: int, world_size: int = 1) -> int:
    """The bytes of K and V one rank attends in a decode step (`decode_bytes`' last part)."""
    kv_heads = _split(config.num_key_value_heads, world_size)
    return ELEMENT_BYTES * config.num_hidden_layers * batch * positions * kv_heads * head_dim(config) * 2


def decode_bytes(config, batch: int, positions: int, world_size: int = 1, experts: list[int] | None = None) -> int:
    """Bytes one rank must read in a decode step of `batch` sequences attending over `positions` each,
    in bf16: each weight it holds once (`_layer_elements`, the final norm, its rows of the logits
    projection), the embedding at the step's `batch` rows only, and the K and V it attends (a layer:
    batch x positions x its KV heads x head_dim, twice). An MoE layer reads the experts its routing
    touched, `experts[i]` for the i-th MoE layer, or all of them where `experts` is None. At world
    size 1 with all experts: 2 bytes for each parameter of the model but the embedding's, for
    `batch` rows of the embedding, and for each element of the KV attended.

    Raises:
        ValueError: `experts` does not give one count for each MoE layer."""
    moe = _moe_layers(config)
    if experts is not None and len(experts) != len(moe):
        raise ValueError(f"experts gives {len(experts)} counts; the model has {len(moe)} MoE layers")
    hidden = config.hidden_size
    elements = batch * hidden + hidden + _split(config.vocab_size, world_size) * hidden
    for index in range(config.num_hidden_layers):
        shared, expert = _layer_elements(config, index in moe, world_size)
        touched = 0 if not expert else config.num_experts if experts is None else experts[moe.index(index)]
        elements += shared + expert * touched
    return ELEMENT_BYTES * elements + kv_bytes(config, batch, positions, world_size)


def prefill_flops(config, tokens: int, world_size: int = 1) -> int:
    """FLOPs one rank does in a prefill of one sequence of `tokens` that keeps the last position's
    logits: 2 x tokens x the weights each token touches at the rank (`_layer_elements`; in an MoE
    layer its top num_experts_per_tok experts), attention's causal half (4 x head_dim for each query
    head the rank holds and each of a layer's tokens x (tokens + 1) / 2 query-key pairs), and 2 x
    hidden x the rank's rows of the logits projection, for the one position."""
    moe = _moe_layers(config)
    per_token = 0
    for index in range(config.num_hidden_layers):
        shared, expert = _layer_elements(config, index in moe, world_size)
        per_token += shared + expert * (config.num_experts_per_tok if expert else 0)
    pairs = config.num_hidden_layers * tokens * (tokens + 1) // 2
    attention = 4 * _split(config.num_attention_heads, world_size) * head_dim(config) * pairs
    return 2 * tokens * per_token + attention + 2 * config.hidden_size * _split(config.vocab_size, world_size)


# ---- the run --------------------------------------------------------------------------------------
class Expected(NamedTuple):
    """What the whole model gave in a check: its logits (a list, compared tensor by tensor), the
    experts each MoE layer's routing touched (`decode_bytes`' counts; [] for a dense model), each
    decoder layer's states (`recorded_layers`') and its routing (`recorded_routing`'s calls,
    replayed into the system checked)."""
    logits: list
    experts: list
    states: list
    routing: list


def _expected(whole, run) -> Expected:
    """`run()` of the whole model (it returns a list of logits), recorded."""
    with recorded_layers(whole) as states, recorded_routing(whole) as routing:
        logits = run()
    return Expected(logits, [call.ids.unique().numel() for call in routing], states, routing)


class Case(NamedTuple):
    """One model's run: what every system is checked against and how it is timed."""
    kind: str
    config: object  # the transformers config every system is built from
    prompt: torch.Tensor
    expected: Expected  # the whole model's check_logits (as its logits; no states)
    steps: dict  # decode batch -> the whole model's `decode_step` (Expected)
    prefill: list
    decode: list
    timed: bool
    kernels: bool
    rates: Rates | None


def run(kind: str, layers: int | None, prefill, decode, moe_modes, systems, timed: bool, kernels: bool = False,
        dims: dict | None = None, attention: str = "grouped", rates: Rates | None = None, compile_modes=("default", "reduce-overhead"), compile_decode=None) -> list[dict]:
    """Each system of `systems` built, checked and (if `timed`) timed, every model with `attention`
    (`ATTENTION`; tridist's layers run their own at decode steps), `layers` decoder layers (None:
    the model's own count); `compile` in `compile_modes` at the batches of `decode` that are in
    `compile_decode` (None: all). A row per (system, step), with its bound where `rates` are given,
    or one saying why a system did not run."""
    w = tridist.world()
    config = make_config(kind, layers, dims)
    use_attention(config, attention)
    # Its own config: save_pretrained writes into the model's config (its dtype), and the systems built
    # from `config` afterwards must draw the same weights on every rank, also where only rank 0 saved.
    whole = build(copy.deepcopy(config), w.device)
    prompt = torch.randint(0, config.vocab_size, (CHECK_BATCH, CHECK_TOKENS + CHECK_STEPS),
                           generator=torch.Generator().manual_seed(1)).to(w.device)
    case = Case(kind, config, prompt, _expected(whole, functools.partial(check_logits, whole, prompt)),
                _expected_steps(whole, decode, config, w.device),
                prefill, decode, timed, kernels, rates)
    folder = _save_checkpoint(whole) if "hf_tp" in systems and w.device.type == "cuda" else None
    del whole  # nothing else holds it (its steps' caches neither): the systems are built one at a time
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    variants = [(system, moe) for system in systems
                for moe in (moe_modes if system == "tridist" and kind == "moe" else [None])]
    rows = []
    try:
        for system, moe in variants:
            name = system if moe is None else f"{system} moe={moe}"
            why = _unavailable(system, w, timed)
            if why:
                rows.append({"model": kind, "system": name, "skipped": why})
            elif system == "compile":
                batches = [batch for batch in decode if compile_decode is None or batch in compile_decode]
                try:
                    rows += _compiled(case, compile_modes, batches)
                except Exception as error:  # noqa: BLE001 - recorded: a baseline that fails keeps the others' rows
                    rows.append({"model": kind, "system": name, "skipped": f"{type(error).__name__}: {error}"[:300]})
            else:
                try:
                    rows += _system(case, name, _shard(system, moe, config, folder, w.device), config)
                except Exception as error:  # noqa: BLE001 - recorded: transformers' TP may refuse or fail on a model
                    if system != "hf_tp":
                        raise
                    rows.append({"model": kind, "system": name, "skipped": f"{type(error).__name__}: {error}"[:300]})
    except Stopped:
        raise Stopped(_ratios(rows)) from None
    finally:
        if folder and w.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
    return _ratios(rows)


def _expected_steps(whole, decode, config, device) -> dict:
    """Case.steps of the whole model: for each decode batch, its step (`Expected`). The steps (and
    their caches) are dropped on return."""
    steps = {}
    for batch in decode:
        step = decode_step(whole, batch, config.vocab_size, device)
        steps[batch] = _expected(whole, lambda: [step()])
    return steps


def _checked(case: Case, name: str, what: str, model, run, expected: Expected) -> str | None:
    """Why `run()` of `model` (a list of logits) is not the whole model's (`expected`) within
    TOLERANCE, its routing replayed from the whole model's and its routers checked against them, or
    None where it is."""
    with replayed_routing(model, expected.routing) as departures:
        got = run()
    if departures:
        return f"{case.kind} {name}: {what}: the router departs from the whole model's at " + "; ".join(departures[:3])
    return _check(case, name, what, got, expected.logits)


class Stopped(BaseException):
    """SIGTERM reached the rank (a time limit, the launcher stopping the job): `rows` holds the rows
    of the systems that had finished, which `main` saves."""

    def __init__(self, rows: list[dict] | None = None):
        super().__init__("stopped by SIGTERM")
        self.rows = rows or []


def _stop(signum, frame):
    raise Stopped()


def _check(case: Case, name: str, what: str, got: list, want: list) -> str | None:
    """Why `got` is not within TOLERANCE of `want`, tensor by tensor (the same on every rank), or None
    where it is."""
    error = slowest(max(relative_error(g, e) for g, e in zip(got, want)))
    if error > TOLERANCE:
        return f"{case.kind} {name}: {what} off by {error:.2e} of the largest (tolerance {TOLERANCE})"
    if tridist.world().rank == 0:
        print(f"{case.kind} {name}: {what} within {error:.1e} of the whole model's", flush=True)
    return None


def _failed(case: Case, name: str, why: str, step: str | None = None) -> dict:
    """The row of a check that failed: the step (or, without one, the whole system) is not timed, and
    `main` ends the run with an error once the other rows are saved."""
    if tridist.world().rank == 0:
        print(f"FAILED {why}", flush=True)
    return {"model": case.kind, "system": name, **({"step": step} if step else {}), "failed": why}


def _system(case: Case, name: str, model, config) -> list[dict]:
    """One system's model checked against the whole model's logits, then its steps checked and timed;
    a failed check is a row saying so."""
    why = _checked(case, name, "logits", model, lambda: check_logits(model, case.prompt), case.expected)
    rows = [_failed(case, name, why)] if why else _timings(case, name, model, config)
    _free(model)
    return rows


def _unavailable(system: str, w, timed: bool) -> str | None:
    if system in ("megatron", "hf_tp") and not dist.is_initialized():
        return "needs torch.distributed (NCCL on GPUs)"
    if system == "hf_tp" and w.device.type != "cuda":
        return "transformers' tensor parallelism needs GPUs"
    if system == "compile" and not timed:
        return "compiled in timed runs only (on a GPU of its own)"
    return None


def _shard(system: str, moe, config, folder, device):
    if system == "hf_tp":
        return hf_tensor_parallel(folder, config._attn_implementation)
    model = build(config, device)
    if system == "hf":
        return model
    return megatron(model) if system == "megatron" else tridist.nn.parallelize(model, moe=moe or "ep")


def _save_checkpoint(model) -> str:
    """The whole model saved by rank 0 to a temporary folder every rank reads (one host)."""
    folder = [tempfile.mkdtemp(prefix="tridist-bench-model-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder)
    if dist.get_rank() == 0:
        model.save_pretrained(folder[0])
    dist.barrier()
    return folder[0]


def _free(model) -> None:
    """The MoE layers' symmetric buffers given back (a collective), the model's memory released."""
    free_buffers()
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _timings(case: Case, name: str, model, config) -> list[dict]:
    """`model`'s decode step at each batch checked against the whole model's; in a timed run the
    prefills and those steps timed."""
    w = tridist.world()
    rows = []
    for tokens in case.prefill if case.timed else ():
        step = prefill_step(model, tokens, config.vocab_size, w.device)
        us = slowest(time_us(step, inner=1, repetitions=5, warmup=2))
        rows.append(_row(case, name, f"prefill {tokens}", us, "eager", step))
    for batch in case.decode:
        step = decode_step(model, batch, config.vocab_size, w.device)
        why = _checked(case, name, f"decode {batch}", model, lambda: [step()], case.steps[batch])
        if why:
            rows.append(_failed(case, name, f"{why}; {_first_departure(model, step, case.steps[batch])}",
                                f"decode {batch}"))
        elif case.timed:
            eager = NOTES["megatron moe decode"] if name == "megatron" and case.kind == "moe" else None
            rows.append(_row(case, name, f"decode {batch}", *_decode_us(step, eager), step))
    return rows


def _decode_us(step, eager: str | None = None) -> tuple[float, str]:
    """(the slowest rank's median microseconds per step, how it was timed): in a CUDA graph of
    GRAPH_STEPS steps ("cuda graph"), or eagerly where `eager` says why or where the capture fails."""
    if eager is None:
        try:
            return slowest(time_us(step, inner=GRAPH_STEPS, repetitions=10, warmup=2, graph=True)), "cuda graph"
        except RuntimeError as error:  # a capture transformers' code does not allow: timed eagerly
            eager = f"eager (capture failed: {error})"[:200]
            torch.cuda.synchronize()
    return slowest(time_us(step, inner=GRAPH_STEPS, repetitions=10, warmup=2)), eager


def _row(case: Case, name: str, step_name: str, us: float, timing: str, step, **extra) -> dict:
    """A timed step's row: its time, its bound (a decode step: `decode_bytes` over the copy rate) or
    FLOP rate (a prefill: `prefill_flops`, and its fraction of the GEMM rate) where the run has
    rates, `extra`, and with `--kernels` its kernels (`_kernels`: a collective)."""
    w = tridist.world()
    what, size = step_name.split()
    layers = case.config.num_hidden_layers
    row = {"model": case.kind, "system": name, "step": step_name, "us": us, "us per layer": us / layers,
           "timing": timing, **extra}
    if case.rates and what == "decode":
        experts = case.steps[int(size)].experts
        nbytes = decode_bytes(case.config, int(size), CONTEXT, w.world_size, experts or None)
        row.update({"GB read": nbytes / 1e9, "GB of KV": kv_bytes(case.config, int(size), CONTEXT, w.world_size) / 1e9,
                    "bound us": nbytes / case.rates.copy,
                    "of bound": nbytes / case.rates.copy / us})
        if experts:
            row["experts a layer"] = statistics.mean(experts)
    elif case.rates:
        flops = prefill_flops(case.config, int(size), w.world_size)
        row.update({"TFLOP/s": flops / us / 1e6, "of GEMM rate": flops / us / case.rates.gemm})
    if w.rank == 0:
        rate = ""
        if "of bound" in row:
            rate = f", {row['of bound']:.0%} of its bound"
        elif "TFLOP/s" in row:
            rate = f", {row['TFLOP/s']:.0f} TFLOP/s, {row['of GEMM rate']:.0%} of the GEMM rate"
        print(f"  {case.kind} {name} {step_name}: {us:.1f} us ({timing}){rate}", flush=True)
    if case.kernels:  # profiled as timed: eagerly, waits for a peer's launches would count
        row["kernels"] = _kernels(row, captured(step) if timing == "cuda graph" else step)
    return row


def _kernels(row: dict, fn) -> list[list]:
    """`fn`'s GPU time by kernel (`timing.kernel_us`), printed on rank 0 under `row`'s step and
    returned as [kernel, microseconds per step, launches per step, share of the kernels' total]; for
    a decode step the bandwidths of its attention kernels and of the others (`_kernel_rates`). A
    collective."""
    times = kernel_us(fn)
    total = sum(us for us, _ in times.values())
    kernels = [[kernel, us, launches, us / total] for kernel, (us, launches) in times.items()]
    if "GB read" in row:
        row.update(_kernel_rates(row, kernels))
    if tridist.world().rank == 0:
        read = ""
        if "GB read" in row:
            read = (f"; {row['GB read']:.2f} GB to read, {row['GB read'] * 1e3 / row['us']:.2f} TB/s over the timed "
                    f"step: the KV's {row['GB of KV']:.3f} GB at {row['attention TB/s']:.2f} TB/s over the attention "
                    f"kernels' {row['attention us']:.1f} us, the rest at {row['others TB/s']:.2f} TB/s over the "
                    f"other kernels' {total - row['attention us']:.1f} us")
        print(f"  {row['model']} {row['system']} {row['step']}, rank 0's GPU time by kernel ({row['timing']}): "
              f"{total:.1f} us of kernels a step, {row['us']:.1f} us timed{read}\n"
              + "\n".join(f"    {share:6.1%} {us:10.1f} us x {launches:g}  {kernel}"
                          for kernel, us, launches, share in kernels), flush=True)
    return kernels


ATTENTION_KERNEL = re.compile(r"flash|fmha|attention|sdpa|attn", re.IGNORECASE)
"""Kernels whose names say they attend: tridist's split-KV decode and its combine, cuDNN's and
flash-attention's SDPA kernels."""


def _kernel_rates(row: dict, kernels: list[list]) -> dict:
    """A decode step's KV bytes over its attention kernels' time, and its other bytes over the other
    kernels' time (TB/s; 0 where no kernel of the kind ran)."""
    attention_us = sum(us for kernel, us, _, _ in kernels if ATTENTION_KERNEL.search(kernel))
    others_us = sum(us for _, us, _, _ in kernels) - attention_us
    kv, rest = row["GB of KV"], row["GB read"] - row["GB of KV"]
    return {"attention us": attention_us, "attention TB/s": kv * 1e3 / attention_us if attention_us else 0.0,
            "others TB/s": rest * 1e3 / others_us if others_us else 0.0}


def _compiled(case: Case, modes, batches) -> list[dict]:
    """transformers' model with its forward compiled in each of `modes`, each decode step of `batches`
    checked and timed in each mode; a row per batch giving the fastest mode (module docstring)."""
    import torch._dynamo

    w = tridist.world()
    if not batches:
        return [{"model": case.kind, "system": "compile", "skipped": "no decode batch of --compile-decode"}]
    model = build(case.config, w.device)
    forward = model.forward
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = max(limit, len(modes) * len(batches) + 1)  # none evicted
    compiled = {mode: torch.compile(forward, mode=mode, fullgraph=True, dynamic=False) for mode in modes}
    rows = []
    try:
        for batch in batches:
            model.forward = forward
            step = decode_step(model, batch, case.config.vocab_size, w.device)  # its cache made uncompiled
            times, notes = {}, []
            for mode in modes:
                model.forward = compiled[mode]
                try:
                    seconds = _first_calls(step)
                except Exception as error:  # noqa: BLE001 - recorded: a model may not compile whole
                    notes.append(f"{mode}: fullgraph=True failed ({type(error).__name__}: {error}"[:200]
                                 + "), compiled without it")
                    compiled[mode] = model.forward = torch.compile(forward, mode=mode, dynamic=False)
                    seconds = _first_calls(step)
                why = _check(case, f"compile {mode}", f"decode {batch}", [step()], case.steps[batch].logits)
                if why:
                    rows.append(_failed(case, "compile", why, f"decode {batch}"))
                    continue
                times[mode] = (*_decode_us(step, NOTES["compile own graphs"] if mode in OWN_GRAPHS else None), seconds)
                if w.rank == 0:
                    print(f"  {case.kind} compile {mode} decode {batch}: compiled in {seconds:.0f} s, "
                          f"{times[mode][0]:.1f} us ({times[mode][1]})", flush=True)
            if not times:
                continue
            best = min(times, key=lambda mode: times[mode][0])
            model.forward = compiled[best]
            modes_us = "; ".join(f"{mode} {us:.1f} us, compiled in {seconds:.0f} s" for mode, (us, _, seconds)
                                 in times.items())
            extra = {"compile mode": best, "compile modes": modes_us}
            if notes:
                extra["compile notes"] = "; ".join(notes)
            rows.append(_row(case, "compile", f"decode {batch}", *times[best][:2], step, **extra))
    finally:
        model.forward = forward
        torch._dynamo.config.recompile_limit = limit
        torch._dynamo.reset()
        _free(model)
    return rows


def _first_calls(step) -> float:
    """Seconds that a compiled step's first COMPILE_CALLS calls take: its compile, and with cudagraph
    trees their warm-up and recording."""
    start = time.perf_counter()
    for _ in range(COMPILE_CALLS):
        step()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _ratios(rows: list[dict]) -> list[dict]:
    """Each tridist row's speed-up over each baseline's row of the same step: baseline us / tridist us."""
    times = {(row["system"], row.get("step")): row["us"] for row in rows if "us" in row}
    for row in rows:
        if row["system"].startswith("tridist") and "us" in row:
            for baseline in ("megatron", "hf_tp", "hf", "compile"):
                if (baseline, row["step"]) in times:
                    row[f"{baseline} / tridist"] = times[(baseline, row["step"])] / row["us"]
    return rows


def parse_ints(text: str) -> list[int]:
    """'4096,16384' -> [4096, 16384] ('' -> []); an argparse `type`."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = [0]
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: write positive integers, comma separated, e.g. 1,8,64")
    return values


def parse_layers(text: str) -> int | None:
    """'8' -> 8, 'all' -> None (the model's own count); an argparse `type`."""
    if text == "all":
        return None
    try:
        layers = int(text)
    except ValueError:
        layers = 0
    if layers < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: write a positive integer, or all (the model's own count)")
    return layers


def _world_size() -> int:
    """The world size the launcher gave (WORLD_SIZE; 1 for a process started alone), read before
    tridist starts, so that options wrong for it fail first."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def main(argv=None) -> int:
    one, several = (", ".join(SYSTEMS[n]) for n in (1, 2))
    parser = argparse.ArgumentParser(prog="tridist bench model", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="dense,moe",
                        help=f"of {', '.join(MODELS)}, comma separated (default %(default)s)")
    parser.add_argument("--layers", type=parse_layers, default=LAYERS,
                        help="decoder layers of each model, or all: its own count (default %(default)s)")
    parser.add_argument("--prefill", type=parse_ints, default=list(PREFILL),
                        help="prefill tokens, comma separated, '' for none (default %(default)s)")
    parser.add_argument("--decode", type=parse_ints, default=list(DECODE),
                        help="decode batches, comma separated, '' for none (default %(default)s)")
    parser.add_argument("--moe", default="ep", help="tridist's MoE modes: ep, tp or ep,tp (default %(default)s)")
    parser.add_argument("--systems", default=None,
                        help=f"at world size 1 of {one}; at 2 or more of {several} (default: all of the world size's)")
    parser.add_argument("--compile-modes", default="default,reduce-overhead",
                        help=f"torch.compile's modes for the compile system, of {', '.join(COMPILE_MODES)}: each "
                             "compiled at each batch, the faster reported (default %(default)s)")
    parser.add_argument("--compile-decode", type=parse_ints, default=None,
                        help="the decode batches the compile system runs, of --decode's (default: all of them)")
    parser.add_argument("--kernels", action="store_true",
                        help="also print each step's GPU time by kernel: time per step, launches, share")
    parser.add_argument("--attention", choices=sorted(ATTENTION), default="grouped",
                        help="the attention of every system but tridist's, whose layers run their own at decode "
                             "steps (default %(default)s: a decode step reads GQA's KV heads in place; sdpa: "
                             "transformers' own)")
    parser.add_argument("--out", default="benchmarks/results", help="folder for JSON results (default %(default)s)")
    args = parser.parse_args(argv)
    world_size = _world_size()
    allowed_systems = SYSTEMS[min(world_size, 2)]
    kinds, moe_modes, modes = (v.split(",") for v in (args.models, args.moe, args.compile_modes))
    systems = args.systems.split(",") if args.systems else list(allowed_systems)
    for values, allowed, what in ((kinds, MODELS, "--models"), (moe_modes, ("ep", "tp"), "--moe"),
                                  (systems, allowed_systems, f"--systems at world size {world_size}"),
                                  (modes, COMPILE_MODES, "--compile-modes")):
        if not values or not set(values) <= set(allowed):
            parser.error(f"{what} takes a comma separated list of {', '.join(allowed)}")
    if args.compile_decode is not None and not set(args.compile_decode) <= set(args.decode):
        parser.error(f"--compile-decode takes batches of --decode ({','.join(map(str, args.decode))})")
    warnings.filterwarnings("ignore", message=".*past_key_values.*")  # transformers 5.24 renames it `cache`
    w = tridist.init()
    shared = shared_gpu.announce("tridist bench model", w.rank)
    timed = w.backend == "nvshmem" and not shared
    rates = Rates(copy_rate(w.device), gemm_rate(w.device)) if timed else None  # before any model takes memory
    if rates and w.rank == 0:
        print(f"copy rate {rates.copy / 1e3:.0f} GB/s (read + written), cuBLAS bf16 GEMM "
              f"{rates.gemm / 1e6:.0f} TFLOP/s", flush=True)
    rows, stopped = [], None
    signal.signal(signal.SIGTERM, _stop)
    try:
        for kind in kinds:
            rows += run(kind, args.layers, args.prefill, args.decode, moe_modes, systems, timed, args.kernels,
                        attention=args.attention, rates=rates,
                        compile_modes=modes, compile_decode=args.compile_decode)
    except Stopped as stop:  # a time limit: what finished is still a result
        rows += stop.rows
        stopped = "stopped by SIGTERM: the rows of the systems that finished before it"
        print(f"model: {stopped}", flush=True)
    failed = [row["failed"] for row in rows if "failed" in row]
    if w.rank == 0 and not timed and not stopped and not failed:
        print(f"model: every check passed; nothing timed ({'ranks share a GPU' if shared else 'no GPU'})")
    elif w.rank == 0 and timed:
        columns = []
        for row in rows:
            columns += [c for c in row if c not in columns and c != "kernels"]
        print(table(rows, columns))
        own = {kind: MODELS[kind][2]["num_hidden_layers"] for kind in kinds}
        extra = {"world_size": w.world_size, "timed": timed, "context": CONTEXT, "tolerance": TOLERANCE,
                 "attention": args.attention, "copy GB/s": rates.copy / 1e3,
                 "GEMM TFLOP/s": rates.gemm / 1e6, "compile modes": modes,
                 "models": {kind: {"like": MODELS[kind][0], "layers": f"{args.layers or own[kind]} of {own[kind]}",
                                   **MODELS[kind][2]} for kind in kinds},
                 "graph steps per replay": GRAPH_STEPS, "notes": NOTES}
        if stopped:
            extra["stopped"] = stopped
        print(f"saved {save('model', rows, args.out, extra)}")
    if failed and w.rank == 0:
        print(f"model: {len(failed)} check(s) failed, their steps not timed:\n  " + "\n  ".join(failed), flush=True)
    if stopped or failed:
        return 1
    tridist.finalize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
