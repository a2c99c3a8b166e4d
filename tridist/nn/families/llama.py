"""Llama (`LlamaForCausalLM`): attention without per-head norms, a gated MLP."""
from . import Plan

PLAN = Plan(classes=("LlamaForCausalLM",))
