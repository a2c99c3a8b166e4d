"""`tridist bench all_reduce_rms_norm`: the fused all-reduce, residual add and RMSNorm of a decoder
layer (`tridist.ops.all_reduce_rms_norm`) against the same steps in torch, in the same run.

Shapes are T x hidden (T rows of the residual stream, bf16 by default): hidden 2048, 4096 and 8192,
T 1, 8, 64 and 256. Every rank's x is its own; residual and weight are the same on every rank. The
op's result is checked first, on every rank: the new residual bit for bit against the rank-order
fp32 sum of the gathered x's plus the residual, rounded once, and y within a unit in the last place
of transformers' RMSNorm of it (`tridist.ops.norm`'s docstring says when a bit may differ).
Then, on GPUs, each is timed with CUDA events around CUDA-graph replays (`timing.interleaved_us`:
warm-up, many repetitions, the median, in turns):
- world size 1: the op (its `local` method) against torch's eager `residual + x` and transformers'
  RMSNorm formula (`torch eager us`), and the same function `torch.compile`d for the shape
  (`torch compile us`); target (issue 54): the op at least TARGET x faster than torch eager at T <=
  TARGET_MAX_TOKENS (`targets met`).
- several ranks: against NCCL's all-reduce of x in place then torch's add and norm (`NCCL + torch
  us`), and PyTorch symmetric memory's one-shot all-reduce then the same (`torch one_shot + torch
  us`). Where ranks share a GPU those baselines do not run (NCCL refuses) and nothing is claimed.
In the emulator every check runs and nothing is timed.
"""
import argparse
import sys

import torch
import torch.distributed as dist

import tridist
from tridist import ops

from . import shared_gpu
from .results import relative_error, save, table
from .timing import all_ranks, interleaved_us, slowest

HIDDEN = (2048, 4096, 8192)
TOKENS = (1, 8, 64, 256)
EPS = 1e-6
TARGET = 2.0
TARGET_MAX_TOKENS = 64
# y against the reference, relative to each element: where the variance's last fp32 bit differs, a
# 16-bit y rounds the other way (one unit in the last place); an fp32 y moves by a few units.
ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -20}
BASELINE_TOLERANCE = 2e-2  # largest |error| / largest |expected| of the torch baselines (NCCL sums in 16 bits)


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' `LlamaRMSNorm` / `Qwen3RMSNorm` forward, written out."""
    input_dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(input_dtype)


def torch_add_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused steps in torch: `residual + x`, then the norm: (y, new_residual)."""
    hidden = residual + x
    return rms_norm(hidden, weight, eps), hidden


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'1x4096,64x8192' -> [(1, 4096), (64, 8192)] (T x hidden); an argparse `type`."""
    shapes = []
    for spec in text.split(","):
        parts = spec.strip().lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() for p in parts) or int(parts[1]) < 1:
            raise argparse.ArgumentTypeError(f"shape {spec.strip()!r}: write T x hidden, e.g. 8x4096")
        shapes.append((int(parts[0]), int(parts[1])))
    return shapes


def _inputs(tokens: int, hidden: int, dtype, device, rank: int):
    """(this rank's x, residual, weight): x from this rank's seed, the others the same everywhere."""
    g = torch.Generator(device=device).manual_seed(1000 + rank)
    x = torch.randn(tokens, hidden, generator=g, device=device).to(dtype)
    g.manual_seed(7)
    residual = torch.randn(tokens, hidden, generator=g, device=device).to(dtype)
    weight = torch.randn(hidden, generator=g, device=device).to(dtype)
    return x, residual, weight


def reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(y, new_residual) as the op's contract says: every rank's x gathered (exactly) and summed in
    fp32 in rank order, plus the residual, rounded once; then transformers' norm."""
    world_size = tridist.world().world_size
    gathered = torch.empty((world_size, *x.shape), dtype=x.dtype, device=x.device)
    if world_size == 1:
        gathered[0] = x
    else:
        shared_gpu.all_gather(gathered.view(-1, *x.shape[1:]), x)
    total = gathered[0].float()
    for part in gathered[1:]:
        total = total + part.float()
    new_residual = (total + residual.float()).to(x.dtype)
    return rms_norm(new_residual, weight, eps), new_residual


def check(what: str, y, new_residual, expected_y, expected_residual) -> None:
    """Raises on every rank unless, on every rank, the new residual is exact and y within ULP."""
    ok = torch.equal(new_residual, expected_residual) and torch.allclose(
        y.float(), expected_y.float(), rtol=ULP[y.dtype], atol=ULP[y.dtype] * 1e-3)
    if not all_ranks(ok):
        raise AssertionError(f"all_reduce_rms_norm {what}: wrong result on some rank")


def _check_baseline(what: str, result, expected_y) -> None:
    error = slowest(relative_error(result[0], expected_y))
    if error > BASELINE_TOLERANCE:
        raise AssertionError(f"{what}: relative error {error:.2e} against the reference")


