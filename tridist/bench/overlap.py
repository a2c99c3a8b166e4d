"""`tridist bench gemm|ag_gemm|gemm_rs|gemm_ar`: the overlapped GEMMs against the same work done
one step after the other (NCCL + cuBLAS) and against PyTorch's fused symmetric-memory ops, in the
same run, after checking tridist's result against the sequential one.

PyTorch's fused ops cannot run in this process (they refuse the NVSHMEM backend tridist puts
PyTorch's symmetric memory on): `tridist bench torch_fused` measures them in a process of its own,
and the "torch fused us" column here is read from the JSON it saved in the same run: the same
TRIDIST_BENCH_RUN, an id that both commands record (scripts/gpu_suite.sh sets one for its
benchmarks), on this device today. Without a run id there is no such column.

Shapes are (M, N, K) of the whole layer, tensor-parallel over the ranks:
- ag_gemm: column-parallel; a_shard is M/world x K, b is K x N/world, out M x N/world.
- gemm_rs, gemm_ar: row-parallel; a is M x K/world, b is K/world x N; out M/world x N (rs) or M x N.
- gemm: the GEMM alone, on ag_gemm's local shape, every config against cuBLAS (torch.matmul).
The "GEMM alone" column is cuBLAS on the rank's local shape: the floor an overlapped op aims at.
With `--dtype float8_e4m3fn` the operands are fp8 with per-tensor scales (b column-major) and
cuBLAS is torch._scaled_mm with a bf16 out; PyTorch's fused ops have no fp8 column.
"""
import argparse
import os

import torch
import torch.distributed as dist

import tridist
from tridist import ops
from tridist.ops import gemm
from tridist.ops.gemm import policy as gemm_policy

from . import shared_gpu
from .results import RUN_VARIABLE, latest, relative_error, save, table, title
from .timing import op_us, slowest

SHAPES = {
    "ag_gemm": [(1024, 8192, 8192), (4096, 8192, 8192), (8192, 8192, 8192), (16384, 8192, 8192), (8192, 28672, 8192)],
    "gemm_rs": [(1024, 8192, 8192), (4096, 8192, 8192), (8192, 8192, 8192), (16384, 8192, 8192), (8192, 28672, 8192)],
    "gemm_ar": [(32, 8192, 8192), (128, 8192, 8192), (128, 28672, 8192)],
}
SHAPES["gemm"] = SHAPES["ag_gemm"]
TOLERANCE = 2e-2  # largest |error| / largest |expected| accepted for bf16/fp16 against NCCL + cuBLAS
TORCH_FUSED = "torch_fused"  # the results name `tridist bench torch_fused` saves under


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """'MxNxK,MxNxK' -> [(M, N, K), ...]; an argparse `type`, so a bad list fails with its reason."""
    shapes = []
    for spec in text.split(","):
        parts = spec.strip().lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"shape {spec.strip()!r}: write M x N x K as three positive integers, "
                                             "e.g. 8192x8192x8192")
        shapes.append(tuple(int(p) for p in parts))
    return shapes


