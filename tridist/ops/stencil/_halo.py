"""What both Jacobi methods share: the layout of a rank's part of the domain, the halo protocol,
and the relaxation of one tile (`relax_tile`).

The domain is `rows` x `cols` interior points of float32 inside a fixed boundary (a row above and
below, a column left and right). An iteration replaces every interior point by the mean of its four
neighbours, computed as ((up + down) + (left + right)) * 0.25 in that order, so that both methods
give the same bits as `jacobi_reference` (torch, one process).

Layout. With R = rows / world, rank r owns interior rows [r R, (r + 1) R) (world and rank those of
the solver's group, when it runs within one). Its symmetric buffer
`planes` holds two planes of (R + 2) x (cols + 2): row 0 is its top halo (the last row of rank
r - 1, or the domain's top boundary on rank 0), rows 1..R are its own, row R + 1 is its bottom halo;
columns 0 and cols + 1 are boundary. Iteration k (counted from 1 since `Jacobi2D.load`) reads plane
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
"""
import torch
import triton
import triton.language as tl

import tridist
import tridist.language as dl

from ..protocol import in_slot, sync_program


class Domain:
    """This rank's part of a domain of `rows` x `cols` interior points (R = `local_rows` of its
    rows), cut in tiles of `block` = (BLOCK_R, BLOCK_C): the two planes and the halo signals, both
    symmetric (allocated here, on every rank of `group` at once, a `tridist.Group` or None for the
    world; `free` gives them back)."""

    def __init__(self, local_rows: int, cols: int, block: tuple[int, int], group=None):
        self.local_rows, self.cols, self.group = local_rows, cols, group
        self.block_r, self.block_c = block
        tiles_c = triton.cdiv(cols, self.block_c)
        self.tiles = triton.cdiv(local_rows, self.block_r) * tiles_c
        self.planes = tridist.symm_zeros((2, local_rows + 2, cols + 2), torch.float32, group, name="Jacobi2D planes")
        self.signals = tridist.signals(2 * 2 * tiles_c, group, name="Jacobi2D halo signals")

    def blocks(self) -> dict:
        """The tile, as the kernels' constexprs."""
        return {"BLOCK_R": self.block_r, "BLOCK_C": self.block_c}

    def free(self) -> None:
        tridist.symm_free(self.signals)
        tridist.symm_free(self.planes)


@triton.jit
def relax_tile(planes_ptr, signals_ptr, tile, rows, cols, iteration, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
               group):
    """Iteration `iteration` of tile `tile`: wait for the halo segments it reads, relax it, and put
    its edge rows to the neighbouring ranks of `group` (None: the world; see the module docstring)."""
    me = dl.rank(group)
    world = dl.num_ranks(group)
    width = cols + 2
    plane = (rows + 2) * width
    src = in_slot(planes_ptr, iteration - 1, plane)
    dst = in_slot(planes_ptr, iteration, plane)
    tiles_c = tl.cdiv(cols, BLOCK_C)
    tile_r = tile // tiles_c
    tile_c = tile % tiles_c
    top = (tile_r == 0) & (me > 0)
    bottom = (tile_r == tl.cdiv(rows, BLOCK_R) - 1) & (me < world - 1)
    if iteration > 1:
        awaited = in_slot(signals_ptr, iteration - 1, 2 * tiles_c) + tile_c
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
        raised = in_slot(signals_ptr, iteration, 2 * tiles_c) + tile_c
        if top:  # row 1 into the bottom halo of the rank above
            dl.shmem.putmem_signal_block(dst + (rows + 1) * width + first, dst + width + first, nbytes,
                                         raised + tiles_c, iteration, dl.shmem.SIGNAL_SET, me - 1, group)
        if bottom:  # row R into the top halo of the rank below
            dl.shmem.putmem_signal_block(dst + first, dst + rows * width + first, nbytes, raised, iteration,
                                         dl.shmem.SIGNAL_SET, me + 1, group)
