"""Jacobi method "fused": one co-resident, persistent launch runs every iteration of a run. Its
programs stride over the tiles; a tile waits only for its neighbours' halo signals (`_halo`), and
within the rank the programs pass `dl.grid_barrier` between iterations (a tile reads rows that
other programs wrote in the iteration before, and overwrites rows they read). No barrier across
ranks."""
import torch
import triton.language as tl

import tridist.language as dl
from tridist.runtime.jit import jit

from .. import sizing
from ..method import Method
from ._halo import Domain, relax_tile


@jit(do_not_specialize=["first", "iterations"])
def jacobi_fused_kernel(planes_ptr, signals_ptr, barrier_ptr, rows, cols, first, iterations, BLOCK_R: tl.constexpr,
                        BLOCK_C: tl.constexpr, group=None):
    """Iterations first, first + 1, ... (`iterations` of them) in one co-resident launch: program p
    relaxes tiles p, p + programs, ... of each, then waits at the grid barrier (word `barrier_ptr`)
    for the other programs before the next. Neighbours are ranks of `group` (None: the world's)."""
    tiles = tl.cdiv(rows, BLOCK_R) * tl.cdiv(cols, BLOCK_C)
    last = first + iterations - 1
    for iteration in range(first, last + 1):
        for tile in range(tl.program_id(0), tiles, tl.num_programs(0)):
            relax_tile(planes_ptr, signals_ptr, tile, rows, cols, iteration, BLOCK_R, BLOCK_C, group)
        if iteration < last:
            planes_ptr = dl.consume_token(planes_ptr, dl.grid_barrier(barrier_ptr))
    dl.shmem.quiet()


class Fused(Method):
    """Relaxes `domain` in one co-resident launch per run, of at most `programs` programs (fewer if
    fewer fit at once: fitted at the first launch, and kept). Its grid barrier's word is this
    rank's own (not symmetric), so it owns no buffers."""

    name = "fused"

    def __init__(self, domain: Domain, programs: int):
        super().__init__()
        self.domain = domain
        self.programs = programs
        self.fitted = False
        self.barrier = torch.zeros(1, dtype=torch.int64, device=domain.planes.device)

    def launch(self, first: int, iterations: int) -> None:
        """Iterations first, first + 1, ... (`iterations` of them)."""
        d = self.domain
        arguments = dict(planes_ptr=d.planes, signals_ptr=d.signals, barrier_ptr=self.barrier, rows=d.local_rows,
                         cols=d.cols, first=first, iterations=iterations, group=d.group, **d.blocks())
        if not self.fitted:
            self.programs = sizing.fit_coresident(jacobi_fused_kernel, self.programs, 1, **arguments)
            self.fitted = True
        jacobi_fused_kernel[(self.programs,)](coresident=True, **arguments)
