"""Qwen3, dense (`Qwen3ForCausalLM`): Llama's layers with an RMSNorm of each query and key head."""
from . import Plan

PLAN = Plan(classes=("Qwen3ForCausalLM",), qk_norm=("q_norm", "k_norm"))
