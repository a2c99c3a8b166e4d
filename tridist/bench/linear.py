"""`tridist bench linear [--sweep]`: the decode GEMM (`tridist.ops.linear`) on one GPU, the
weight's bytes per call over its time against a device-to-device copy and cuBLAS, in the same run.

Shapes are the weights (N x K, bf16) of the models the decode step runs (issue 54): Qwen3-8B's
qkv, o_proj, gate_up (swiglu), down and logits; Llama-3-8B's gate_up, down and logits;
Qwen3-30B-A3B's attention qkv and o_proj and its logits; at M of 1, 8, 16, 32 and 64 rows. Per
shape and M:
- copy: the rate of a device-to-device copy of 1 GiB (`timing.copy_rate`), bytes read and
  written, timed once a run: the memory speed the decode step's bound divides by (DESIGN.md);
- linear: `tridist.ops.linear(x, w, activation=...)` with the policy's config; `GB/s` is the
  weight's bytes over its time, `of copy` that over the copy's rate (the target, issue 54:
  >= 0.85 on the MLP's and the logits' shapes);
- same bits: a second call gives the first's bits (the split-K fix-up sums in a fixed order, and
  its tile counters are back at zero);
- cuBLAS: `F.linear`, then for swiglu the epilogue in torch (`linear_gemm.reference`), the same
  weights; `vs cublas` is cuBLAS's time over linear's.
Each is a CUDA graph of calls that rotate among copies of the weight (as many as make a graph's
calls read at least ROTATE_BYTES, several times the 50-60 MB of L2), so that L2 is not what is
measured; warm-up, many repetitions, the median (`timing.op_us`). Every result is checked against
cuBLAS's first.

`--sweep` times instead a compact set of kernel configs (`KERNELS`: tensor cores or FMA, TMA or
pointers, block sizes, warps, stages) that fit in shared memory, at each split count of `SPLITS`
that gives the grid between half a program and MOST_PROGRAMS_PER_SM programs per SM, per shape
and M, each checked first (CUDA graphs of 20 calls, 5 repetitions); it prints every timing and
then the best per shape and M next to the policy's pick, so that one GPU call can set
`tridist.ops.gemm.linear_gemm.policy`. It stops early after `--budget-s` seconds (the shapes come
in order of importance). In the emulator (CPU) both check their results on small shapes and time
nothing.
"""
import argparse
import itertools
import math
import time

import torch
from triton.errors import TritonError

import tridist
from tridist.ops import linear, sizing
from tridist.ops.gemm.linear_gemm import Linear, policy, reference
from tridist.ops.gemm.linear_gemm.split_k import split_plan

from .results import error_line, print_row, relative_error, save, table
from .timing import copy_rate, one_gpu, op_us, time_us

# (name, N, K, activation): N is the weight's rows (2I for swiglu). The MLP's and the logits' first.
SHAPES = [
    ("qwen3-8b gate_up", 2 * 12288, 4096, "swiglu"),
    ("qwen3-8b down", 4096, 12288, None),
    ("qwen3-8b logits", 151936, 4096, None),
    ("llama3-8b gate_up", 2 * 14336, 4096, "swiglu"),
    ("llama3-8b down", 4096, 14336, None),
    ("llama3-8b logits", 128256, 4096, None),
    ("qwen3-8b qkv", 6144, 4096, None),
    ("qwen3-8b o_proj", 4096, 4096, None),
    ("qwen3-30b-a3b qkv", 5120, 2048, None),
    ("qwen3-30b-a3b o_proj", 2048, 4096, None),
    ("qwen3-30b-a3b logits", 151936, 2048, None),
]
ROWS = [1, 8, 16, 32, 64]
EMULATOR_SHAPES = [("small", 48, 40, None), ("small gate_up", 48, 40, "swiglu")]
ROTATE_BYTES = 256 << 20  # weights a graph's calls read before one comes round again: about 4x an H200's L2
TOLERANCE = {None: 2 ** -7, "swiglu": 2 ** -5}  # against cuBLAS, relative to the largest value (tests/test_linear.py)
TARGET = 0.85  # of the copy's rate, on the MLP's and the logits' shapes (issue 54)

# --sweep's kernel configs: (DOT, TMA, BLOCK_N, BLOCK_K, num_warps, num_stages). FMA only for one row.
KERNELS = [
    (True, True, 64, 128, 4, 4),
    (True, True, 64, 128, 4, 6),
    (True, True, 64, 64, 4, 8),
    (True, True, 64, 64, 4, 4),
    (True, True, 64, 256, 4, 3),
    (True, True, 128, 128, 8, 4),
    (True, True, 32, 256, 4, 4),
    (True, False, 64, 128, 4, 4),
    (False, True, 64, 128, 4, 4),
    (False, False, 32, 256, 4, 3),
    (False, False, 64, 128, 8, 1),
]
EMULATOR_KERNELS = [(True, False, 16, 16, 4, 1), (False, True, 16, 16, 4, 1)]
SPLITS = [1, 2, 4, 8, 16, 32]
MOST_PROGRAMS_PER_SM = 16  # --sweep's split counts give grids of at most this many programs per SM
SHARED_MEMORY = 227 << 10  # bytes a program may have on sm_90


