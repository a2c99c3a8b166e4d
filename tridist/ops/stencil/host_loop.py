"""Jacobi method "host_loop": one launch per iteration, a program per tile, then
`tridist.barrier_all_on_stream` (of the solver's group, if it has one): the host keeps the ranks in
step, as a host-driven solver does. Layout and halo protocol: `_halo`."""
import triton.language as tl

import tridist
import tridist.language as dl
from tridist.runtime.jit import jit

from ..method import Method
from ._halo import Domain, relax_tile


@jit(do_not_specialize=["iteration"])
def jacobi_step_kernel(planes_ptr, signals_ptr, rows, cols, iteration, BLOCK_R: tl.constexpr,
                       BLOCK_C: tl.constexpr, group=None):
    """Iteration `iteration` of the host loop: program t relaxes tile t. Neighbours are ranks of
    `group` (None: the world's)."""
    relax_tile(planes_ptr, signals_ptr, tl.program_id(0), rows, cols, iteration, BLOCK_R, BLOCK_C, group)
    dl.shmem.quiet()  # the halos have landed when the kernel ends


class HostLoop(Method):
    """Relaxes `domain` a launch and a barrier across its ranks per iteration; owns no buffers."""

    name = "host_loop"

    def __init__(self, domain: Domain):
        super().__init__()
        self.domain = domain

    def launch(self, first: int, iterations: int) -> None:
        """Iterations first, first + 1, ... (`iterations` of them)."""
        d = self.domain
        for iteration in range(first, first + iterations):
            jacobi_step_kernel[(d.tiles,)](planes_ptr=d.planes, signals_ptr=d.signals, rows=d.local_rows,
                                           cols=d.cols, iteration=iteration, group=d.group, **d.blocks())
            tridist.barrier_all_on_stream(group=d.group)
