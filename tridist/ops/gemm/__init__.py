"""GEMMs: the persistent TMA GEMM (`persistent`, `matmul`), the GEMMs overlapped with
communication that are built on it (AllGather-GEMM, GEMM-ReduceScatter, GEMM-AllReduce), and the
grouped GEMM of mixture-of-experts layers (`grouped`, `grouped_gemm`).

`tridist.ops.gemm.configs(device, dtype=...)` lists the configs the GEMM ops take as `config=`."""
from .allgather_gemm import AllGatherGEMM, ag_gemm
from .gemm_reduce import GemmAllReduce, GemmReduceScatter, gemm_ar, gemm_rs
from .grouped import grouped_gemm
from .persistent import FP8, configs, default_config, matmul, out_dtype

__all__ = ["AllGatherGEMM", "ag_gemm", "GemmAllReduce", "GemmReduceScatter", "gemm_ar", "gemm_rs", "FP8", "configs",
           "default_config", "matmul", "out_dtype", "grouped_gemm"]
