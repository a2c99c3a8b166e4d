"""Tensor-parallel MoE (every rank holds a slice of every expert): `ag_moe` (all-gather + grouped
GEMM) and `moe_rs` (grouped GEMM + top-k sum + reduce-scatter), each module a front and its
method, with the routing and tile walks they share in `routing`. `tridist.ops.moe` exports the
ops (the modules keep the ops' names, so this package does not re-export them)."""
