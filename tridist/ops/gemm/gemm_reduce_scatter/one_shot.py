"""gemm_rs on one node ("one_shot"): every partial tile goes straight to the rank that owns its
rows, which sums it into its own.

Protocol (one persistent kernel; `_tiles` for how a tile travels, `protocol.py` for slots and
call epochs)

- The workspace holds, per slot, world x per_shard partial tiles (per_shard: the output tiles of
  one rank's rows), rank src's partial of tile t of this rank's shard at src * per_shard + t, with
  a flag per tile that src raises to the call epoch.
- Tile t of shard s is computed by every rank and stored into rank s's workspace. Each rank takes
  the shards in the order rank+1, rank+2, ..., its own last: by the time it reaches its own tiles,
  every peer has long sent its part of them, so the reductions rarely wait; the peers' partials
  are added to the fp32 accumulator of this rank's own and the sum is stored once.
- A peer's flag for a tile goes up one tile late, before any wait of the program: by then the
  tile's stores have drained over NVLink and the release costs nothing, where at once it would
  stall the program.
- A program waits for tiles that any program of a peer may compute, perhaps one that comes after
  it in the grid, so the kernel launches co-resident (`_tiles.TileMethod.coresident`).
"""
import triton.language as tl

import tridist.language as dl
from tridist.runtime.jit import jit

from ...protocol import call_epoch, finish_call, in_slot
from .. import persistent
from .._tiles import TileMethod, received_tile, tile_at, tile_offsets, tiles_in_slot


@jit
def gemm_rs_kernel(a_desc, b_desc, scale_a_ptr, scale_b_ptr, out_ptr, tiles_ptr, flags_ptr, calls_ptr, M, N, K,
                   local_world_size, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, FLATTEN: tl.constexpr, group):
    """out is this rank's M/world x N rows of the sum, ranks and world of `group` (None: the
    world). FLATTEN lets Triton load the next tile's operands during this one's epilogue. Triton
    3.6's loop fusion fails on a value computed after the K loop and used only inside a branch of
    the epilogue, so every branch computes its own addresses."""
    epoch = call_epoch(calls_ptr)
    scale = persistent.load_scale(scale_a_ptr, scale_b_ptr)
    me = dl.rank(group)
    world = dl.num_ranks(group)
    rows = M // world
    tiles_m = tl.cdiv(rows, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_shard = tiles_m * tiles_n
    tiles = tiles_in_slot(tiles_ptr, epoch, world * per_shard, BLOCK_M, BLOCK_N)
    flags = in_slot(flags_ptr, epoch, world * per_shard)
    offsets = tile_offsets(BLOCK_M, BLOCK_N)
    late_peer = tl.cast(-1, tl.int32)  # the peer whose flag is still to be raised, and that flag
    late_flag = flags
    for tile in tl.range(tl.program_id(0), world * per_shard, tl.num_programs(0), flatten=FLATTEN):
        shard = (me + 1 + tile // per_shard) % world
        t = tile % per_shard
        tm, tn = persistent.tile_coords(t, tiles_m, tiles_n, GROUP_M)
        acc = persistent.tile_product(a_desc, b_desc, tm * BLOCK_M + shard * rows, tn * BLOCK_N, K, BLOCK_M, BLOCK_N,
                                      BLOCK_K)
        if late_peer >= 0:  # before any wait below: a peer may be waiting for this flag
            dl.notify(late_flag, late_peer, signal=epoch, sig_op="set", group=group)
            late_peer = tl.cast(-1, tl.int32)
        if shard != me:
            mine = tile_at(tiles, me * per_shard + t, BLOCK_M, BLOCK_N)
            tl.store(dl.symm_at(mine, shard, group) + offsets, (acc * scale).to(tiles_ptr.dtype.element_ty))
            late_peer = shard
            late_flag = flags + me * per_shard + t
        else:
            acc *= scale
            for step in range(1, world):
                acc += received_tile(tiles, flags, (me + step) % world, t, per_shard, epoch, BLOCK_M, BLOCK_N)
            persistent.store_tile(out_ptr, acc, tm * BLOCK_M, tn * BLOCK_N, rows, N, BLOCK_M, BLOCK_N)
    if late_peer >= 0:
        dl.notify(late_flag, late_peer, signal=epoch, sig_op="set", group=group)
    finish_call(calls_ptr)


class OneShot(TileMethod):
    """gemm_rs on one node: a workspace of world x per_shard tiles per slot, and `gemm_rs_kernel`
    on one co-resident program per SM (fewer if fewer fit)."""

    name = "one_shot"
    one_node = True
    flatten = True  # Triton can fuse its loop nest: it takes configs with FLATTEN
    kernel = gemm_rs_kernel
    scatter = True
    coresident = True
