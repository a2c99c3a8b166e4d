"""`tridist bench NAME [options]`: starts the ranks itself when run outside a launcher.

Every benchmark's `main` initialises what it needs itself: `torch_fused` must never start tridist
(see its module), so nothing here does either."""
import os
import sys

BENCHMARKS = {"primitives": "tridist.bench.primitives", "allgather": "tridist.bench.collectives",
              "reducescatter": "tridist.bench.collectives", "allreduce": "tridist.bench.collectives",
              "gemm": "tridist.bench.overlap", "ag_gemm": "tridist.bench.overlap", "gemm_rs": "tridist.bench.overlap",
              "gemm_ar": "tridist.bench.overlap", "torch_fused": "tridist.bench.torch_fused",
              "jacobi": "tridist.bench.jacobi", "flash_decode": "tridist.bench.flash_decode",
              "grouped_gemm": "tridist.bench.moe", "ag_moe": "tridist.bench.moe", "moe_rs": "tridist.bench.moe",
              "ep": "tridist.bench.ep", "alltoall": "tridist.bench.ep", "model": "tridist.bench.model",
              "gemm_rs_epilogue": "tridist.bench.gemm_rs_epilogue", "linear": "tridist.bench.linear",
              "moe_local": "tridist.bench.moe_local", "all_reduce_rms_norm": "tridist.bench.norm"}
# Modules with one benchmark: their `main` takes no benchmark name.
SINGLE = ("primitives", "torch_fused", "jacobi", "flash_decode", "model", "gemm_rs_epilogue", "linear",
          "moe_local", "all_reduce_rms_norm")
DEFAULT_RANKS = 2
ONE_RANK = ("gemm_rs_epilogue", "linear", "moe_local")  # benchmarks of one GPU: one rank unless -n says otherwise
USAGE = "usage: tridist bench NAME [-n RANKS] [options]"
HELP = f"""{USAGE}

Each benchmark checks its result, then times it next to a baseline in the same run (GPUs only).

NAME:
  primitives      put, get, putmem, LL packets and the copy engine between GPU pairs; latency of p, g,
                  atomic_fetch_add, put and get by size; signal round trip (world 1: the local path)
  allgather, reducescatter, allreduce
                  tridist's methods against NCCL (sizes 4K..256M by default); --group-size G: groups of G
                  ranks at once (tensor parallelism), against NCCL on the same subgroups
  gemm            tridist's GEMM alone, every config, against cuBLAS on ag_gemm's local shapes
  linear          the decode GEMM (tridist.ops.linear, M 1..64) on one GPU: the weight's bytes per call against a
                  copy's rate and cuBLAS, on the models' shapes; --sweep times candidate configs per shape
  ag_gemm, gemm_rs, gemm_ar
                  the overlapped GEMMs against NCCL + cuBLAS one after the other, and against
                  PyTorch's fused ops where torch_fused saved their times in this run (TRIDIST_BENCH_RUN)
  torch_fused     PyTorch's fused ag_gemm and gemm_rs, in a process that never starts tridist
  jacobi          the 2D Jacobi solver per iteration, host loop against one fused co-resident kernel
  flash_decode    the split-KV decode kernel's bandwidth against a copy and SDPA on one GPU (-n 1)
  grouped_gemm    the grouped GEMM against torch._grouped_mm (fp8: _scaled_grouped_mm) and a copy's bandwidth
  moe_local       an MoE layer's experts on one GPU (tridist.ops.moe_local, decode batches and a prefill)
                  against transformers' grouped_mm experts, a copy's rate and cuBLAS; --sweep times tile candidates
  ag_moe, moe_rs  the tensor-parallel MoE ops against the grouped GEMM alone and NCCL + torch._grouped_mm
  ep              expert-parallel dispatch and combine (EPBuffer, normal and low-latency modes) against the plain
                  PyTorch steps, NCCL all_to_all_single with host-read splits, and a copy's bandwidth
  alltoall        all_to_all_v and all_to_all_v_2d against NCCL all_to_all_single and PyTorch's all_to_all_vdev
  model           Qwen3-8B-like and Qwen3-30B-A3B-like decoders sharded by tridist.nn: prefill and CUDA-graphed
                  decode steps against the same model on torch + NCCL (Megatron-style) and transformers' tp_plan
  gemm_rs_epilogue
                  gemm_rs's tile loop on one GPU (one rank by default), part by part: variants of its
                  epilogue (tile layout, flags, sums, TMA stores and loads) against the GEMM alone and cuBLAS
  all_reduce_rms_norm
                  the fused all-reduce, residual add and RMSNorm against the same steps in torch: at -n 1 eager
                  and torch.compile'd; at more ranks after NCCL's or PyTorch's one-shot all-reduce

options:
  -n RANKS        ranks to start (default {DEFAULT_RANKS}); ignored under a launcher (torchrun), which started them
  -h, --help      this list; `tridist bench NAME -h` lists NAME's options and their defaults
Results (JSON, and PNG plots where matplotlib is installed) go to benchmarks/results by default."""


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(HELP)
        return 0
    if not argv or argv[0] not in BENCHMARKS:
        problem = f"unknown benchmark {argv[0]!r}" if argv else "no benchmark named"
        print(f"{USAGE}\ntridist bench: {problem}; NAME is one of {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    name, default = argv[0], 1 if argv[0] in ONE_RANK else DEFAULT_RANKS
    nproc, rest = _ranks(argv[1:], default)
    if nproc is None:
        print(f"{USAGE}\ntridist bench: -n takes a number of ranks of at least 1, e.g. -n 2", file=sys.stderr)
        return 2
    if "-h" in rest or "--help" in rest:  # printed here, not once by every rank it would start
        print(f"-n RANKS: ranks to start (default {default})\n")
    elif "RANK" not in os.environ:
        from ..runtime.launcher import run

        return run(nproc, ["-m", "tridist", "bench", name, *rest])
    import importlib

    module = importlib.import_module(BENCHMARKS[name])
    return module.main(rest if name in SINGLE else [name, *rest])


def _ranks(rest: list[str], default: int = DEFAULT_RANKS) -> tuple[int | None, list[str]]:
    """(the ranks `-n` asks for, else `default`; the arguments without it); (None, rest) when its value
    is missing or not a positive integer. Under a launcher `-n` is dropped too: the launcher has
    started the ranks."""
    if "-n" not in rest:
        return default, rest
    i = rest.index("-n")
    try:
        nproc = int(rest[i + 1])
    except (IndexError, ValueError):
        return None, rest
    return (nproc, rest[:i] + rest[i + 2:]) if nproc >= 1 else (None, rest)
