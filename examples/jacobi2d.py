"""A 2D Jacobi solver whose halo exchange runs inside the kernels: `tridist run -n 4 examples/jacobi2d.py`.

The domain (a hot top edge, cold other edges, a random start inside) is split by rows across the
ranks; every iteration each rank sends its first and last rows to the ranks above and below. Two
versions of the same solver (`tridist.ops.Jacobi2D`, see `tridist/ops/stencil/`):
- host_loop: one kernel launch per iteration and a barrier across ranks queued after each;
- fused: one co-resident kernel runs every iteration, each rank waiting only for its neighbours'
  halo signals, its programs meeting at a grid barrier between iterations.
Both must give the same bits as one process computing the whole domain. Every rank prints the
largest difference of its rows for each version; the program exits non-zero if one is not 0.
Options: --rows, --cols (interior points, rows a multiple of the ranks), --iterations.
"""
import argparse
import sys

import torch

import tridist
from tridist.ops import Jacobi2D, jacobi_reference


def initial_domain(rows: int, cols: int) -> torch.Tensor:
    """The same (rows + 2) x (cols + 2) domain on every rank: top boundary 1, the rest of the
    boundary 0, random values inside."""
    domain = torch.zeros(rows + 2, cols + 2)
    domain[0] = 1.0
    domain[1:-1, 1:-1] = torch.rand(rows, cols, generator=torch.Generator().manual_seed(0))
    return domain


def solve(w, rows: int, cols: int, iterations: int) -> dict:
    """Each version's largest |difference| from the one-process reference over this rank's rows
    (NaN where a value was never written)."""
    domain = initial_domain(rows, cols)
    expected = jacobi_reference(domain, iterations)
    mine = expected[1 + w.rank * rows // w.world_size:1 + (w.rank + 1) * rows // w.world_size].to(w.device)
    solver = Jacobi2D(rows, cols)
    differences = {}
    for method in ("host_loop", "fused"):
        solver.load(domain)
        got = solver.run(iterations, method)
        differences[method] = (got - mine).abs().max().item() if not got.isnan().any() else float("nan")
    tridist.barrier_all()  # the last kernels' puts have landed before the buffers go
    solver.free()
    return differences


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="examples/jacobi2d.py")
    parser.add_argument("--rows", type=int, default=None, help="interior rows (default 16 per rank)")
    parser.add_argument("--cols", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=50)
    args = parser.parse_args(argv)
    w = tridist.init()
    rows = args.rows or 16 * w.world_size
    differences = solve(w, rows, args.cols, args.iterations)
    same = all(d == 0 for d in differences.values())
    print(f"rank {w.rank}/{w.world_size}: {args.iterations} iterations of {rows} x {args.cols}, largest difference "
          f"from one process: " + ", ".join(f"{m} {d:g}" for m, d in differences.items())
          + ("" if same else "  WRONG"))
    tridist.finalize()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
