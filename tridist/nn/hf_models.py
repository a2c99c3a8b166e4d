"""`parallelize`: a Hugging Face `transformers` decoder made tensor- (and expert-) parallel in place,
over the world or a process group (`group=`: "world" and "rank" below are then the group's).

What each rank holds afterwards:

| module | split |
| --- | --- |
| attention `q_proj`, `k_proj`, `v_proj` | `ColumnParallelLinear` by heads: `num_attention_heads / world` query heads and `num_key_value_heads / world` KV heads a rank (GQA groups stay whole) |
| attention `o_proj` | `RowParallelLinear` |
| the KV cache (transformers' own cache objects) | this rank's KV heads: each rank's attention is the attention of its heads |
| dense MLP `gate_proj`, `up_proj` / `down_proj` | `ColumnParallelLinear` / `RowParallelLinear` |
| MoE block (`Qwen3MoeSparseMoeBlock`) | `moe="ep"`: `ExpertParallelMoE` (whole experts a rank); `moe="tp"`: `TensorParallelMoE` (a slice of every expert); the router replicated |
| `lm_head` | `ColumnParallelLinear` by vocabulary rows, the logits all-gathered (replicated where the vocabulary does not split evenly) |
| embeddings, norms, rotary tables | replicated (whole on every rank) |

The activations between the layers are replicated: every rank holds every token, so the model's
own forward, masks and caches run unchanged, and every rank returns the same logits. Each
row-parallel layer picks its kernel by the tokens of the step (`tridist.nn.linear`: a GEMM and the
LL all-reduce, or `gemm_ar`, for decode; `gemm_rs` + all-gather for prefill); the MoE block gives
each rank an equal share of the tokens (padded), runs the MoE layer on it and all-gathers the
outputs. Nothing in a decode step reads back to the host or depends on data on the host: with a
static cache (`transformers.StaticCache`) a step captures in one CUDA graph.

Not done yet: a sequence-parallel residual stream (each rank holding its share of the tokens
between the blocks, `ag_gemm` into q/k/v and the MLP, `gemm_rs` out of `o_proj` and `down_proj`,
so that the all-gather now run after each `gemm_rs` hides behind the next GEMM, and the norms
run on a share of the tokens). transformers' attention reshapes the
projections by the shape of its input, so this needs tridist's own attention module; the layers
themselves take `sequence_parallel=True`.
"""
import torch
from torch import nn

from tridist.ops.ranks import Ranks, ranks_of

from .linear import ColumnParallelLinear, RowParallelLinear, split
from .moe import ExpertParallelMoE, ParallelSparseMoeBlock, TensorParallelMoE

SUPPORTED = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
MOE_MODES = ("ep", "tp")
GEMM_ALIGN = 8  # elements: tridist's GEMMs read their operands' rows with TMA, in 16-byte steps


def _attention(attn: nn.Module, group) -> None:
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attn, name, ColumnParallelLinear.from_linear(getattr(attn, name), group=group))
    attn.o_proj = RowParallelLinear.from_linear(attn.o_proj, group=group)


def _dense_mlp(mlp: nn.Module, group) -> None:
    mlp.gate_proj = ColumnParallelLinear.from_linear(mlp.gate_proj, group=group)
    mlp.up_proj = ColumnParallelLinear.from_linear(mlp.up_proj, group=group)
    mlp.down_proj = RowParallelLinear.from_linear(mlp.down_proj, group=group)


def _is_dense(mlp: nn.Module) -> bool:
    return all(isinstance(getattr(mlp, name, None), nn.Linear) for name in ("gate_proj", "up_proj", "down_proj"))


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


def _is_moe(mlp: nn.Module) -> bool:
    experts = getattr(mlp, "experts", None)
    return (hasattr(mlp, "gate") and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
            and isinstance(getattr(experts, "down_proj", None), torch.Tensor))


def _aligned(size: int, what: str) -> None:
    if size % GEMM_ALIGN:
        raise ValueError(f"{what} ({size}) must be a multiple of {GEMM_ALIGN} for tridist's GEMMs")


