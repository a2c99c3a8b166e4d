"""`tridist bench allgather|reducescatter|allreduce`: tridist against NCCL (and PyTorch's symmetric
memory all-reduce where it runs) in the same run, after checking tridist's result against NCCL's.

Sizes follow nccl-tests: the all-gather's output, the reduce-scatter's input, the all-reduce's
buffer. Bus bandwidth: bytes * (n-1)/n / t, twice that for all-reduce. Sizes up to 1 MB are timed
as CUDA-graph replays, so launch overhead is not what gets measured.
"""
import argparse
import sys

import torch
import torch.distributed as dist

import tridist
from tridist import ops

from ..runtime.config import parse_bytes
from .results import save, table
from .timing import slowest, time_us

OPS = {"allgather": "all_gather", "reducescatter": "reduce_scatter", "allreduce": "all_reduce"}
METHODS = {"allgather": ("push", "pull", "ll", "ce", "2d", "ring"), "reducescatter": ("one_shot", "2d", "ring"),
           "allreduce": ("one_shot", "two_shot", "ll")}
LL_ALL_REDUCE_LIMIT = 1 << 20  # its packets take 4x the message per rank and peer: small messages only
GRAPH_LIMIT = 1 << 20


def sizes_between(spec: str) -> list[int]:
    """'4K..256M' -> powers of 4 from 4K to 256M; '4K,1M' -> those."""
    if ".." in spec:
        low, high = (parse_bytes(s) for s in spec.split(".."))
        sizes = []
        while low <= high:
            sizes.append(low)
            low *= 4
        return sizes
    return [parse_bytes(s) for s in spec.split(",")]


def _nccl(name, x, out):
    if name == "allgather":
        return lambda: dist.all_gather_into_tensor(out, x)
    if name == "reducescatter":
        return lambda: dist.reduce_scatter_tensor(out, x)
    return lambda: dist.all_reduce(out)


def _symm_mem_all_reduce(x):
    """PyTorch's one-shot/two-shot symmetric-memory all-reduce, or None where it cannot run here."""
    import torch.distributed._symmetric_memory as symm_mem

    try:
        buffer = symm_mem.empty(x.numel(), dtype=x.dtype, device=x.device)
        symm_mem.rendezvous(buffer, dist.group.WORLD.group_name)
        buffer.copy_(x)
        group = dist.group.WORLD.group_name
        torch.ops.symm_mem.one_shot_all_reduce(buffer, "sum", group)
        out = torch.empty_like(buffer)
        return {"torch one_shot": lambda: torch.ops.symm_mem.one_shot_all_reduce_out(buffer, "sum", group, out),
                "torch two_shot": lambda: torch.ops.symm_mem.two_shot_all_reduce_(buffer, "sum", group)}
    except Exception as error:  # noqa: BLE001 - reported as a missing column, not a failure
        print(f"(PyTorch symmetric-memory all-reduce unavailable: {type(error).__name__}: {error})", file=sys.stderr)
        return None


def run(name: str, sizes: list[int], methods: list[str], dtype: torch.dtype) -> list[dict]:
    w = tridist.world()
    n = w.world_size
    rows = []
    torch_symm = None
    for nbytes in sizes:
        numel = nbytes // dtype.itemsize
        if name == "allgather":
            shard = numel // n
            x, out = torch.randn(shard, device=w.device).to(dtype), torch.empty(shard * n, dtype=dtype, device=w.device)
        elif name == "reducescatter":
            x, out = torch.randn(numel, device=w.device).to(dtype), torch.empty(numel // n, dtype=dtype,
                                                                                  device=w.device)
        else:
            x = torch.randn(numel, device=w.device).to(dtype)
            out = x.clone()
        graph = nbytes <= GRAPH_LIMIT
        reference = out.clone()
        _nccl(name, x, reference)()
        row = {"bytes": nbytes}
        nccl_us = slowest(time_us(_nccl(name, x, out.clone()), graph=graph))
        row["NCCL us"] = nccl_us
        best = None
        for method in methods:
            if name == "allreduce" and method == "ll" and nbytes > LL_ALL_REDUCE_LIMIT:
                continue
            op = getattr(ops, {"allgather": "AllGather", "reducescatter": "ReduceScatter", "allreduce": "AllReduce"}[
                name])(x.numel(), dtype, method)
            result = torch.full_like(out, float("nan"))
            op(x, result)
            torch.cuda.synchronize()
            if name == "allgather":
                ok = torch.equal(result, reference)
            else:
                ok = torch.allclose(result.float(), reference.float(), rtol=2e-2, atol=2e-2)
            if not slowest(0.0 if ok else 1.0) == 0.0:
                raise AssertionError(f"{name} {method} gave a wrong result at {nbytes} bytes")
            us = slowest(time_us(lambda: op(x, result), graph=graph))
            row[f"{method} us"] = us
            best = us if best is None else min(best, us)
            op.free()
        if name == "allreduce" and nbytes <= 16 << 20:
            torch_symm = _symm_mem_all_reduce(x)
            for label, fn in (torch_symm or {}).items():
                row[f"{label} us"] = slowest(time_us(fn, graph=graph))
        factor = 2 if name == "allreduce" else 1
        row["best us"] = best
        row["speedup vs NCCL"] = nccl_us / best
        row["busbw GB/s"] = factor * nbytes * (n - 1) / n / best / 1e3
        row["NCCL busbw GB/s"] = factor * nbytes * (n - 1) / n / nccl_us / 1e3
        rows.append(row)
        if w.rank == 0:
            print(f"  {name} {nbytes} bytes: best {best:.2f} us, NCCL {nccl_us:.2f} us", flush=True)
    return rows


def plot(name: str, rows: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    sizes = [r["bytes"] for r in rows]
    figure, axis = plt.subplots(figsize=(7, 4))
    for column in [c for c in rows[0] if c.endswith(" us") and c != "best us"]:
        axis.plot(sizes, [r.get(column) for r in rows], marker="o", label=column.removesuffix(" us"))
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("bytes")
    axis.set_ylabel("us (lower is better)")
    axis.set_title(f"{name}, {tridist.world().world_size} ranks")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tridist bench <allgather|reducescatter|allreduce>")
    parser.add_argument("op", choices=list(OPS))
    parser.add_argument("--sizes", default="4K..256M", help="'4K..256M' (powers of 4) or a list '4K,1M'")
    parser.add_argument("--method", default=None, help="one method (default: all of them)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--out", default="benchmarks/results", help="folder for JSON and PNG results")
    args = parser.parse_args(argv)
    w = tridist.init()
    if w.backend != "nvshmem":
        raise SystemExit("the collective benchmarks time GPUs against NCCL; run them on a GPU box")
    methods = [args.method] if args.method else list(METHODS[args.op])
    rows = run(args.op, sizes_between(args.sizes), methods, getattr(torch, args.dtype))
    if w.rank == 0:
        columns = ["bytes", "NCCL us", *[f"{m} us" for m in methods]]
        columns += [c for c in rows[0] if c.startswith("torch")]
        columns += ["speedup vs NCCL", "busbw GB/s", "NCCL busbw GB/s"]
        print(table(rows, columns))
        path = save(args.op, rows, args.out, {"world_size": w.world_size, "dtype": args.dtype})
        plot(args.op, rows, path.replace(".json", ".png"))
        print(f"saved {path}")
    tridist.finalize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
