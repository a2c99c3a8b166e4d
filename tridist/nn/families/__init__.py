"""Model families as plans: how `parallelize` builds tridist's decoder layers from one family of
transformers models. Each module of this package is one family and defines `PLAN`, a `Plan`: the
classes it takes and the names of the modules that become column-, row- or expert-parallel layers
and norms. A new family whose layers are built like these (attention, then a gated MLP or an MoE
block, RMSNorms around them) is one new module here.
"""
import dataclasses
import importlib
import pkgutil


@dataclasses.dataclass(frozen=True)
class Plan:
    """One family's decoder layers, by the names of transformers' modules in each layer.

    Attributes:
        classes: the causal-LM classes of the family (a subclass of one is taken too).
        attention: the attention's q, k and v projections (column-parallel, fused into one GEMM),
            then its output projection (row-parallel).
        qk_norm: the attention's RMSNorms of each query and key head, applied before the rotary
            embedding (Qwen3), or None (Llama).
        mlp: a dense MLP's gate and up (column-parallel, one GEMM with SiLU(gate) * up in its
            epilogue), then down (row-parallel).
        experts: whether a layer's MLP may be a sparse MoE block (router `gate`, `experts` holding
            3-D `gate_up_proj` and `down_proj`): expert- or tensor-parallel by `parallelize`'s `moe`.
        norms: the layer's RMSNorms before the attention and before the MLP.
    """

    classes: tuple[str, ...]
    attention: tuple[str, str, str, str] = ("q_proj", "k_proj", "v_proj", "o_proj")
    qk_norm: tuple[str, str] | None = None
    mlp: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    experts: bool = False
    norms: tuple[str, str] = ("input_layernorm", "post_attention_layernorm")


def _plans() -> dict[str, Plan]:
    plans = {}
    for module in pkgutil.iter_modules(__path__):
        plan = importlib.import_module(f"{__name__}.{module.name}").PLAN
        plans.update({name: plan for name in plan.classes})
    return plans


PLANS = _plans()
"""Every family's plan, by causal-LM class name."""


def plan_of(model) -> Plan | None:
    """The plan of `model`'s family: of its class, or of the nearest base class with one."""
    return next((PLANS[cls.__name__] for cls in type(model).__mro__ if cls.__name__ in PLANS), None)