def _check(model: nn.Module, world_size: int, moe: str) -> None:
    """Everything that could refuse the model, before anything is changed."""
    if moe not in MOE_MODES:
        raise ValueError(f"moe must be one of {MOE_MODES}, got {moe!r}")
    layers = getattr(getattr(model, "model", None), "layers", None)
    config = getattr(model, "config", None)
    if layers is None or config is None:
        raise NotImplementedError(f"parallelize takes a transformers causal LM ({', '.join(SUPPORTED)}), whose "
                                  f"decoder layers are model.model.layers; got {type(model).__name__}")
    split(config.num_attention_heads, world_size, "num_attention_heads")
    split(config.num_key_value_heads, world_size, "num_key_value_heads")
    # The GEMMs read rows of 16 bytes at least: the sizes they multiply, multiples of 8 elements.
    split(layers[0].self_attn.o_proj.in_features, world_size, "the attention's heads x head_dim", GEMM_ALIGN)
    _aligned(config.hidden_size, "hidden_size")
    for layer in layers:
        mlp = layer.mlp
        if _is_dense(mlp):
            split(mlp.down_proj.in_features, world_size, "the MLP's intermediate_size", GEMM_ALIGN)
        elif _is_moe(mlp):
            num_experts, _, inner = mlp.experts.down_proj.shape
            if moe == "ep":
                split(num_experts, world_size, "num_experts (moe='ep' spreads whole experts)")
                _aligned(inner, "moe_intermediate_size")
            else:
                split(inner, world_size, "moe_intermediate_size (moe='tp' splits every expert)", GEMM_ALIGN)
        else:
            raise NotImplementedError(f"parallelize does not know the MLP {type(mlp).__name__} of "
                                      f"{type(model).__name__} (transformers 5's dense MLPs and MoE blocks with "
                                      f"3-D expert weights); it takes {', '.join(SUPPORTED)}")


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


def parallelize(model: nn.Module, *, group=None, moe: str = "ep") -> nn.Module:
    """Shard a transformers causal LM in place over the ranks (of the world, or of `group`) and
    return it.

    Every rank builds the model from the same weights (a config and a fixed seed, or a
    checkpoint) and calls this at once (it allocates symmetric memory); afterwards every rank
    holds its shards (see the module docstring) on the world's device, and `model(input_ids)`
    (the same `input_ids` on every rank, also with transformers' KV caches) returns the same
    logits on every rank: those of the whole model, within bf16 rounding (the row-parallel sums
    add the ranks' partial products in fp32, where one GPU adds in a different order). With a
    group, "every rank" and "the world size" are its members and their number: each group shards
    and runs its own copy of the model (data parallelism across the groups).

    Args:
        model: `LlamaForCausalLM`, `Qwen3ForCausalLM` or `Qwen3MoeForCausalLM` (or a model of
            the same module structure), bf16 or fp16, on the CPU or the world's device.
        group: a `torch.distributed.ProcessGroup` (e.g. a DeviceMesh's `mesh.get_group("tp")`)
            or `tridist.Group` whose members shard the model among themselves, while the other
            ranks take no part (and may shard their own copy in their group); None for the world.
        moe: `"ep"` (expert parallel: whole experts a rank, `E` a multiple of the world size)
            or `"tp"` (tensor parallel: every expert split, `moe_intermediate_size / world` a
            multiple of 8). Ignored by dense models.

    Returns:
        `model`, sharded.

    Raises:
        ValueError: weights that differ between ranks; an unknown `moe`; heads, KV heads,
            intermediate sizes or experts that do not split over the world size, or sizes the
            GEMMs do not take (not multiples of 8 per rank); the message says which. A `group`
            this rank is not a member of.
        NotImplementedError: a model class or module layout it does not know.
    """
    ranks = ranks_of(group)
    _check(model, ranks.world_size, moe)
    _same_weights(model, ranks)
    group = ranks.group
    for layer in model.model.layers:
        _attention(layer.self_attn, group)
        if _is_dense(layer.mlp):
            _dense_mlp(layer.mlp, group)
        else:
            layer.mlp = _moe_block(layer.mlp, model.config, moe, group)
    if isinstance(getattr(model, "lm_head", None), nn.Linear) and model.lm_head.out_features % ranks.world_size == 0:
        model.lm_head = ColumnParallelLinear.from_linear(model.lm_head, gather_output=True, group=group)
    return model.to(ranks.device)
