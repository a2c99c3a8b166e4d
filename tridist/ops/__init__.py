"""The kernel library: one module per kernel family, each with its host wrapper next to its kernels."""
from .allgather_gemm import AllGatherGEMM, ag_gemm
from .allgather import AllGather, all_gather
from .allreduce import AllReduce, ReduceScatter, all_reduce, reduce_scatter
from .gemm import matmul
from .gemm_reduce import GemmAllReduce, GemmReduceScatter, gemm_ar, gemm_rs

__all__ = ["AllGatherGEMM", "ag_gemm", "AllGather", "all_gather", "AllReduce", "all_reduce", "ReduceScatter", "reduce_scatter", "matmul",
           "GemmReduceScatter", "gemm_rs", "GemmAllReduce", "gemm_ar"]