def operands(name: str, m: int, n: int, k: int, dtype, world_size: int, device):
    """This rank's inputs for layer shape (M, N, K) split over `world_size` ranks (see the top):
    (a, b, scales), scales () for 16-bit operands and (scale_a, scale_b) for fp8, the same on every
    rank (ag_gemm's scale_a must be)."""
    split = {"ag_gemm": "MN", "gemm": "MN", "gemm_rs": "MK", "gemm_ar": "K"}[name]
    if any(dict(zip("MNK", (m, n, k)))[size] % world_size for size in split):
        raise ValueError(f"{name} {m}x{n}x{k}: {' and '.join(split)} must be divisible by the {world_size} ranks")
    p = world_size
    rows, inner, cols = (m // p, k, n // p) if name in ("ag_gemm", "gemm") else (m, k // p, n)
    # sums of K products stay near 1
    a = (torch.randn(rows, inner, device=device) / k ** 0.25).to(dtype)
    if dtype != gemm.FP8:
        return a, (torch.randn(inner, cols, device=device) / k ** 0.25).to(dtype), ()
    b = (torch.randn(cols, inner, device=device) / k ** 0.25).to(dtype).t()
    return a, b, (torch.tensor([0.5], device=device), torch.tensor([0.25], device=device))


def product(a, b, scales):
    """a @ b by cuBLAS: torch._scaled_mm for fp8 operands (bf16 out)."""
    if scales:
        return torch._scaled_mm(a, b, *scales, out_dtype=torch.bfloat16)
    return a @ b


def sequential(name: str, a, b, scales):
    """The same op as NCCL and cuBLAS one after the other: the reference and the baseline. Where
    ranks share a GPU the communication goes through the host (`shared_gpu`): a reference only."""
    world_size = dist.get_world_size()
    if name == "ag_gemm":
        gathered = torch.empty(a.shape[0] * world_size, a.shape[1], dtype=a.dtype, device=a.device)

        def run():
            shared_gpu.all_gather(gathered, a)
            return product(gathered, b, scales)
    elif name == "gemm_rs":
        out = torch.empty(a.shape[0] // world_size, b.shape[1], dtype=gemm.out_dtype(a.dtype), device=a.device)

        def run():
            shared_gpu.reduce_scatter(out, product(a, b, scales))
            return out
    else:
        def run():
            total = product(a, b, scales)
            shared_gpu.all_reduce(total)
            return total
    return run


def _local_gemm_us(name: str, a, b, scales, config: dict | None = None) -> float:
    """This rank's GEMM with no communication: cuBLAS, or tridist's GEMM with `config`."""
    if name == "ag_gemm":
        a = torch.randn(a.shape[0] * tridist.world().world_size, a.shape[1], device=a.device).to(a.dtype)
    if config is None:
        return op_us(lambda: product(a, b, scales))
    out = torch.empty(a.shape[0], b.shape[1], dtype=gemm.out_dtype(a.dtype), device=a.device)
    return op_us(lambda: gemm.matmul(a, b, out, config, *scales))


def check(name: str, result, a, b, expected, against: str = "NCCL + cuBLAS") -> None:
    """Raises on every rank when any rank's `result` is further than TOLERANCE from `expected`."""
    error = slowest(relative_error(result, expected))
    if error > TOLERANCE:
        raise AssertionError(f"{name} {tuple(a.shape)} x {tuple(b.shape)}: relative error {error:.2e} against "
                             f"{against}")


def _checked(name: str, op, a, b, scales, expected) -> float:
    """Microseconds per call of `op`, once its result matches `expected`."""
    check(name, op(a, b, None, *scales), a, b, expected)
    return op_us(lambda: op(a, b, None, *scales))


def run_overlap(name: str, shapes, dtype, config, torch_fused: dict | None = None,
                baselines: bool = True) -> list[dict]:
    """Each shape: tridist (ag_gemm with copy-engine and with SM communication, gemm_ar one-shot
    and in LL packets), the sequential NCCL + cuBLAS, PyTorch fused where `torch_fused` (shape ->
    us) has it, and the local GEMMs alone. Without `baselines` (ranks sharing a GPU) the
    sequential op is the reference only, not timed, and no ratio is given."""
    w = tridist.world()
    torch_fused = torch_fused or {}
    rows = []
    for m, n, k in shapes:
        a, b, scales = operands(name, m, n, k, dtype, w.world_size, w.device)
        sizes = (a.shape[0], a.shape[1], b.shape[1], dtype)
        variants = {"ag_gemm": {"": lambda: ops.AllGatherGEMM(*sizes, comm="ce", config=config),
                                " sm": lambda: ops.AllGatherGEMM(*sizes, comm="sm", config=config)},
                    "gemm_rs": {"": lambda: ops.GemmReduceScatter(*sizes, config=config)},
                    "gemm_ar": {"": lambda: ops.GemmAllReduce(*sizes, "one_shot", config=config),
                                " ll": lambda: ops.GemmAllReduce(*sizes, "ll", config=config)}}[name]
        baseline = sequential(name, a, b, scales)
        expected = baseline().float()
        row = {"shape": f"{m}x{n}x{k}"}
        for suffix, build in variants.items():
            op = build()
            row[f"config{suffix}"] = _config_name(op.config)
            row[f"tridist{suffix} us"] = _checked(name, op, a, b, scales, expected)
            tridist.barrier_all()
            op.free()
        if baselines:
            row["sequential us"] = op_us(baseline)
        if row["shape"] in torch_fused:
            row["torch fused us"] = torch_fused[row["shape"]]
        row["GEMM alone us"] = _local_gemm_us(name, a, b, scales)
        row["tridist GEMM alone us"] = _local_gemm_us(name, a, b, scales, _config_of(row["config"], dtype))
        if baselines:
            row["vs sequential"] = row["sequential us"] / row["tridist us"]
            if "torch fused us" in row:
                row["vs torch fused"] = row["torch fused us"] / row["tridist us"]
            row["/ GEMM alone"] = row["tridist us"] / row["GEMM alone us"]
        rows.append(row)
        if w.rank == 0:
            print(f"  {name} {row['shape']}: {row['tridist us']:.1f} us"
                  + (f", sequential {row['sequential us']:.1f} us" if baselines else ""), flush=True)
    return rows


def torch_fused_column(name: str) -> str:
    """The column of `tridist bench torch_fused`'s JSON that holds PyTorch's fused op for `name`."""
    return f"torch fused {name} us"


def _torch_fused_us(name: str, folder: str, world_size: int, dtype: str) -> tuple[dict, str | None]:
    """PyTorch's fused op for `name`, microseconds per shape, from the newest torch_fused JSON of
    this run (`results.latest`) on as many ranks in `dtype`, and a sentence saying where they come from."""
    if name not in ("ag_gemm", "gemm_rs"):
        return {}, None
    found = latest(TORCH_FUSED, folder, world_size=world_size, dtype=dtype)
    if found is None:
        return {}, None
    path, data = found
    column = torch_fused_column(name)
    us = {row["shape"]: row[column] for row in data["rows"] if row.get(column) is not None}
    return us, (f"from {os.path.basename(path)}: measured by tridist.bench.torch_fused in a separate process of "
                f"the same run ({RUN_VARIABLE}={data['run']}; that process never starts tridist, so PyTorch's "
                "symmetric memory stays on its CUDA backend)")


def _config_name(config: dict) -> str:
    return (f"{config['BLOCK_M']}x{config['BLOCK_N']}x{config['BLOCK_K']} s{config['num_stages']} "
            f"w{config['num_warps']}{' flat' if config['FLATTEN'] else ''}")


def _config_of(name: str, dtype) -> dict:
    return next(c for c in gemm.configs(torch.device("cuda"), dtype=dtype) if _config_name(c) == name)


def run_gemm(shapes, dtype) -> list[dict]:
    """tridist's GEMM alone, each config, against cuBLAS on the local shape of ag_gemm."""
    w = tridist.world()
    rows = []
    for m, n, k in shapes:
        a, b, scales = operands("gemm", w.world_size * m, n, k, dtype, w.world_size, w.device)
        flops = 2 * m * k * b.shape[1]
        cublas_us = op_us(lambda: product(a, b, scales))
        expected = product(a, b, scales).float()
        for config in gemm.configs(w.device, dtype=dtype):
            out = gemm.matmul(a, b, None, config, *scales)
            check(f"matmul {_config_name(config)}", out, a, b, expected, against="cuBLAS")
            us = op_us(lambda: gemm.matmul(a, b, out, config, *scales))
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
    axis.set_title(title(f"{name}, {world_size} ranks"))
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tridist bench <gemm|ag_gemm|gemm_rs|gemm_ar>")
    parser.add_argument("op", choices=list(SHAPES))
    parser.add_argument("--shapes", type=parse_shapes, default=None,
                        help="MxNxK of the whole layer, comma separated (default: the op's in SHAPES, "
                             "tridist/bench/overlap.py)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float8_e4m3fn"],
                        help="default %(default)s; float8_e4m3fn: per-tensor scales, bf16 out")
    parser.add_argument("--tune", action="store_true", help="tune each op's GEMM config first (tridist.tune)")
    parser.add_argument("--ce-order", choices=("in_turn", "at_once"), default=None,
                        help="ag_gemm's comm='ce': push the shard to one peer after another or to all at once "
                             "(tridist.ops.gemm.policy.CE_PUSH_IN_TURN; default: the policy's)")
    parser.add_argument("--out", default="benchmarks/results",
                        help="folder for JSON results, and where `tridist bench torch_fused` left its own "
                             "(default %(default)s)")
    args = parser.parse_args(argv)
    if args.ce_order:
        gemm_policy.CE_PUSH_IN_TURN = args.ce_order == "in_turn"
    w = tridist.init()
    if w.backend != "nvshmem":
        raise SystemExit("the GEMM benchmarks time GPUs against cuBLAS and NCCL; run them on a GPU box")
    shared = shared_gpu.announce(f"tridist bench {args.op}", w.rank)
    shapes = args.shapes or SHAPES[args.op]
    dtype = getattr(torch, args.dtype)
    config = "tune" if args.tune else None
    torch_fused, source = ({}, None) if shared else _torch_fused_us(args.op, args.out, w.world_size, args.dtype)
    rows = (run_gemm(shapes, dtype) if args.op == "gemm" else
            run_overlap(args.op, shapes, dtype, config, torch_fused, baselines=not shared))
    if w.rank == 0:
        print(table(rows, list(rows[0]) if args.op == "gemm" else _columns(rows)))
        extra = {"world_size": w.world_size, "dtype": args.dtype, "tuned": args.tune,
                 "ce order": "in_turn" if gemm_policy.CE_PUSH_IN_TURN else "at_once"}
        if source:
            extra["torch fused us"] = source
            print(f"torch fused us: {source}")
        elif args.op in ("ag_gemm", "gemm_rs") and dtype != gemm.FP8 and not shared:
            print(f"(no {TORCH_FUSED} results of {w.world_size} ranks in {args.dtype} of this run in {args.out}: "
                  f"run `tridist bench torch_fused` first, both with the same {RUN_VARIABLE}, for the "
                  "'torch fused us' column)")
        path = save(args.op if args.dtype == "bfloat16" else f"{args.op}-{args.dtype}", rows, args.out, extra)
        plot(args.op, rows, path.replace(".json", ".png"), w.world_size)
        print(f"saved {path}" + (f" ({shared_gpu.SPEED}: no speed claim)" if shared else ""))
    tridist.finalize()
    return 0


def _columns(rows: list[dict]) -> list[str]:
    columns = []
    for row in rows:
        columns += [c for c in row if c not in columns]
    return columns


if __name__ == "__main__":
    raise SystemExit(main())
