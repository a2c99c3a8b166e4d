"""`tridist bench torch_fused`: PyTorch's fused symmetric-memory ops, `fused_all_gather_matmul` and
`fused_matmul_reduce_scatter`, timed in a process where tridist is never initialised.

Why a process of its own: tridist puts PyTorch's symmetric memory on its NVSHMEM backend, whose
allocator refuses the group name these ops allocate their workspace with ("must not be called with
a group_name"). Here PyTorch keeps its default CUDA backend. `tridist bench ag_gemm|gemm_rs` then
read the JSON saved here into their "torch fused us" column, when it records the same run id as
they do (TRIDIST_BENCH_RUN, set for both: `results.latest`).

Shapes and operands follow `overlap.py`: (M, N, K) of the whole layer; ag_gemm's a_shard is
M/world x K and b K x N/world, gemm_rs's a is M x K/world and b K/world x N. Each op's result is
checked against NCCL + cuBLAS (`overlap.TOLERANCE`) before it is timed like every other column.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tridist.bench.torch_fused \\
        [--shapes 8192x8192x8192,...] [--out benchmarks/results]
or `tridist bench torch_fused -n 2 [options]`, which starts the ranks the same way.
"""
import argparse
import os
import sys
import warnings

import torch
import torch.distributed as dist

# Imported for their helpers only: none of these modules initialises tridist or NVSHMEM on import.
from ..runtime.nvshmem import SAFE_ENVIRONMENT
from . import shared_gpu
from .overlap import SHAPES, TORCH_FUSED, check, operands, parse_shapes, sequential, torch_fused_column
from .results import save, table
from .timing import all_ranks, op_us

OPS = ("ag_gemm", "gemm_rs")


def default_shapes() -> list[tuple[int, int, int]]:
    """The shapes `tridist bench ag_gemm` and `gemm_rs` run by default, each once."""
    return list(dict.fromkeys(shape for op in OPS for shape in SHAPES[op]))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tridist bench torch_fused",
        description="PyTorch's fused all-gather+matmul and matmul+reduce-scatter, in a process without tridist")
    parser.add_argument("--shapes", type=parse_shapes, default=None,
                        help="MxNxK of the whole layer, comma separated (default: ag_gemm's and gemm_rs's)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="default %(default)s")
    parser.add_argument("--out", default="benchmarks/results", help="folder for the JSON results (default %(default)s)")
    args = parser.parse_args(argv)
    args.shapes = args.shapes or default_shapes()
    return args


def _init() -> tuple[int, torch.device, str]:
    """torch.distributed on NCCL, one GPU per rank, and the group name the fused ops take."""
    if "RANK" not in os.environ or "LOCAL_RANK" not in os.environ:
        raise SystemExit("tridist bench torch_fused: start it with a launcher, e.g. `python -m torch.distributed.run "
                         "--standalone --nproc-per-node 2 -m tridist.bench.torch_fused` or `tridist bench torch_fused "
                         "-n 2`")
    # Before NCCL or symmetric memory read them: NVLink multicast must stay unused on our machines.
    os.environ.update(SAFE_ENVIRONMENT)
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    import torch.distributed._symmetric_memory as symm_mem

    group = dist.group.WORLD.group_name
    try:
        # PyTorch's default; named so that a TORCH_SYMMMEM=NVSHMEM left in the environment cannot
        # bring back the failure this process exists to avoid.
        symm_mem.set_backend("CUDA")
    except Exception as error:  # noqa: BLE001 - the backend it has may still work; the JSON records which
        print(f"(rank {dist.get_rank()}: symm_mem.set_backend('CUDA') failed: {error})", file=sys.stderr)
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        # Needed by older releases; newer ones deprecate it (a FutureWarning) and set the group up themselves.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group)
    return dist.get_rank(), device, group


def _fused(name: str, a, b, group: str):
    """A call of PyTorch's fused op for `name` that returns what tridist's op returns."""
    if name == "ag_gemm":
        # (A_shard, Bs, gather_dim, group_name) -> (gathered A, [A @ B for B in Bs])
        return lambda: torch.ops.symm_mem.fused_all_gather_matmul(a, [b], 0, group)[1][0]
    # (A, B, reduce_op, scatter_dim, group_name) -> rows [rank * M/world, (rank + 1) * M/world) of the sum
    return lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, group)


def _measure(name: str, shape: tuple[int, int, int], dtype, device, group: str) -> float:
    """Microseconds per call of PyTorch's fused `name` (the slowest rank), once its result is right."""
    a, b, scales = operands(name, *shape, dtype, dist.get_world_size(), device)
    expected = sequential(name, a, b, scales)().float()
    fused = _fused(name, a, b, group)
    check(f"torch fused {name}", fused(), a, b, expected)
    return op_us(fused)


def run(shapes, dtype, device, group: str) -> tuple[list[dict], list[str]]:
    """One row per shape, and a line per op that could not be measured (its value left out)."""
    rank = dist.get_rank()
    rows, failures = [], []
    for shape in shapes:
        row = {"shape": "x".join(map(str, shape))}
        for name in OPS:
            try:
                us = _measure(name, shape, dtype, device, group)
            except Exception as error:  # noqa: BLE001 - one op failing must not lose the others' numbers
                us = None
                failures.append(f"{name} {row['shape']}: {type(error).__name__}: {error}")
                print(f"rank {rank}: torch fused {failures[-1]}", file=sys.stderr, flush=True)
            # A value only where every rank measured one, so that rank 0 saves what all of them agree on.
            if all_ranks(us is not None):
                row[torch_fused_column(name)] = us
            torch.cuda.empty_cache()
        rows.append(row)
        if rank == 0:
            print(f"  torch fused {row['shape']}: " + ", ".join(
                f"{name} {row[torch_fused_column(name)]:.1f} us" if torch_fused_column(name) in row else f"{name} -"
                for name in OPS), flush=True)
    return rows, failures


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tridist bench torch_fused: no CUDA GPUs here; PyTorch's fused symmetric-memory ops run "
                         "only on GPUs")
    if shared_gpu.shared():
        # Before NCCL would refuse: this benchmark is a baseline only, with nothing of tridist's to check.
        if os.environ.get("RANK", "0") == "0":
            print(f"tridist bench torch_fused: skipped: {shared_gpu.ranks_per_gpu()} ranks share each GPU, and "
                  "PyTorch's fused ops need NCCL, which refuses two ranks on one GPU (no speed claim either way)")
        return 0
    rank, device, group = _init()
    import torch.distributed._symmetric_memory as symm_mem

    rows, failures = run(args.shapes, getattr(torch, args.dtype), device, group)
    if rank == 0:
        print(table(rows, ["shape", *(torch_fused_column(name) for name in OPS)]))
        path = save(TORCH_FUSED, rows, args.out, {
            "world_size": dist.get_world_size(), "dtype": args.dtype,
            "symm_mem backend": symm_mem.get_backend(device) if hasattr(symm_mem, "get_backend") else None,
            "note": "PyTorch's fused ops in a process without tridist; read by `tridist bench ag_gemm|gemm_rs`",
            "failures": failures})
        print(f"saved {path}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
