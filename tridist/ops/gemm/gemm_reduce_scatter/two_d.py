"""gemm_rs across nodes ("2d"): the partial tiles are summed on each node first, so that each
tile crosses to another node once.

Protocol (one persistent kernel; `_tiles` for how a tile travels, `protocol.py` for slots and
call epochs). L ranks per node, `nodes` nodes; a rank's "counterpart" on another node is the rank
with the same local index there.

- A slot of the workspace holds two regions of world x per_shard tiles (per_shard: the output
  tiles of one rank's rows), each with a flag per tile:
  - received[src, t]: a partial of tile t of this rank's shard from src on this node (src = this
    rank: its own), or the sum of node n's partials from src, this rank's counterpart on node n;
  - gathered[l, n, t]: local rank l's partial of tile t of the shard of the rank with this local
    index on node n (so this rank is its counterpart), later this node's sum of them.
- Three passes, each waiting only on the ones before it, so no rank waits on one that waits back:
  1. compute every tile and send it: to its owner if the owner is on this node (into received),
     else to this node's counterpart of the owner (into gathered);
  2. for each other node, sum the node's partials of this rank's counterpart's shard and put the
     sum to that counterpart (staged where this rank's own partial was, which it has just read);
  3. sum this rank's own tiles: the node's partials and one sum per other node, in fp32.
- A program waits for tiles that any program of a peer may compute, perhaps one that comes after
  it in the grid, so the kernel launches co-resident (`_tiles.TileMethod.coresident`).
"""
import triton.language as tl

import tridist.language as dl
from tridist.runtime.jit import jit

from ...protocol import call_epoch, finish_call, in_slot, placement
from .. import persistent
from .._tiles import TileMethod, received_tile, send_tile, tile_at, tiles_in_slot


@jit
def gemm_rs_2d_kernel(a_desc, b_desc, scale_a_ptr, scale_b_ptr, out_ptr, tiles_ptr, flags_ptr, calls_ptr, M, N, K,
                      local_world_size, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr, FLATTEN: tl.constexpr, group):
    """out is this rank's M/world x N rows of the sum; the workspace's regions as the module
    docstring says; ranks, nodes and L of `group` (None: the world). Its three loops over the tiles
    cannot be fused: no FLATTEN."""
    tl.static_assert(not FLATTEN, "gemm_rs_2d_kernel takes configs with FLATTEN=False")
    epoch = call_epoch(calls_ptr)
    scale = persistent.load_scale(scale_a_ptr, scale_b_ptr)
    me, world, nodes, node, local = placement(local_world_size, group)
    rows = M // world
    tiles_m = tl.cdiv(rows, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_shard = tiles_m * tiles_n
    received = tiles_in_slot(tiles_ptr, epoch, 2 * world * per_shard, BLOCK_M, BLOCK_N)
    gathered = tile_at(received, world * per_shard, BLOCK_M, BLOCK_N)
    received_flags = in_slot(flags_ptr, epoch, 2 * world * per_shard)
    gathered_flags = received_flags + world * per_shard
    for tile in range(tl.program_id(0), world * per_shard, tl.num_programs(0)):
        shard = (me + 1 + tile // per_shard) % world
        t = tile % per_shard
        tm, tn = persistent.tile_coords(t, tiles_m, tiles_n, GROUP_M)
        acc = persistent.tile_product(a_desc, b_desc, shard * rows + tm * BLOCK_M, tn * BLOCK_N, K, BLOCK_M, BLOCK_N,
                                      BLOCK_K)
        values = (acc * scale).to(tiles_ptr.dtype.element_ty)
        if shard // local_world_size == node:  # the owner is on this node (perhaps this rank)
            index = me * per_shard + t
            to = tile_at(received, index, BLOCK_M, BLOCK_N)
            send_tile(values, to, to, received_flags + index, epoch, shard, local_world_size, BLOCK_M, BLOCK_N, group)
        else:
            index = (local * nodes + shard // local_world_size) * per_shard + t
            to = tile_at(gathered, index, BLOCK_M, BLOCK_N)
            send_tile(values, to, to, gathered_flags + index, epoch, node * local_world_size + shard % local_world_size,
                      local_world_size, BLOCK_M, BLOCK_N, group)
    for item in range(tl.program_id(0), (nodes - 1) * per_shard, tl.num_programs(0)):
        other = (node + 1 + item // per_shard) % nodes
        t = item % per_shard
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for l in range(local_world_size):
            total += received_tile(gathered, gathered_flags, l * nodes + other, t, per_shard, epoch, BLOCK_M, BLOCK_N)
        # The sum is staged where this rank's own partial was, which it has just read.
        node_sum = tile_at(gathered, (local * nodes + other) * per_shard + t, BLOCK_M, BLOCK_N)
        send_tile(total.to(tiles_ptr.dtype.element_ty), tile_at(received, me * per_shard + t, BLOCK_M, BLOCK_N),
                  node_sum, received_flags + me * per_shard + t, epoch, other * local_world_size + local,
                  local_world_size, BLOCK_M, BLOCK_N, group)
    for t in range(tl.program_id(0), per_shard, tl.num_programs(0)):
        tm, tn = persistent.tile_coords(t, tiles_m, tiles_n, GROUP_M)
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for l in range(local_world_size):
            total += received_tile(received, received_flags, node * local_world_size + l, t, per_shard, epoch,
                                   BLOCK_M, BLOCK_N)
        for n in range(nodes):
            if n != node:
                total += received_tile(received, received_flags, n * local_world_size + local, t, per_shard, epoch,
                                       BLOCK_M, BLOCK_N)
        persistent.store_tile(out_ptr, total, tm * BLOCK_M, tn * BLOCK_N, rows, N, BLOCK_M, BLOCK_N)
    dl.shmem.quiet()
    finish_call(calls_ptr)


class TwoD(TileMethod):
    """gemm_rs across nodes: a workspace of two regions of world x per_shard tiles per slot, and
    `gemm_rs_2d_kernel` on one co-resident program per SM (fewer if fewer fit)."""

    name = "2d"
    flatten = False  # Triton cannot fuse its three loops: it takes configs without FLATTEN
    kernel = gemm_rs_2d_kernel
    regions = 2
    scatter = True
    coresident = True