def _symmetric_one_shot(x: torch.Tensor):
    """PyTorch symmetric memory's one-shot all-reduce of a symmetric copy of x: (call, its output),
    or None where it cannot run here (said on stderr)."""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        group = dist.group.WORLD.group_name
        buffer = symm_mem.empty(x.shape, dtype=x.dtype, device=x.device)
        symm_mem.rendezvous(buffer, group)
        buffer.copy_(x)
        out = torch.empty_like(x)
        return (lambda: torch.ops.symm_mem.one_shot_all_reduce_out(buffer, "sum", group, out)), out
    except Exception as error:  # noqa: BLE001 - a missing column, not a failure
        print(f"(PyTorch symmetric-memory one-shot all-reduce unavailable: {type(error).__name__}: {error})",
              file=sys.stderr)
        return None


def _baselines(x, residual, weight, eps, expected_y) -> dict:
    """label -> call of the torch baselines for this world (each checked first)."""
    if tridist.world().world_size == 1:
        torch._dynamo.reset()  # a fresh compile per shape (the cache of one function holds few)
        compiled = torch.compile(torch_add_norm, dynamic=False)
        _check_baseline("torch.compile", compiled(x, residual, weight, eps), expected_y)
        return {"torch eager us": lambda: torch_add_norm(x, residual, weight, eps),
                "torch compile us": lambda: compiled(x, residual, weight, eps)}
    work = x.clone()
    dist.all_reduce(work)
    _check_baseline("NCCL + torch", torch_add_norm(work, residual, weight, eps), expected_y)
    calls = {"NCCL + torch us": lambda: (dist.all_reduce(work), torch_add_norm(work, residual, weight, eps))}
    one_shot = _symmetric_one_shot(x)
    if all_ranks(one_shot is not None):
        reduce, out = one_shot
        reduce()
        _check_baseline("torch one_shot + torch", torch_add_norm(out, residual, weight, eps), expected_y)
        calls["torch one_shot + torch us"] = lambda: (reduce(), torch_add_norm(out, residual, weight, eps))
    return calls


def run(shapes, dtype, timed: bool, baselines: bool = True, eps: float = EPS) -> list[dict]:
    """Checks the op at every shape (on every rank); with `timed`, a row per shape of its time and
    (with `baselines`) the torch baselines' in turns. Without `timed` returns no rows."""
    w = tridist.world()
    rows = []
    for tokens, hidden in shapes:
        x, residual, weight = _inputs(tokens, hidden, dtype, w.device, w.rank)
        expected_y, expected_residual = reference(x, residual, weight, eps)
        op = ops.AllReduceRMSNorm(tokens, hidden, dtype)
        y, new_residual = (torch.full_like(x, float("nan")) for _ in range(2))
        op(x, residual, weight, eps, y=y, new_residual=new_residual)
        check(f"{tokens}x{hidden} ({op.method})", y, new_residual, expected_y, expected_residual)
        if timed:
            calls = {"tridist us": lambda: op(x, residual, weight, eps, y=y, new_residual=new_residual)}
            if baselines:
                calls.update(_baselines(x, residual, weight, eps, expected_y))
            row = {"T": tokens, "hidden": hidden, "method": op.method,
                   **dict(zip(calls, interleaved_us(list(calls.values()))))}
            nbytes = (4 * tokens * hidden + hidden) * x.element_size()  # x, residual, y, new residual, weight
            row["tridist GB/s"] = nbytes / row["tridist us"] / 1e3
            for label in [c for c in calls if c != "tridist us"]:
                row[f"vs {label.removesuffix(' us')}"] = row[label] / row["tridist us"]
            if "torch eager us" in row and tokens <= TARGET_MAX_TOKENS:
                row["targets met"] = row["vs torch eager"] >= TARGET
            rows.append(row)
            if w.rank == 0:
                print(f"  {tokens}x{hidden}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()
                                                         if isinstance(v, float)), flush=True)
        tridist.barrier_all()
        op.free()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tridist bench all_reduce_rms_norm")
    default = ",".join(f"{t}x{h}" for h in HIDDEN for t in TOKENS)
    parser.add_argument("--shapes", type=parse_shapes, default=None,
                        help=f"T x hidden, comma separated (default {default})")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="default %(default)s")
    parser.add_argument("--out", default="benchmarks/results", help="folder for JSON results (default %(default)s)")
    args = parser.parse_args(argv)
    shapes = args.shapes or parse_shapes(default)
    w = tridist.init()
    shared = shared_gpu.announce("tridist bench all_reduce_rms_norm", w.rank)
    timed = w.backend == "nvshmem"
    rows = run(shapes, getattr(torch, args.dtype), timed, baselines=not shared)
    if w.rank == 0 and not timed:
        print("all_reduce_rms_norm: every check passed; nothing timed (no GPU)")
    elif w.rank == 0:
        columns = []
        for row in rows:
            columns += [c for c in row if c not in columns]
        print(table(rows, columns))
        path = save("all_reduce_rms_norm", rows, args.out,
                    {"world_size": w.world_size, "dtype": args.dtype, "eps": EPS,
                     "targets": {"vs torch eager": TARGET, "at T up to": TARGET_MAX_TOKENS}})
        print(f"saved {path}" + (f" ({shared_gpu.SPEED}: no speed claim)" if shared else ""))
    tridist.finalize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
