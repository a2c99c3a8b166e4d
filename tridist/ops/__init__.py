"""The kernel library, grouped by family: `collectives`, `gemm`, `moe`. Each op's module holds its host
wrapper next to its kernels; `_protocol` and `sync` are what the families share."""
from .collectives import AllGather, AllReduce, ReduceScatter, all_gather, all_reduce, reduce_scatter
from .gemm import AllGatherGEMM, GemmAllReduce, GemmReduceScatter, ag_gemm, gemm_ar, gemm_rs, matmul
from .gemm import grouped_gemm
from .moe import AllGatherMoE, MoEHandle, MoEReduceScatter, ag_moe, moe_rs

__all__ = ["AllGatherGEMM", "ag_gemm", "AllGather", "all_gather", "AllReduce", "all_reduce", "ReduceScatter",
           "reduce_scatter", "matmul", "GemmReduceScatter", "gemm_rs", "GemmAllReduce", "gemm_ar"]
__all__ += ["grouped_gemm", "AllGatherMoE", "ag_moe", "MoEReduceScatter", "moe_rs", "MoEHandle"]
