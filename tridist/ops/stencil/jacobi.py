"""A 2D Jacobi solver for Laplace's equation, the domain split by rows across ranks, with the halo
exchange and its synchronisation inside the kernels.

The domain is `rows` x `cols` interior points of float32 inside a fixed boundary (a row above and
below, a column left and right). An iteration replaces every interior point by the mean of its four
neighbours, computed as ((up + down) + (left + right)) * 0.25 in that order, so that both solvers
give the same bits as `jacobi_reference` (torch, one process).

Layout. With R = rows / world, rank r owns interior rows [r R, (r + 1) R). Its symmetric buffer
`planes` holds two planes of (R + 2) x (cols + 2): row 0 is its top halo (the last row of rank
r - 1, or the domain's top boundary on rank 0), rows 1..R are its own, row R + 1 is its bottom halo;
columns 0 and cols + 1 are boundary. Iteration k (counted from 1 since `load`) reads plane
(k - 1) % 2 and writes plane k % 2.

Halos. The interior is cut in tiles of BLOCK_R x BLOCK_C. A tile in the first row of tiles, once
computed, puts its segment of row 1 into the bottom halo of the same plane on rank r - 1; one in
the last row of tiles puts its segment of row R into the top halo of rank r + 1; both with
`dl.shmem.putmem_signal_block` (on the node a copy over NVLink, across nodes a network put), which
sets signal (k % 2, side, column tile) there to k (side 0: top halo, 1: bottom halo). Before a tile
of iteration k > 1 reads a halo segment, it waits for that segment's signal at parity (k - 1) % 2
to reach k - 1. A halo needs no handshake before it is overwritten: a rank writes plane k % 2's
halos at iteration k and next at k + 2, which it reaches only after it has received its
neighbour's halo of iteration k + 1, sent after that neighbour read the one of iteration k; and
the signal of parity k % 2 is next raised at k + 2, so waiting for "at least k" never sees a later
iteration's value. Signals only grow: back-to-back runs need no reset.

Two solvers of the same iterations:
- "host_loop" (`jacobi_step_kernel`): one launch per iteration, a program per tile, then
  `tridist.barrier_all_on_stream`: the host keeps the ranks in step, as a host-driven solver does.
- "fused" (`jacobi_fused_kernel`): one co-resident, persistent launch runs every iteration. Its
  programs stride over the tiles; a tile waits only for its neighbours' halo signals, and within
  the rank the programs pass `dl.grid_barrier` between iterations (a tile reads rows that other
  programs wrote in the iteration before, and overwrites rows they read). No barrier across ranks.
"""
import torch
import triton
import triton.language as tl

import tridist
import tridist.language as dl
from tridist.runtime.jit import jit

from .. import _protocol
from .._protocol import sync_program

METHODS = ("host_loop", "fused")


