"""`tridist bench gemm|ag_gemm|gemm_rs|gemm_ar`: the overlapped GEMMs against the same work done
one step after the other (NCCL + cuBLAS) and against PyTorch's fused symmetric-memory ops, in the
same run, after checking tridist's result against the sequential one.

Shapes are (M, N, K) of the whole layer, tensor-parallel over the ranks:
- ag_gemm: column-parallel; a_shard is M/world x K, b is K x N/world, out M x N/world.
- gemm_rs, gemm_ar: row-parallel; a is M x K/world, b is K/world x N; out M/world x N (rs) or M x N.
- gemm: the GEMM alone, on ag_gemm's local shape, every config against cuBLAS (torch.matmul).
The "GEMM alone" column is cuBLAS on the rank's local shape: the floor an overlapped op aims at.
"""
import argparse
import sys

import torch
import torch.distributed as dist

import tridist
from tridist import ops
from tridist.ops import gemm

from .results import save, table
from .timing import slowest, time_us

SHAPES = {
    "ag_gemm": [(1024, 8192, 8192), (4096, 8192, 8192), (8192, 8192, 8192), (16384, 8192, 8192), (8192, 28672, 8192)],
    "gemm_rs": [(1024, 8192, 8192), (4096, 8192, 8192), (8192, 8192, 8192), (16384, 8192, 8192), (8192, 28672, 8192)],
    "gemm_ar": [(32, 8192, 8192), (128, 8192, 8192), (128, 28672, 8192)],
}
SHAPES["gemm"] = SHAPES["ag_gemm"]
GRAPH_LIMIT_US = 1000.0  # shorter ops are timed again as CUDA-graph replays


def _shape(spec: str) -> tuple[int, int, int]:
    m, n, k = (int(v) for v in spec.lower().split("x"))
    return m, n, k


def _time(fn) -> float:
    """Slowest rank's median; quick ops again inside a CUDA graph, where launches cost nothing."""
    us = slowest(time_us(fn, inner=5, repetitions=10, warmup=3))
    if us < GRAPH_LIMIT_US:
        us = slowest(time_us(fn, inner=20, repetitions=15, warmup=3, graph=True))
    return us


def _torch_fused(name: str, a, b):
    """PyTorch's fused symmetric-memory op for `name`, or None where it cannot run here."""
    import torch.distributed._symmetric_memory as symm_mem

    group = dist.group.WORLD.group_name
    try:
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group)
        if name == "ag_gemm":
            fn = lambda: torch.ops.symm_mem.fused_all_gather_matmul(a, [b], 0, group)  # noqa: E731
        elif name == "gemm_rs":
            fn = lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, group)  # noqa: E731
        else:
            return None
        fn()
        torch.cuda.synchronize()
        return fn
    except Exception as error:  # noqa: BLE001 - reported as a missing column, not a failure
        print(f"(PyTorch fused {name} unavailable: {type(error).__name__}: {error})", file=sys.stderr)
        return None