def fits(config: dict, m: int, swiglu: bool) -> bool:
    """Whether `config`'s pipeline (num_stages of the weight's tiles, two with swiglu, and x's, in
    shared memory) fits in an SM's shared memory for m rows: Triton would compile it, then refuse
    the launch."""
    return policy.pipeline_bytes(config, m, swiglu) <= SHARED_MEMORY


def kernel_config(kernel: tuple, splits: int) -> dict:
    dot, tma, block_n, block_k, warps, stages = kernel
    return dict(DOT=dot, TMA=tma, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages, splits=splits)


def config_name(config: dict | None) -> str:
    if config is None:
        return "cublas"
    kind = ("dot" if config["DOT"] else "fma") + ("+tma" if config["TMA"] else "")
    return (f"{kind} N{config['BLOCK_N']} K{config['BLOCK_K']} w{config['num_warps']} s{config['num_stages']} "
            f"x{config['splits']}")


class Operands:
    """x and copies of one weight (N x K of `dtype`, scaled so outputs stay near 1): enough copies
    that a graph of calls reads ROTATE_BYTES on a GPU before a copy comes round again (one in the
    emulator). `rotating(fn)` is a call `fn(x, weight)` that takes the next copy each time."""

    def __init__(self, rows: int, k: int, dtype: torch.dtype, device: torch.device, seed: int):
        g = torch.Generator(device=device).manual_seed(seed)
        nbytes = rows * k * dtype.itemsize
        copies = max(1, math.ceil(ROTATE_BYTES / nbytes)) if device.type == "cuda" else 1
        self.weights = [(torch.randn(rows, k, generator=g, device=device) / k ** 0.5).to(dtype) for _ in range(copies)]
        self.nbytes, self.k, self.dtype, self.device, self.g = nbytes, k, dtype, device, g

    def x(self, m: int) -> torch.Tensor:
        return torch.randn(m, self.k, generator=self.g, device=self.device).to(self.dtype)

    def rotating(self, fn):
        turn = itertools.cycle(self.weights)
        return lambda x: fn(x, next(turn))


def check(what: str, out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, activation) -> float:
    """The relative error of `out` against cuBLAS's result; raises above TOLERANCE."""
    error = relative_error(out, reference(x, weight, None, activation))
    if not error <= TOLERANCE[activation]:
        raise AssertionError(f"linear {what}: relative error {error:.2e} against cuBLAS")
    return error


def run(shapes, rows: list[int], timed: bool) -> list[dict]:
    """A row per shape and M: linear checked against cuBLAS, then (if `timed`) both timed."""
    device = tridist.world().device
    copy = copy_rate(device) if timed else None  # bytes read and written per microsecond
    results = []
    for index, (name, n, k, activation) in enumerate(shapes):
        operands = Operands(n, k, torch.bfloat16, device, seed=index)
        for m in rows:
            x = operands.x(m)
            weight = operands.weights[0]
            out = linear(x, weight, activation=activation)
            op = Linear(m, n, k, torch.bfloat16, activation)
            row = {"shape": name, "N": n, "K": k, "M": m, "activation": activation or "",
                   "config": config_name(op.config), "programs": op.method.programs if op.method else 0,
                   "rel err": check(f"{name} M={m}", out, x, weight, activation),
                   "same bits": torch.equal(linear(x, weight, activation=activation), out)}
            op.free()
            if timed:
                call = operands.rotating(lambda x, w: linear(x, w, activation=activation))
                cublas = operands.rotating(lambda x, w: reference(x, w, None, activation))
                us, cublas_us = op_us(lambda: call(x)), op_us(lambda: cublas(x))
                row.update({"us": us, "GB/s": operands.nbytes / us / 1e3, "of copy": operands.nbytes / us / copy,
                            "cublas us": cublas_us, "cublas of copy": operands.nbytes / cublas_us / copy,
                            "vs cublas": cublas_us / us, "copy GB/s": copy / 1e3})
            results.append(row)
            print_row(row)
        del operands
    return results


