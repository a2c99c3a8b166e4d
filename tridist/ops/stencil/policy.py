"""The stencil's choices: the Jacobi solver's tile (`tile_for`). Which method runs is the caller's
(`Jacobi2D.run`'s `method`, "fused" by default): the fused kernel was faster at every size timed on
2 and 4 H100s, by far on small domains (docs/performance.md, "2 x H100 (NVLink)" and "4 x H100
(NVLink, one host)"), the host loop on one H100 from 4096 x 4096 (benchmarks/NOTES.md, "flash
decoding and the stencil")."""
import triton

MAX_BLOCK_C = 256  # columns of a tile: 1 KB of each halo row per put (a judgement: not measured)
TILE_POINTS = 2048  # points of a tile at most: 16 a thread of 4 warps (a register budget)


def tile_for(rows: int, cols: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C) for R = `rows` rows of `cols` columns per rank: up to MAX_BLOCK_C columns,
    and up to TILE_POINTS points a tile."""
    block_c = min(MAX_BLOCK_C, triton.next_power_of_2(cols))
    return min(triton.next_power_of_2(rows), max(1, TILE_POINTS // block_c)), block_c
