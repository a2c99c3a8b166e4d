"""`parallelize`: a Hugging Face `transformers` decoder run by tridist's own decoder layers
(`tridist.nn.decoder`), tensor- (and expert-) parallel over the world or a process group
(`group=`: "world" and "rank" below are then the group's), or on one GPU at world size 1.

Each of the model's decoder layers is replaced by a `ParallelDecoderLayer` built from it by its
family's plan (`tridist.nn.families`), and the final norm by a `FinalNorm`; transformers' model
around them (embeddings, rotary tables, masks, caches, `generate`) is kept. What each rank holds:

| module | split |
| --- | --- |
| attention q, k, v projections | one `ColumnParallelLinear` (`from_linears`) by heads: `num_attention_heads / world` query heads and `num_key_value_heads / world` KV heads a rank (GQA groups stay whole) |
| attention output projection | `RowParallelLinear`, its sum left to the next norm |
| the KV cache (transformers' own cache objects) | this rank's KV heads: each rank's attention is the attention of its heads |
| dense MLP gate and up / down | one `ColumnParallelLinear` with SiLU(gate) * up in its epilogue / `RowParallelLinear`, its sum left to the next norm |
| MoE block (`Qwen3MoeSparseMoeBlock`) | `ParallelSparseMoeBlock`: `moe="ep"`, `ExpertParallelMoE` (whole experts a rank); `moe="tp"`, `TensorParallelMoE` (a slice of every expert); the router replicated |
| norms | replicated; each one fused with the sum over the ranks before it and the residual add (`ops.all_reduce_rms_norm`) |
| `lm_head` | `ColumnParallelLinear` by vocabulary rows, the logits all-gathered (replicated where the vocabulary does not split evenly) |
| embeddings, rotary tables | replicated (whole on every rank) |

The activations between the layers are replicated: every rank holds every token, so the model's
own forward, masks and caches run unchanged, and every rank returns the same logits. Nothing in a
decode step reads back to the host: with a static cache (`transformers.StaticCache`, or
`generate(..., cache_implementation="static")`) a step captures in one CUDA graph.

## Supported models

| family (`tridist.nn.families`) | transformers classes | MoE modes |
| --- | --- | --- |
| Llama (Llama 2 and 3, and models of its layout) | `LlamaForCausalLM` | (dense) |
| Qwen3 | `Qwen3ForCausalLM` | (dense) |
| Qwen3-MoE | `Qwen3MoeForCausalLM` | `moe="ep"`, `moe="tp"` |

Any rope scaling whose tables transformers' rotary module computes runs (the layers take its cos
and sin); attention and MLP biases run where a checkpoint has them. Refused before anything
changes, with what to change: weights other than bf16 or fp16 (tridist's decode kernels work in
16-bit floats: `model.to(torch.bfloat16)`), sliding-window layers, a partial rotary embedding
(`partial_rotary_factor < 1`), head sizes that are not powers of two, an MLP activation other
than SiLU, head counts or sizes that do not split over the ranks or are not multiples of 8
elements, weights that differ between ranks, and any other model class (a new family is one
module of `tridist.nn.families`).

Not done yet: a sequence-parallel residual stream (each rank holding its share of the tokens
between the blocks, `ag_gemm` into q/k/v and the MLP, `gemm_rs` out of `o_proj` and `down_proj`);
the linear layers take `sequence_parallel=True`.
"""
import torch
from torch import nn

from tridist.ops.ranks import Ranks, ranks_of

from .decoder import FinalNorm, DecodeStep, ParallelAttention, ParallelDecoderLayer, ParallelGatedMLP, RMSNorm
from .families import PLANS, Plan, plan_of
from .linear import ColumnParallelLinear, RowParallelLinear, split
from .moe import ExpertParallelMoE, ParallelSparseMoeBlock, TensorParallelMoE

MOE_MODES = ("ep", "tp")
DTYPES = (torch.bfloat16, torch.float16)  # what tridist's decode kernels take
SILU = ("silu", "swish")  # transformers' names of the MLP activation that ops.linear's swiglu fuses
GEMM_ALIGN = 8  # elements: tridist's GEMMs read their operands' rows in 16-byte steps