def sweep(shapes, rows: list[int], timed: bool, budget_s: float = float("inf")) -> tuple[list[dict], list[dict]]:
    """Every config of `KERNELS` at each split count of `SPLITS` that gives between half a program
    and MOST_PROGRAMS_PER_SM programs per SM, and the policy's pick, per shape and M: checked, then (if `timed`)
    timed, each printed as it goes. Returns (every row, the best per shape and M with the policy's
    pick and its time beside it; where nothing is timed, the first checked). Configs that do not
    compile or launch here (shared memory, registers) are rows with their error. Stops after
    `budget_s` seconds."""
    device = tridist.world().device
    sms = sizing.programs_for(device)
    kernels = KERNELS if device.type == "cuda" else EMULATOR_KERNELS
    start = time.monotonic()
    every, best = [], []
    for index, (name, n, k, activation) in enumerate(shapes):
        operands = Operands(n, k, torch.bfloat16, device, seed=index)
        columns = n // 2 if activation == "swiglu" else n
        for m in rows:
            if time.monotonic() - start > budget_s:
                print(f"  budget of {budget_s:.0f} s spent: stopping before {name} M={m}", flush=True)
                return every, best
            x = operands.x(m)
            picked = Linear(m, n, k, torch.bfloat16, activation).config
            candidates = [picked]
            for kernel in kernels:
                config = kernel_config(kernel, 1)
                if (not config["DOT"] and m != 1) or not fits(config, m, activation == "swiglu"):
                    continue
                tiles = math.ceil(columns / config["BLOCK_N"])
                for splits in SPLITS:
                    actual, _ = split_plan(k, config["BLOCK_K"], splits)
                    programs = tiles * actual
                    config = {**config, "splits": splits}
                    if actual == splits and (splits == 1 or 2 * programs >= sms) and config != picked \
                            and programs <= MOST_PROGRAMS_PER_SM * sms:
                        candidates.append(config)
            rows_here = [_sweep_row(name, m, config, config == picked, operands, x, activation, timed)
                         for config in candidates]
            every += rows_here
            ran = [row for row in rows_here if row.get("checked")]
            if ran:
                top = min(ran, key=lambda row: row.get("us", 0.0))
                pick = rows_here[0]
                best.append({**top, "policy config": pick["config"], "policy us": pick.get("us")})
        del operands
    return every, best


def _sweep_row(name: str, m: int, config: dict, is_pick: bool, operands: Operands, x: torch.Tensor, activation,
               timed: bool) -> dict:
    row = {"shape": name, "M": m, "config": config_name(config), "policy": is_pick}
    weight = operands.weights[0]
    try:
        op = Linear(m, weight.shape[0], operands.k, torch.bfloat16, activation, config)
        row["programs"] = op.method.programs
        row["checked"] = check(f"{name} M={m} {row['config']}", op(x, weight), x, weight, activation) <= \
            TOLERANCE[activation]
        if timed:
            call = operands.rotating(lambda x, w: op(x, w))
            us = time_us(lambda: call(x), inner=20, repetitions=5, warmup=2, graph=True)
            row.update({"us": us, "GB/s": operands.nbytes / us / 1e3})
        op.free()
    except (AssertionError, RuntimeError, TritonError) as error:  # a config this GPU cannot run
        row["error"] = error_line(error)
    print_row(row)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tridist bench linear")
    parser.add_argument("--sweep", action="store_true", help="time KERNELS x SPLITS per shape and M (see the module)")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)),
                        help="M values, comma separated (default %(default)s)")
    parser.add_argument("--shapes", default="", help="names of SHAPES to run, comma separated (default: all)")
    parser.add_argument("--budget-s", type=float, default=float("inf"), help="--sweep stops after this many seconds")
    parser.add_argument("--out", default="benchmarks/results", help="folder for JSON results (default %(default)s)")
    args = parser.parse_args(argv)
    rows = [int(m) for m in args.rows.split(",")]
    wanted = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in {name for name, *_ in SHAPES}]
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}; name some of: {', '.join(name for name, *_ in SHAPES)}")
    w = one_gpu("linear")
    timed = w.device.type == "cuda"
    shapes = [s for s in SHAPES if not wanted or s[0] in wanted] if timed else EMULATOR_SHAPES
    extra = {"dtype": "bfloat16", "M values": rows, "rotate_bytes": ROTATE_BYTES, "target of copy": TARGET}
    if args.sweep:
        every, results = sweep(shapes, rows, timed, args.budget_s)
        columns = ["shape", "M", "config", "programs", "us", "GB/s", "policy config", "policy us"]
        extra["best"] = results
    else:
        every = results = run(shapes, rows, timed)
        columns = ["shape", "M", "config", "programs", "us", "GB/s", "of copy", "cublas us", "cublas of copy",
                   "vs cublas", "rel err", "same bits"]
    print(table(results, columns))
    if timed:
        print("saved", save("linear-sweep" if args.sweep else "linear", every, args.out, extra))
    tridist.finalize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
