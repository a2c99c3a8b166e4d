"""`Jacobi2D`: a 2D Jacobi solver for Laplace's equation, the domain split by rows across ranks (of
the world, or of a process group: `group=`), with the halo exchange and its synchronisation inside
the kernels (layout and protocol: `_halo`).

Two methods run the same iterations on the same state, and a solver may switch between them from
one run to the next:
- "host_loop" (`host_loop.py`): one launch per iteration, then a barrier across ranks on the stream;
- "fused" (`fused.py`): one co-resident launch per run, the ranks synchronised only by their halo
  signals.
"""
import torch

import tridist

from .. import call_order, checks, sizing
from ..ranks import ranks_of
from ._halo import Domain
from .fused import Fused
from .host_loop import HostLoop
from .policy import tile_for

METHODS = (HostLoop.name, Fused.name)


class Jacobi2D:
    """A Jacobi solver for a domain of `rows` x `cols` interior points (float32) inside a fixed
    boundary, split by rows over the ranks (`rows` a multiple of their number). A collective:
    every rank builds it, loads and runs it at once. `load(domain)` sets the state, `run(n, method)`
    relaxes it n times and returns this rank's rows (see `solution`). `method`: "host_loop" (a
    launch and a barrier across ranks per iteration) or "fused" (one co-resident launch for all of
    them, the ranks synchronised only by their halo signals). `programs`: the most programs the fused
    kernel runs (default one per SM, fewer if fewer fit at once); `block`: (BLOCK_R, BLOCK_C), the
    tile (default `policy.tile_for`). `group`: a `torch.distributed.ProcessGroup` or
    `tridist.Group` whose members split the domain (group rank r holds part r), None for the
    world; the members build, load and run it together, and the other ranks take no part. Raises
    ValueError for sizes it cannot split or index, or a `group` this rank is not a member of."""

    def __init__(self, rows: int, cols: int, programs: int | None = None, block: tuple[int, int] | None = None,
                 group=None):
        self.ranks = r = ranks_of(group)
        for name, value in (("rows", rows), ("cols", cols)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Jacobi2D needs a positive int {name}, got {value!r}")
        if rows % r.world_size:
            where = "world size" if r.group is None else "group's size"
            raise ValueError(f"Jacobi2D splits the {rows} rows over {r.world_size} ranks: make rows a multiple of the "
                             f"{where}")
        self.rows, self.cols, self.local_rows = rows, cols, rows // r.world_size
        checks.check_offsets("Jacobi2D", 2 * (self.local_rows + 2) * (cols + 2))
        self.domain = Domain(self.local_rows, cols, block or tile_for(self.local_rows, cols), r.group)
        self.tiles = self.domain.tiles
        self.methods = {m.name: m for m in (HostLoop(self.domain),
                                            Fused(self.domain, min(self.tiles, sizing.programs_limit(programs, r))))}
        self.iterations = 0

    @property
    def programs(self) -> int:
        """The programs of the fused method's launches (fitted to what can be resident at its first run)."""
        return self.methods[Fused.name].programs

    def load(self, domain: torch.Tensor) -> None:
        """Start from `domain`, the whole (rows + 2) x (cols + 2) float32 domain with its boundary,
        the same on every rank (each keeps its rows and halos); iterations count from 1 again. The
        plane the first iteration writes is poisoned (NaN) where neighbours or kernels must fill it.
        Synchronises the ranks (of the group) on the host, before and after."""
        r, rows, planes = self.ranks, self.local_rows, self.domain.planes
        shape = (self.rows + 2, self.cols + 2)
        if tuple(domain.shape) != shape or domain.dtype != torch.float32:
            raise ValueError(f"Jacobi2D.load takes the whole float32 domain with its boundary, {shape}; got "
                             f"{domain.dtype} of shape {tuple(domain.shape)}")
        tridist.barrier_all(r.group)  # no rank still runs on the state being replaced
        part = domain[r.rank * rows:(r.rank + 1) * rows + 2].to(r.device)
        planes.copy_(part.expand(2, *part.shape))
        planes[1, 1:rows + 1, 1:self.cols + 1] = float("nan")
        if r.rank > 0:
            planes[1, 0] = float("nan")
        if r.rank < r.world_size - 1:
            planes[1, rows + 1] = float("nan")
        self.domain.signals.zero_()
        self.iterations = 0
        tridist.barrier_all(r.group)  # no rank puts a halo here before this rank has loaded

    def run(self, iterations: int, method: str = "fused") -> torch.Tensor:
        """Relax `iterations` more times with `method`; returns `solution()`."""
        if method not in METHODS:
            raise checks.method_error("Jacobi2D", method, METHODS)
        if not isinstance(iterations, int) or iterations < 1:
            raise ValueError(f"Jacobi2D.run takes a positive int number of iterations, got {iterations!r}")
        if self.iterations + iterations >= checks.INDEX_LIMIT:
            raise ValueError("Jacobi2D counts iterations in 32 bits: load the state again to count from 1")
        call_order.take_turn()
        self.methods[method].launch(self.iterations + 1, iterations)
        self.iterations += iterations
        return self.solution()

    def solution(self) -> torch.Tensor:
        """This rank's rows of the current state, R x (cols + 2) with the boundary columns: rows
        [rank R + 1, (rank + 1) R + 1) of the whole domain (rank: in the group, if any). A view, which the next run overwrites."""
        return self.domain.planes[self.iterations % 2, 1:self.local_rows + 1]

    def free(self) -> None:
        """Give the planes and signals back to the symmetric heap (on every rank of the group, in the
        same order)."""
        for method in self.methods.values():
            method.free()
        self.domain.free()


def jacobi_reference(domain: torch.Tensor, iterations: int) -> torch.Tensor:
    """`iterations` Jacobi iterations of the whole `domain` (boundary included, kept) in one process,
    with the solvers' order of operations; returns a new tensor."""
    state = domain.clone()
    for _ in range(iterations):
        following = state.clone()
        following[1:-1, 1:-1] = ((state[:-2, 1:-1] + state[2:, 1:-1]) + (state[1:-1, :-2] + state[1:-1, 2:])) * 0.25
        state = following
    return state
