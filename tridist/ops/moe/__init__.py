"""Mixture of experts. Tensor parallel: `ag_moe` (all-gather + grouped GEMM) and `moe_rs` (grouped
GEMM + top-k sum + reduce-scatter), with the routing they share in `tp_routing`."""
from .allgather_moe import AllGatherMoE, ag_moe
from .moe_reduce import MoEReduceScatter, moe_rs
from .tp_routing import MoEHandle

__all__ = ["AllGatherMoE", "ag_moe", "MoEReduceScatter", "moe_rs", "MoEHandle"]
