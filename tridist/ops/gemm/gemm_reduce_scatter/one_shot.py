"""gemm_rs on one node ("one_shot"): every partial tile goes straight to the rank that owns its
rows, which sums it into its own.

Protocol (one persistent kernel; `_tiles` for how a tile travels, `_protocol.py` for slots and
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
  it in the grid, so the kernel launches co-resident (`kernel[grid](..., coresident=True)`): one
  program per SM this process may use, fewer if fewer fit (`_protocol.fit_coresident`, asked at
  the first call and kept, since the grid counts the call epochs).
"""
import torch
import triton
import triton.language as tl

import tridist
import tridist.language as dl
from tridist.runtime.jit import jit

from ... import _protocol
from ..._protocol import Workspace, call_epoch, finish_call, in_slot
from ...method import Method
from .. import persistent
from .._tiles import received_tile, tile_at, tile_offsets, tiles_in_slot


@jit
def gemm_rs_kernel(a_desc, b_desc, scale_a_ptr, scale_b_ptr, out_ptr, tiles_ptr, flags_ptr, calls_ptr, M, N, K,
                   local_world_size, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, FLATTEN: tl.constexpr):
    """out is this rank's M/world x N rows of the sum. FLATTEN lets Triton load the next tile's
    operands during this one's epilogue. Triton 3.6's loop fusion fails on a value computed after
    the K loop and used only inside a branch of the epilogue, so every branch computes its own
    addresses."""
    epoch = call_epoch(calls_ptr)
    scale = persistent.load_scale(scale_a_ptr, scale_b_ptr)
    me = dl.rank()
    world = dl.num_ranks()
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
            dl.notify(late_flag, late_peer, signal=epoch, sig_op="set")
            late_peer = tl.cast(-1, tl.int32)
        if shard != me:
            mine = tile_at(tiles, me * per_shard + t, BLOCK_M, BLOCK_N)
            tl.store(dl.symm_at(mine, shard) + offsets, (acc * scale).to(tiles_ptr.dtype.element_ty))
            late_peer = shard
            late_flag = flags + me * per_shard + t
        else:
            acc *= scale
            for step in range(1, world):
                acc += received_tile(tiles, flags, (me + step) % world, t, per_shard, epoch, BLOCK_M, BLOCK_N)
            persistent.store_tile(out_ptr, acc, tm * BLOCK_M, tn * BLOCK_N, rows, N, BLOCK_M, BLOCK_N)
    if late_peer >= 0:
        dl.notify(late_flag, late_peer, signal=epoch, sig_op="set")
    finish_call(calls_ptr)


class OneShot(Method):
    """gemm_rs on one node: a workspace of world x per_shard tiles per slot, and `gemm_rs_kernel`
    on one co-resident program per SM (fewer if fewer fit). Built for an m x k by k x n product of
    `dtype` with `config`; `launch(a, b, out, scale_a, scale_b)` writes this rank's m / world_size
    rows of the sum into `out`."""

    name = "one_shot"
    one_node = True
    flatten = True  # Triton can fuse its loop nest: it takes configs with FLATTEN

    def __init__(self, m: int, k: int, n: int, dtype: torch.dtype, config: dict):
        super().__init__()
        self.world = w = tridist.world()
        self.m, self.k, self.n, self.config = m, k, n, config
        block = config["BLOCK_M"] * config["BLOCK_N"]
        tiles = w.world_size * triton.cdiv(m // w.world_size, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"])
        self.programs = min(_protocol.programs_for(w.device), tiles)
        self.fitted = False  # the grid shrinks to what can be resident, at the first call
        self.workspace = self.own(Workspace(tiles * block, persistent.out_dtype(dtype), tiles))

    def launch(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, scale_a: torch.Tensor | None,
               scale_b: torch.Tensor | None) -> None:
        a_desc, b_desc = persistent.descriptors(a, b, self.config)
        ws = self.workspace
        args = dict(a_desc=a_desc, b_desc=b_desc, scale_a_ptr=scale_a, scale_b_ptr=scale_b, out_ptr=out,
                    tiles_ptr=ws.staging, flags_ptr=ws.flags, calls_ptr=ws.calls, M=self.m, N=self.n, K=self.k,
                    local_world_size=self.world.local_world_size, **self.config)
        if not self.fitted:
            self.programs = _protocol.fit_coresident(gemm_rs_kernel, self.programs, 1, **args)
            self.fitted = True
        gemm_rs_kernel[(self.programs,)](**args, coresident=True)
