"""`tridist bench NAME [options]`: starts the ranks itself when run outside a launcher.

Every benchmark's `main` initialises what it needs itself: `torch_fused` must never start tridist
(see its module), so nothing here does either."""
import os
import sys

BENCHMARKS = {"primitives": "tridist.bench.primitives", "allgather": "tridist.bench.collectives",
              "reducescatter": "tridist.bench.collectives", "allreduce": "tridist.bench.collectives",
              "gemm": "tridist.bench.overlap", "ag_gemm": "tridist.bench.overlap", "gemm_rs": "tridist.bench.overlap",
              "gemm_ar": "tridist.bench.overlap", "torch_fused": "tridist.bench.torch_fused"}
SINGLE = ("primitives", "torch_fused")  # modules with one benchmark: their `main` takes no benchmark name


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: tridist bench {{{','.join(BENCHMARKS)}}} [-n RANKS] [options]", file=sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
    if "RANK" not in os.environ:
        nproc = 2
        if "-n" in rest:
            i = rest.index("-n")
            nproc = int(rest[i + 1])
            rest = rest[:i] + rest[i + 2:]
        from ..runtime.launcher import run

        return run(nproc, ["-m", "tridist", "bench", name, *rest])
    import importlib

    module = importlib.import_module(BENCHMARKS[name])
    return module.main(rest if name in SINGLE else [name, *rest])
