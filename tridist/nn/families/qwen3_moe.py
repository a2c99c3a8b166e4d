"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention; sparse MoE blocks (top-k of gated experts),
dense MLPs in the layers its config lists as `mlp_only_layers`."""
from . import Plan

PLAN = Plan(classes=("Qwen3MoeForCausalLM",), qk_norm=("q_norm", "k_norm"), experts=True)