def _operands(name: str, m: int, n: int, k: int, dtype):
    w = tridist.world()
    p = w.world_size
    if name in ("ag_gemm", "gemm"):
        a = torch.randn(m // p, k, device=w.device).to(dtype)
        b = torch.randn(k, n // p, device=w.device).to(dtype)
    else:
        a = torch.randn(m, k // p, device=w.device).to(dtype)
        b = torch.randn(k // p, n, device=w.device).to(dtype)
    return a / k ** 0.25, b / k ** 0.25  # sums of K products stay near 1


def _sequential(name: str, a, b):
    w = tridist.world()
    if name == "ag_gemm":
        gathered = torch.empty(a.shape[0] * w.world_size, a.shape[1], dtype=a.dtype, device=a.device)

        def run():
            dist.all_gather_into_tensor(gathered, a)
            return gathered @ b
    elif name == "gemm_rs":
        out = torch.empty(a.shape[0] // w.world_size, b.shape[1], dtype=a.dtype, device=a.device)

        def run():
            dist.reduce_scatter_tensor(out, a @ b)
            return out
    else:
        def run():
            product = a @ b
            dist.all_reduce(product)
            return product
    return run


def _local_gemm_us(name: str, a, b, config: dict | None = None) -> float:
    """This rank's GEMM with no communication: cuBLAS, or tridist's GEMM with `config`."""
    if name == "ag_gemm":
        a = torch.randn(a.shape[0] * tridist.world().world_size, a.shape[1], device=a.device).to(a.dtype)
    if config is None:
        return _time(lambda: a @ b)
    out = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
    return _time(lambda: gemm.matmul(a, b, out=out, config=config))


def _checked(name: str, op, a, b, expected) -> float:
    """Microseconds per call of `op`, once its result matches `expected`."""
    result = op(a, b)
    torch.cuda.synchronize()
    error = slowest(((result.float() - expected).abs().max() / expected.abs().max()).item())
    if error > 2e-2:
        raise AssertionError(f"{name} {tuple(a.shape)} x {tuple(b.shape)}: relative error {error:.2e} against "
                             "NCCL + cuBLAS")
    return _time(lambda: op(a, b))


def run_overlap(name: str, shapes, dtype, config) -> list[dict]:
    """Each shape: tridist (for ag_gemm with copy-engine and with SM communication), the
    sequential NCCL + cuBLAS, PyTorch fused where it runs, and the local GEMMs alone."""
    w = tridist.world()
    rows = []
    for m, n, k in shapes:
        a, b = _operands(name, m, n, k, dtype)
        sizes = (a.shape[0], a.shape[1], b.shape[1], dtype)
        variants = {"ag_gemm": {"": lambda: ops.AllGatherGEMM(*sizes, comm="ce", config=config),
                                " sm": lambda: ops.AllGatherGEMM(*sizes, comm="sm", config=config)},
                    "gemm_rs": {"": lambda: ops.GemmReduceScatter(*sizes, config=config)},
                    "gemm_ar": {"": lambda: ops.GemmAllReduce(*sizes, config=config)}}[name]
        sequential = _sequential(name, a, b)
        expected = sequential().float()
        row = {"shape": f"{m}x{n}x{k}"}
        for suffix, build in variants.items():
            op = build()
            row[f"config{suffix}"] = _config_name(op.config)
            row[f"tridist{suffix} us"] = _checked(name, op, a, b, expected)
            if name == "ag_gemm" and suffix == "":  # the shard already in the symmetric buffer: no copy
                op.input_buffer().copy_(a)
                row["tridist in place us"] = _checked(name, op, op.input_buffer(), b, expected)
            tridist.barrier_all()
            op.free()
        row["sequential us"] = _time(sequential)
        fused = _torch_fused(name, a, b)
        if fused is not None:
            row["torch fused us"] = _time(fused)
        row["GEMM alone us"] = _local_gemm_us(name, a, b)
        row["tridist GEMM alone us"] = _local_gemm_us(name, a, b, _config_of(row["config"]))
        row["vs sequential"] = row["sequential us"] / row["tridist us"]
        if fused is not None:
            row["vs torch fused"] = row["torch fused us"] / row["tridist us"]
        row["/ GEMM alone"] = row["tridist us"] / row["GEMM alone us"]
        if "tridist in place us" in row:
            row["in place / GEMM alone"] = row["tridist in place us"] / row["GEMM alone us"]
        rows.append(row)
        if w.rank == 0:
            print(f"  {name} {row['shape']}: {row['tridist us']:.1f} us, sequential {row['sequential us']:.1f} us",
                  flush=True)
    return rows


def _config_name(config: dict) -> str:
    return (f"{config['BLOCK_M']}x{config['BLOCK_N']}x{config['BLOCK_K']} s{config['num_stages']} "
            f"w{config['num_warps']}{' flat' if config['FLATTEN'] else ''}")


def _config_of(name: str) -> dict:
    return next(c for c in gemm.GPU_CONFIGS if _config_name(c) == name)


def run_gemm(shapes, dtype) -> list[dict]:
    """tridist's GEMM alone, each config, against cuBLAS on the local shape of ag_gemm."""
    w = tridist.world()
    rows = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=w.device).to(dtype)
        b = torch.randn(k, n // w.world_size, device=w.device).to(dtype)
        flops = 2 * m * k * b.shape[1]
        cublas_us = _time(lambda: a @ b)
        expected = (a @ b).float()
        for config in gemm.configs(w.device):
            out = gemm.matmul(a, b, config=config)
            error = ((out.float() - expected).abs().max() / expected.abs().max()).item()
            if error > 2e-2:
                raise AssertionError(f"matmul {m}x{b.shape[1]}x{k} {config}: relative error {error:.2e}")
            us = _time(lambda: gemm.matmul(a, b, out=out, config=config))
            rows.append({"shape": f"{m}x{b.shape[1]}x{k}", "config": _config_name(config), "tridist us": us,
                         "cuBLAS us": cublas_us, "TFLOP/s": flops / us / 1e6, "vs cuBLAS": cublas_us / us})
            if w.rank == 0:
                print(f"  gemm {rows[-1]['shape']} {rows[-1]['config']}: {us:.1f} us, cuBLAS {cublas_us:.1f} us",
                      flush=True)
    return rows


def plot(name: str, rows: list[dict], path: str, world_size: int) -> None:
    """Microseconds per shape, one bar per timed column (skipped without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    columns = [c for c in _columns(rows) if c.endswith(" us")]
    figure, axis = plt.subplots(figsize=(max(7, 1.6 * len(rows)), 4))
    width = 0.8 / len(columns)
    for i, column in enumerate(columns):
        axis.bar([x + i * width for x in range(len(rows))], [r.get(column, 0) for r in rows], width,
                 label=column.removesuffix(" us"))
    axis.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))], [r["shape"] for r in rows], fontsize=8)
    axis.set_yscale("log")
    axis.set_ylabel("us (lower is better)")
    axis.set_title(f"{name}, {world_size} ranks")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tridist bench <gemm|ag_gemm|gemm_rs|gemm_ar>")
    parser.add_argument("op", choices=list(SHAPES))
    parser.add_argument("--shapes", default=None, help="MxNxK of the whole layer, comma separated")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--tune", action="store_true", help="tune each op's GEMM config first (tridist.tune)")
    parser.add_argument("--out", default="benchmarks/results", help="folder for JSON results")
    args = parser.parse_args(argv)
    w = tridist.init()
    if w.backend != "nvshmem":
        raise SystemExit("the GEMM benchmarks time GPUs against cuBLAS and NCCL; run them on a GPU box")
    shapes = [_shape(s) for s in args.shapes.split(",")] if args.shapes else SHAPES[args.op]
    dtype = getattr(torch, args.dtype)
    config = "tune" if args.tune else None
    rows = run_gemm(shapes, dtype) if args.op == "gemm" else run_overlap(args.op, shapes, dtype, config)
    if w.rank == 0:
        print(table(rows, list(rows[0]) if args.op == "gemm" else _columns(rows)))
        path = save(args.op, rows, args.out, {"world_size": w.world_size, "dtype": args.dtype, "tuned": args.tune})
        plot(args.op, rows, path.replace(".json", ".png"), w.world_size)
        print(f"saved {path}")
    tridist.finalize()
    return 0


def _columns(rows: list[dict]) -> list[str]:
    columns = []
    for row in rows:
        columns += [c for c in row if c not in columns]
    return columns


if __name__ == "__main__":
    raise SystemExit(main())