@triton.jit
def _relax_tile(planes_ptr, signals_ptr, tile, rows, cols, iteration, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Iteration `iteration` of tile `tile`: wait for the halo segments it reads, relax it, and put
    its edge rows to the neighbouring ranks (see the module docstring)."""
    me = dl.rank()
    world = dl.num_ranks()
    width = cols + 2
    plane = (rows + 2) * width
    src = planes_ptr + ((iteration - 1) % 2) * plane
    dst = planes_ptr + (iteration % 2) * plane
    tiles_c = tl.cdiv(cols, BLOCK_C)
    tile_r = tile // tiles_c
    tile_c = tile % tiles_c
    top = (tile_r == 0) & (me > 0)
    bottom = (tile_r == tl.cdiv(rows, BLOCK_R) - 1) & (me < world - 1)
    if iteration > 1:
        awaited = signals_ptr + ((iteration - 1) % 2) * 2 * tiles_c + tile_c
        if top:
            src = dl.consume_token(src, dl.shmem.signal_wait_until(awaited, dl.shmem.CMP_GE, iteration - 1))
        if bottom:
            src = dl.consume_token(src, dl.shmem.signal_wait_until(awaited + tiles_c, dl.shmem.CMP_GE, iteration - 1))
    r = 1 + tile_r * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
    c = 1 + tile_c * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    mask = (r <= rows) & (c <= cols)
    center = r * width + c
    up = tl.load(src + center - width, mask=mask)
    down = tl.load(src + center + width, mask=mask)
    left = tl.load(src + center - 1, mask=mask)
    right = tl.load(src + center + 1, mask=mask)
    tl.store(dst + center, ((up + down) + (left + right)) * 0.25, mask=mask)
    if top | bottom:
        sync_program()  # the puts read what every thread of the program has just stored
        first = 1 + tile_c * BLOCK_C
        nbytes = tl.minimum(BLOCK_C, cols - tile_c * BLOCK_C) * 4
        raised = signals_ptr + (iteration % 2) * 2 * tiles_c + tile_c
        if top:  # row 1 into the bottom halo of the rank above
            dl.shmem.putmem_signal_block(dst + (rows + 1) * width + first, dst + width + first, nbytes,
                                         raised + tiles_c, iteration, dl.shmem.SIGNAL_SET, me - 1)
        if bottom:  # row R into the top halo of the rank below
            dl.shmem.putmem_signal_block(dst + first, dst + rows * width + first, nbytes, raised, iteration,
                                         dl.shmem.SIGNAL_SET, me + 1)


@jit(do_not_specialize=["iteration"])
def jacobi_step_kernel(planes_ptr, signals_ptr, rows, cols, iteration, BLOCK_R: tl.constexpr,
                       BLOCK_C: tl.constexpr):
    """Iteration `iteration` of the host loop: program t relaxes tile t."""
    _relax_tile(planes_ptr, signals_ptr, tl.program_id(0), rows, cols, iteration, BLOCK_R, BLOCK_C)
    dl.shmem.quiet()  # the halos have landed when the kernel ends


@jit(do_not_specialize=["first", "iterations"])
def jacobi_fused_kernel(planes_ptr, signals_ptr, barrier_ptr, rows, cols, first, iterations, BLOCK_R: tl.constexpr,
                        BLOCK_C: tl.constexpr):
    """Iterations first, first + 1, ... (`iterations` of them) in one co-resident launch: program p
    relaxes tiles p, p + programs, ... of each, then waits at the grid barrier (word `barrier_ptr`)
    for the other programs before the next."""
    tiles = tl.cdiv(rows, BLOCK_R) * tl.cdiv(cols, BLOCK_C)
    last = first + iterations - 1
    for iteration in range(first, last + 1):
        for tile in range(tl.program_id(0), tiles, tl.num_programs(0)):
            _relax_tile(planes_ptr, signals_ptr, tile, rows, cols, iteration, BLOCK_R, BLOCK_C)
        if iteration < last:
            planes_ptr = dl.consume_token(planes_ptr, dl.grid_barrier(barrier_ptr))
    dl.shmem.quiet()


def tile_for(rows: int, cols: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C) for R = `rows` rows of `cols` columns per rank: up to 256 columns (1 KB of
    each halo row per put), and up to 2048 points a tile, 16 a thread of 4 warps."""
    block_c = min(256, triton.next_power_of_2(cols))
    return min(triton.next_power_of_2(rows), max(1, 2048 // block_c)), block_c


class Jacobi2D:
    """A Jacobi solver for a domain of `rows` x `cols` interior points (float32) inside a fixed
    boundary, split by rows over the ranks (`rows` a multiple of the world size). A collective:
    every rank builds it, loads and runs it at once. `load(domain)` sets the state, `run(n, method)`
    relaxes it n times and returns this rank's rows (see `solution`). `method`: "host_loop" (a
    launch and a barrier across ranks per iteration) or "fused" (one co-resident launch for all of
    them, the ranks synchronised only by their halo signals). `programs`: the most programs the fused
    kernel runs (default one per SM, fewer if fewer fit at once); `block`: (BLOCK_R, BLOCK_C), the
    tile (default `tile_for`). Raises ValueError for sizes it cannot split or index."""

    def __init__(self, rows: int, cols: int, programs: int | None = None, block: tuple[int, int] | None = None):
        self.world = w = tridist.world()
        for name, value in (("rows", rows), ("cols", cols)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Jacobi2D needs a positive int {name}, got {value!r}")
        if rows % w.world_size:
            raise ValueError(f"Jacobi2D splits the {rows} rows over {w.world_size} ranks: make rows a multiple of the "
                             "world size")
        self.rows, self.cols, self.local_rows = rows, cols, rows // w.world_size
        _protocol.check_offsets("Jacobi2D", 2 * (self.local_rows + 2) * (cols + 2))
        self.block_r, self.block_c = block or tile_for(self.local_rows, cols)
        tiles_c = triton.cdiv(cols, self.block_c)
        self.tiles = triton.cdiv(self.local_rows, self.block_r) * tiles_c
        self.programs = min(self.tiles, _protocol.programs_limit(programs, w))
        self.fitted = False  # the fused kernel fits its grid to what can be resident at its first run
        self.planes = tridist.symm_zeros((2, self.local_rows + 2, cols + 2), torch.float32)
        self.signals = tridist.signals(2 * 2 * tiles_c)
        self.barrier = torch.zeros(1, dtype=torch.int64, device=w.device)
        self.iterations = 0

    def load(self, domain: torch.Tensor) -> None:
        """Start from `domain`, the whole (rows + 2) x (cols + 2) float32 domain with its boundary,
        the same on every rank (each keeps its rows and halos); iterations count from 1 again. The
        plane the first iteration writes is poisoned (NaN) where neighbours or kernels must fill it.
        Synchronises the ranks on the host, before and after."""
        w, rows = self.world, self.local_rows
        shape = (self.rows + 2, self.cols + 2)
        if tuple(domain.shape) != shape or domain.dtype != torch.float32:
            raise ValueError(f"Jacobi2D.load takes the whole float32 domain with its boundary, {shape}; got "
                             f"{domain.dtype} of shape {tuple(domain.shape)}")
        tridist.barrier_all()  # no rank still runs on the state being replaced
        part = domain[w.rank * rows:(w.rank + 1) * rows + 2].to(w.device)
        self.planes.copy_(part.expand(2, *part.shape))
        self.planes[1, 1:rows + 1, 1:self.cols + 1] = float("nan")
        if w.rank > 0:
            self.planes[1, 0] = float("nan")
        if w.rank < w.world_size - 1:
            self.planes[1, rows + 1] = float("nan")
        self.signals.zero_()
        self.iterations = 0
        tridist.barrier_all()  # no rank puts a halo here before this rank has loaded

    def run(self, iterations: int, method: str = "fused") -> torch.Tensor:
        """Relax `iterations` more times with `method`; returns `solution()`."""
        if method not in METHODS:
            raise _protocol.method_error("Jacobi2D", method, METHODS)
        if not isinstance(iterations, int) or iterations < 1:
            raise ValueError(f"Jacobi2D.run takes a positive int number of iterations, got {iterations!r}")
        if self.iterations + iterations >= _protocol.INDEX_LIMIT:
            raise ValueError("Jacobi2D counts iterations in 32 bits: load the state again to count from 1")
        first = self.iterations + 1
        blocks = {"BLOCK_R": self.block_r, "BLOCK_C": self.block_c}
        if method == "host_loop":
            for iteration in range(first, first + iterations):
                jacobi_step_kernel[(self.tiles,)](self.planes, self.signals, self.local_rows, self.cols, iteration,
                                                  **blocks)
                tridist.barrier_all_on_stream()
        else:
            args = (self.planes, self.signals, self.barrier, self.local_rows, self.cols, first, iterations)
            if not self.fitted:
                self.programs = _protocol.fit_coresident(jacobi_fused_kernel, self.programs, 1, *args, **blocks)
                self.fitted = True
            jacobi_fused_kernel[(self.programs,)](*args, coresident=True, **blocks)
        self.iterations += iterations
        return self.solution()

    def solution(self) -> torch.Tensor:
        """This rank's rows of the current state, R x (cols + 2) with the boundary columns: rows
        [rank R + 1, (rank + 1) R + 1) of the whole domain. A view, which the next run overwrites."""
        return self.planes[self.iterations % 2, 1:self.local_rows + 1]

    def free(self) -> None:
        """Give the planes and signals back to the symmetric heap (on every rank, in the same order)."""
        tridist.symm_free(self.signals)
        tridist.symm_free(self.planes)


def jacobi_reference(domain: torch.Tensor, iterations: int) -> torch.Tensor:
    """`iterations` Jacobi iterations of the whole `domain` (boundary included, kept) in one process,
    with the solvers' order of operations; returns a new tensor."""
    state = domain.clone()
    for _ in range(iterations):
        following = state.clone()
        following[1:-1, 1:-1] = ((state[:-2, 1:-1] + state[2:, 1:-1]) + (state[1:-1, :-2] + state[1:-1, 2:])) * 0.25
        state = following
    return state