def _dense(mlp: nn.Module, plan: Plan) -> bool:
    return all(isinstance(getattr(mlp, name, None), nn.Linear) for name in plan.mlp)


def _sparse(mlp: nn.Module, plan: Plan) -> bool:
    experts = getattr(mlp, "experts", None)
    return (plan.experts and hasattr(mlp, "gate") and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
            and isinstance(getattr(experts, "down_proj", None), torch.Tensor))


def _aligned(size: int, what: str) -> None:
    if size % GEMM_ALIGN:
        raise ValueError(f"{what} ({size}) must be a multiple of {GEMM_ALIGN} for tridist's GEMMs")


def _check(model: nn.Module, world_size: int, moe: str) -> Plan:
    """Everything that could refuse the model, before anything is changed; returns its family's plan."""
    if moe not in MOE_MODES:
        raise ValueError(f"moe must be one of {MOE_MODES}, got {moe!r}")
    plan = plan_of(model)
    inner, config = getattr(model, "model", None), getattr(model, "config", None)
    if plan is None or config is None or not all(hasattr(inner, name) for name in ("layers", "norm", "rotary_emb")):
        raise NotImplementedError(f"parallelize takes a transformers causal LM of a family it has a plan for "
                                  f"({', '.join(sorted(PLANS))}; tridist.nn.families), got {type(model).__name__}")
    dtypes = {p.dtype for p in model.parameters()}
    if not dtypes <= set(DTYPES):
        raise ValueError(f"parallelize takes bf16 or fp16 models (tridist's decode kernels work in 16-bit floats); "
                         f"this one holds {', '.join(sorted(map(str, dtypes)))}: convert it first, "
                         "model.to(torch.bfloat16)")
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"} or getattr(config, "use_sliding_window", False):
        raise NotImplementedError(f"parallelize runs full attention in every layer; this config has "
                                  f"{sorted(kinds)} layers (use_sliding_window={getattr(config, 'use_sliding_window', False)}):"
                                  " sliding-window attention is not supported")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    split(heads, world_size, "num_attention_heads")
    split(kv_heads, world_size, "num_key_value_heads")
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
    first = inner.layers[0].self_attn if len(inner.layers) else None
    head_dim = getattr(first, "head_dim", config.hidden_size // heads)
    if head_dim & (head_dim - 1) or head_dim < 2:
        raise ValueError(f"parallelize takes head sizes that are powers of two, got head_dim {head_dim}")
    rotary = getattr(inner.rotary_emb, "inv_freq", None)
    if rotary is not None and 2 * rotary.numel() != head_dim:
        raise NotImplementedError(f"the rotary embedding turns {2 * rotary.numel()} of each head's {head_dim} "
                                  "dimensions (partial_rotary_factor < 1): parallelize rotates whole heads only")
    _aligned(config.hidden_size, "hidden_size")
    for layer in inner.layers:
        attn = layer.self_attn
        missing = [name for name in plan.attention + (plan.qk_norm or ()) + plan.norms
                   if not hasattr(attn if name not in plan.norms else layer, name)]
        if missing:
            raise NotImplementedError(f"{type(model).__name__}'s layers lack {missing}, which its plan "
                                      f"(tridist.nn.families) builds from")
        split(getattr(attn, plan.attention[3]).in_features, world_size, "the attention's heads x head_dim",
              GEMM_ALIGN)
        mlp = layer.mlp
        if _dense(mlp, plan):
            if getattr(config, "hidden_act", None) not in SILU:
                raise NotImplementedError(f"parallelize fuses SiLU(gate) * up; this model's MLP activation is "
                                          f"config.hidden_act {getattr(config, 'hidden_act', None)!r}")
            split(getattr(mlp, plan.mlp[2]).in_features, world_size, "the MLP's intermediate_size", GEMM_ALIGN)
        elif _sparse(mlp, plan):
            num_experts, _, inner_size = mlp.experts.down_proj.shape
            if moe == "ep":
                split(num_experts, world_size, "num_experts (moe='ep' spreads whole experts)")
                _aligned(inner_size, "moe_intermediate_size")
            else:
                split(inner_size, world_size, "moe_intermediate_size (moe='tp' splits every expert)", GEMM_ALIGN)
        else:
            raise NotImplementedError(f"parallelize does not know the MLP {type(mlp).__name__} of "
                                      f"{type(model).__name__} (transformers 5's dense MLPs, and MoE blocks with 3-D "
                                      f"expert weights where the family has them)")
    return plan


def _same_weights(model: nn.Module, ranks: Ranks) -> None:
    """Refuse a model whose weights differ between `ranks`: every rank would then shard a different
    model, and the sums of the row-parallel layers would mix them into logits that are wrong
    without any error. Two numbers a parameter: the sum of its elements and of every 61st, in fp64
    (summed alike on every rank, so equal weights give equal bits)."""
    names = [name for name, _ in model.named_parameters()]
    sums = torch.stack([torch.stack([p.sum(dtype=torch.float64), p.reshape(-1)[::61].sum(dtype=torch.float64)])
                        for _, p in model.named_parameters()])
    prints = [tuple(pair) for pair in sums.tolist()]  # one copy to the host for all of them
    everyone = ranks.allgather_objects(prints)
    for index, name in enumerate(names):
        values = [prints[index] for prints in everyone]
        if len(set(values)) > 1:
            differ = [ranks.world_rank(rank) for rank, value in enumerate(values) if value != values[0]]
            raise ValueError(f"parallelize: the weights differ between ranks, first in {name} (rank "
                             f"{ranks.world_rank(0)} and rank(s) {', '.join(map(str, differ))}); build the model on "
                             "every rank from the same weights (the same config and seed, or the same checkpoint)")


def _norm(norm: nn.Module, group) -> RMSNorm:
    return RMSNorm(norm.weight, norm.variance_epsilon, group)


def _moe_block(block: nn.Module, config, moe: str, group) -> ParallelSparseMoeBlock:
    # transformers: gate_up_proj [E, 2I, H] (W_gate's rows, then W_up's), down_proj [E, H, I];
    # tridist's MoE layers take x @ w, the transposes.
    experts = block.experts
    gate_up, down = experts.gate_up_proj, experts.down_proj
    num_experts, hidden, inner = down.shape
    kwargs = dict(activation=experts.act_fn, group=group, dtype=gate_up.dtype, device=gate_up.device)
    if moe == "ep":
        layer = ExpertParallelMoE(num_experts, hidden, inner, max_tokens_per_rank=1, **kwargs)
    else:
        layer = TensorParallelMoE(num_experts, hidden, inner, **kwargs)
    layer.load(gate_up.transpose(1, 2), down.transpose(1, 2))
    return ParallelSparseMoeBlock(block.gate.weight, config.num_experts_per_tok, config.norm_topk_prob, layer)


def _layer(layer: nn.Module, plan: Plan, config, step: DecodeStep, moe: str, ranks: Ranks) -> ParallelDecoderLayer:
    """tridist's decoder layer built from transformers' `layer` by `plan` (this rank's shards)."""
    group = ranks.group
    attn = layer.self_attn
    q, k, v, o = (getattr(attn, name) for name in plan.attention)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    q_norm, k_norm = (getattr(attn, name) for name in plan.qk_norm) if plan.qk_norm else (None, None)
    self_attn = ParallelAttention(
        ColumnParallelLinear.from_linears([q, k, v], group=group),
        RowParallelLinear.from_linear(o, sum_output=False, group=group), heads // ranks.world_size,
        kv_heads // ranks.world_size, q.out_features // heads, attn.layer_idx, attn.scaling, step,
        q_norm=None if q_norm is None else q_norm.weight, k_norm=None if k_norm is None else k_norm.weight,
        norm_eps=1e-6 if q_norm is None else q_norm.variance_epsilon)
    mlp = layer.mlp
    if _dense(mlp, plan):
        gate, up, down = (getattr(mlp, name) for name in plan.mlp)
        mlp = ParallelGatedMLP(ColumnParallelLinear.from_linears([gate, up], activation="swiglu", group=group),
                               RowParallelLinear.from_linear(down, sum_output=False, group=group))
    else:
        mlp = _moe_block(mlp, config, moe, group)
    before_attention, before_mlp = (getattr(layer, name) for name in plan.norms)
    return ParallelDecoderLayer(_norm(before_attention, group), self_attn, _norm(before_mlp, group), mlp)


def parallelize(model: nn.Module, *, group=None, moe: str = "ep") -> nn.Module:
    """Run a transformers causal LM with tridist's decoder layers, sharded in place over the ranks
    (of the world, or of `group`; at world size 1, on this rank's GPU alone), and return it.

    Every rank builds the model from the same weights (a config and a fixed seed, or a
    checkpoint) and calls this at once (it allocates symmetric memory); afterwards every rank
    holds its shards (see the module docstring) on the world's device, and `model(input_ids)`
    (the same `input_ids` on every rank, also with transformers' KV caches) returns the same
    logits on every rank: those of the whole model, within 16-bit rounding (the row-parallel sums
    add the ranks' partial products in fp32, where one GPU adds in a different order).
    `model.generate(input_ids, ...)` works with transformers' dynamic and static caches
    (`cache_implementation="static"`), uncompiled: TorchInductor cannot rebuild tridist's kernels,
    so the model's `generation_config.disable_compile` is set. Which models it takes, and what it refuses: the
    "Supported models" section of the `tridist.nn` reference. With a group, "every rank" and "the
    world size" are its members and their number: each group shards and runs its own copy of the
    model (data parallelism across the groups).

    The layers' hidden states are not recorded (`output_hidden_states`, `output_attentions`):
    between tridist's layers the residual stream is a `ResidualStream`, not a tensor.

    Args:
        model: a model of a family in `tridist.nn.families` (`LlamaForCausalLM`,
            `Qwen3ForCausalLM`, `Qwen3MoeForCausalLM`, or a subclass), bf16 or fp16, on the CPU or
            the world's device.
        group: a `torch.distributed.ProcessGroup` (e.g. a DeviceMesh's `mesh.get_group("tp")`)
            or `tridist.Group` whose members shard the model among themselves, while the other
            ranks take no part (and may shard their own copy in their group); None for the world.
        moe: `"ep"` (expert parallel: whole experts a rank, `E` a multiple of the world size)
            or `"tp"` (tensor parallel: every expert split, `moe_intermediate_size / world` a
            multiple of 8). Ignored by dense models.

    Returns:
        `model`, sharded.

    Raises:
        ValueError: weights that differ between ranks; an unknown `moe`; a dtype other than bf16
            and fp16; heads, KV heads, intermediate sizes or experts that do not split over the
            world size, or sizes the GEMMs do not take (not multiples of 8 per rank); a head size
            that is not a power of two; the message says which. A `group` this rank is not a
            member of.
        NotImplementedError: a model class or module layout it has no plan for; sliding-window
            attention; a rotary embedding over part of each head; an MLP activation other than SiLU.
    """
    ranks = ranks_of(group)
    plan = _check(model, ranks.world_size, moe)
    _same_weights(model, ranks)
    inner, step = model.model, DecodeStep()
    for index, layer in enumerate(inner.layers):
        inner.layers[index] = _layer(layer, plan, model.config, step, moe, ranks)
    inner.norm = FinalNorm(_norm(inner.norm, ranks.group), step)
    model.set_attn_implementation("sdpa")  # its boolean masks are what tridist's attention reads
    if getattr(model, "generation_config", None) is not None:
        # generate() compiles a static cache's steps on GPUs, and TorchInductor cannot rebuild
        # tridist's kernels (they call `tridist.language`'s device functions)
        model.generation_config.disable_compile = True
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Linear) and head.out_features % ranks.world_size == 0:
        model.lm_head = ColumnParallelLinear.from_linear(head, gather_output=True, group=ranks.group)
    return model.to(ranks.device)
