"""gemm_ar on any topology ("one_shot"): every rank sends each of its partial tiles to every peer,
then sums every tile over the ranks.

Protocol (one persistent kernel; `_tiles` for how a tile travels, `protocol.py` for slots and
call epochs)

- The workspace holds, per slot, world x per_shard partial tiles (per_shard: the output tiles of
  the whole product), rank src's partial of tile t at src * per_shard + t, a flag per tile that
  src raises to the call epoch. A rank stores its own partials there too, and puts them to peers
  on other nodes from there.
- A program sends each of its tiles to every peer as soon as it is computed; then, in a second
  pass over the same tiles, it sums the partials of ranks 0, 1, ... in that order, so every rank
  ends with the same bits.
- A program waits only for the tiles of the same program on the peers, which every rank's program
  sends before it waits: any grid finishes, and the kernel needs no co-resident launch.
"""
import triton.language as tl

import tridist.language as dl
from tridist.runtime.jit import jit

from ...protocol import call_epoch, finish_call, in_slot, sync_program
from .. import persistent
from .._tiles import TileMethod, received_tile, send_tile, tile_at, tile_offsets, tiles_in_slot


@jit
def gemm_ar_kernel(a_desc, b_desc, scale_a_ptr, scale_b_ptr, out_ptr, tiles_ptr, flags_ptr, calls_ptr, M, N, K,
                   local_world_size, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, FLATTEN: tl.constexpr, group):
    """out is M x N, the same bits on every rank; the workspace as the module docstring says;
    ranks of `group` (None: the world). Its loop over the peers beside the K loop cannot be fused:
    no FLATTEN."""
    tl.static_assert(not FLATTEN, "gemm_ar takes configs with FLATTEN=False")
    epoch = call_epoch(calls_ptr)
    scale = persistent.load_scale(scale_a_ptr, scale_b_ptr)
    me = dl.rank(group)
    world = dl.num_ranks(group)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_shard = tiles_m * tiles_n
    tiles = tiles_in_slot(tiles_ptr, epoch, world * per_shard, BLOCK_M, BLOCK_N)
    flags = in_slot(flags_ptr, epoch, world * per_shard)
    offsets = tile_offsets(BLOCK_M, BLOCK_N)
    for t in tl.range(tl.program_id(0), per_shard, tl.num_programs(0), flatten=FLATTEN):
        tm, tn = persistent.tile_coords(t, tiles_m, tiles_n, GROUP_M)
        acc = persistent.tile_product(a_desc, b_desc, tm * BLOCK_M, tn * BLOCK_N, K, BLOCK_M, BLOCK_N, BLOCK_K)
        mine = tile_at(tiles, me * per_shard + t, BLOCK_M, BLOCK_N)
        my_flag = flags + me * per_shard + t
        values = (acc * scale).to(tiles_ptr.dtype.element_ty)
        tl.store(mine + offsets, values)
        for step in range(1, world):
            send_tile(values, mine, mine, my_flag, epoch, (me + step) % world, local_world_size, BLOCK_M, BLOCK_N,
                      group)
    sync_program()  # this program's own tiles, stored by all its threads, are read back below
    for t in range(tl.program_id(0), per_shard, tl.num_programs(0)):
        tm, tn = persistent.tile_coords(t, tiles_m, tiles_n, GROUP_M)
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for src in range(world):
            if src == me:
                total += tl.load(tile_at(tiles, me * per_shard + t, BLOCK_M, BLOCK_N) + offsets).to(tl.float32)
            else:
                total += received_tile(tiles, flags, src, t, per_shard, epoch, BLOCK_M, BLOCK_N)
        persistent.store_tile(out_ptr, total, tm * BLOCK_M, tn * BLOCK_N, M, N, BLOCK_M, BLOCK_N)
    dl.shmem.quiet()
    finish_call(calls_ptr)


class OneShot(TileMethod):
    """gemm_ar on any topology: a workspace of world x per_shard tiles per slot, and
    `gemm_ar_kernel` on a program per SM (fewer for fewer tiles)."""

    name = "one_shot"
    flatten = False  # Triton cannot fuse its loop over the peers: it takes configs without FLATTEN
    kernel = gemm_ar_kernel
