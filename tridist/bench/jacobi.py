"""`tridist bench jacobi`: time per iteration of the 2D Jacobi solver (`tridist.ops.Jacobi2D`,
`examples/jacobi2d.py`) in its two versions, over square domains from tiny (launches and barriers
are all there is to time) to large (memory bandwidth is):
- host loop: a kernel launch and a barrier across ranks (`barrier_all_on_stream`) per iteration;
- fused: one co-resident launch runs every iteration, the ranks synchronised by halo signals only.
Every size is first checked bit for bit against one process (torch on the whole domain), for both
versions. Each version then runs `iterations` iterations per timed call (enough to take about the
same time at every size); the figure is the slowest rank's median per iteration. With ranks sharing
a GPU (TRIDIST_RANKS_PER_GPU > 1, or --check-only) only the check runs: ranks that split one GPU's
SMs time nothing useful. Domains are rows x cols interior points, rows rounded up to a multiple of
the world size.
"""
import argparse

import torch

import tridist
from tridist.ops import Jacobi2D, jacobi_reference

from . import shared_gpu
from .results import save, table, title
from .timing import slowest, time_us

SIZES = "64,128,256,512,1024,2048,4096,8192"
METHODS = ("host_loop", "fused")


def domain_rows(size: int, world_size: int) -> int:
    return -(-size // world_size) * world_size


def iterations_for(size: int) -> int:
    """About 2^26 point updates per timed call, between 20 and 1000 iterations."""
    return max(20, min(1000, (1 << 26) // (size * size)))


def check(w, size: int, iterations: int) -> tuple[Jacobi2D, dict]:
    """Both versions, `iterations` iterations of a size x size domain, against one process; raises
    AssertionError naming the largest difference (over all ranks) if either differs by a bit.
    Returns the solver, which the timing goes on running, and the table's row."""
    rows = domain_rows(size, w.world_size)
    domain = torch.rand(rows + 2, size + 2, generator=torch.Generator().manual_seed(size)).to(w.device)
    domain[0] = 1.0
    local = rows // w.world_size
    expected = jacobi_reference(domain, iterations)[1 + w.rank * local:1 + (w.rank + 1) * local]
    solver = Jacobi2D(rows, size)
    row = {"size": f"{rows}x{size}", "points": rows * size, "checked iterations": iterations}
    for method in METHODS:
        solver.load(domain)
        got = solver.run(iterations, method)
        difference = slowest(float("nan") if got.isnan().any() else (got - expected).abs().max().item())
        row[f"{method} difference"] = difference
        if difference != 0:
            raise AssertionError(f"rank {w.rank}: jacobi {method} at {rows}x{size} after {iterations} iterations "
                                 f"differs from one process by up to {difference}")
    return solver, row


def run(w, sizes: list[int], timed: bool, check_iterations: int = 20) -> list[dict]:
    """A row per size: checked (`check_iterations` iterations at most), then timed if `timed`."""
    results = []
    for size in sizes:
        solver, row = check(w, size, min(iterations_for(size), check_iterations))
        if timed:
            iterations = iterations_for(size)
            row["iterations"] = iterations
            for method in METHODS:
                call_us = slowest(time_us(lambda: solver.run(iterations, method), inner=1, repetitions=5, warmup=1))
                row[f"{method} us"] = call_us / iterations
            row["fused speedup"] = row["host_loop us"] / row["fused us"]
            row["fused programs"] = solver.programs
        tridist.barrier_all()
        solver.free()
        results.append(row)
        if w.rank == 0:
            print("  " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
                  flush=True)
    return results


def plot(rows: list[dict], path: str, world_size: int) -> None:
    """Microseconds per iteration against points in the domain, one curve per version (skipped
    without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    figure, axis = plt.subplots(figsize=(7, 4))
    for method in METHODS:
        axis.plot([r["points"] for r in rows], [r[f"{method} us"] for r in rows], marker="o",
                  label=method.replace("_", " "))
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("interior points of the domain")
    axis.set_ylabel("us per iteration (lower is better)")
    axis.set_title(title(f"Jacobi 2D, {world_size} rank(s)"))
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tridist bench jacobi")
    parser.add_argument("--sizes", default=SIZES, help="square domain sizes, comma separated (default %(default)s)")
    parser.add_argument("--check-only", action="store_true",
                        help="check both versions against one process, time nothing (what runs when ranks share "
                             "a GPU)")
    parser.add_argument("--out", default="benchmarks/results", help="folder for JSON and PNG results (default "
                                                                   "%(default)s)")
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
        assert all(s > 0 for s in sizes)
    except (ValueError, AssertionError):
        parser.error(f"--sizes takes positive ints separated by commas, got {args.sizes!r}")
    w = tridist.init()
    shared = shared_gpu.announce("tridist bench jacobi", w.rank)
    timed = w.backend == "nvshmem" and not (shared or args.check_only)
    rows = run(w, sizes, timed)
    if w.rank == 0:
        if not timed:
            why = "ranks share a GPU" if shared else "--check-only" if args.check_only else "no GPU"
            print(table(rows, list(rows[0])))
            print(f"checked only ({why}): both versions equal one process bit for bit")
        else:
            columns = ["size", "iterations", "host_loop us", "fused us", "fused speedup", "fused programs"]
            print("microseconds per iteration (slowest rank, median):")
            print(table(rows, columns))
            path = save("jacobi", rows, args.out, {"world_size": w.world_size})
            plot(rows, path.replace(".json", ".png"), w.world_size)
            print(f"saved {path}")
    tridist.finalize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
