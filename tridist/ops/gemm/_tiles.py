"""What the methods of gemm_rs and gemm_ar that exchange partial tiles share: the device helpers
that send a tile to a peer and read one that has arrived, and `TileMethod`, their workspace plan
and launch.

A buffer of tiles holds BLOCK_M x BLOCK_N tiles back to back, each tile's elements contiguous,
row by row, with one flag per tile. A tile goes to a peer on this node as stores through
`symm_at` followed by a release of its flag; to another node as an NVSHMEM put with the signal
attached. A reader waits for the flag with an acquire and only then loads the tile.
"""
import torch
import triton
import triton.language as tl

import tridist.language as dl

from .. import sizing
from ..protocol import Workspace, after_flags, in_slot, sync_program
from ..method import Method
from ..ranks import Ranks
from . import persistent


@triton.jit
def tile_at(tiles, index, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The address of tile `index` of a buffer of tiles (64-bit offsets: the buffer may pass 2^31
    elements)."""
    return tiles + tl.cast(index, tl.int64) * (BLOCK_M * BLOCK_N)


@triton.jit
def tiles_in_slot(tiles_ptr, epoch, tiles_per_slot, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The first tile of call `epoch`'s slot of a two-slot buffer of `tiles_per_slot` tiles a slot
    (`in_slot`, counted in tiles)."""
    return in_slot(tiles_ptr, epoch, tl.cast(tiles_per_slot, tl.int64) * (BLOCK_M * BLOCK_N))


@triton.jit
def tile_offsets(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Offsets of the elements of a tile from its address."""
    return tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]


@triton.jit
def send_tile(values, tile_ptr, staging_ptr, flag_ptr, epoch, peer, local_world_size, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, group):
    """Write `values` to `peer`'s copy of the tile at `tile_ptr` and raise its flag to `epoch`;
    across nodes through `staging_ptr`, a symmetric tile of this rank's that the put reads (the
    caller's `dl.shmem.quiet` completes it). `peer` and `local_world_size` are of `group` (None:
    the world)."""
    offsets = tile_offsets(BLOCK_M, BLOCK_N)
    if peer // local_world_size == dl.rank(group) // local_world_size:
        tl.store(dl.symm_at(tile_ptr, peer, group) + offsets, values)
        dl.notify(flag_ptr, peer, signal=epoch, sig_op="set", group=group)
    else:
        sync_program()  # the staging tile may have just been read by other threads of the block
        tl.store(staging_ptr + offsets, values)
        sync_program()  # the whole block reads the tile it stored
        nbytes = BLOCK_M * BLOCK_N * (tile_ptr.dtype.element_ty.primitive_bitwidth // 8)
        dl.shmem.putmem_signal_block(tile_ptr, staging_ptr, nbytes, flag_ptr, epoch, dl.shmem.SIGNAL_SET, peer, group)


@triton.jit
def received_tile(tiles, flags, src, t, per_shard, epoch, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Tile t of rank src's `per_shard` tiles in `tiles` (its flags in `flags`), in fp32, once its
    flag reads `epoch`."""
    tile_ptr = after_flags(tile_at(tiles, src * per_shard + t, BLOCK_M, BLOCK_N), flags + src * per_shard + t, 1,
                           epoch)
    return tl.load(tile_ptr + tile_offsets(BLOCK_M, BLOCK_N)).to(tl.float32)


class TileMethod(Method):
    """A method whose one persistent kernel, `kernel`, exchanges partial tiles through a
    `Workspace` of `regions` x world_size x per_shard tiles per slot (a flag per tile), per_shard
    being the output tiles of one rank's rows (`scatter`: gemm_rs) or of the whole product
    (gemm_ar). The kernel runs on a program per SM this process may use, fewer for fewer tiles;
    with `coresident`, on what can be resident at once, asked at the first call and kept (the grid
    counts the call epochs: `sizing.fit_coresident`).

    Built for an m x k by k x n product of `dtype` with `config`, among `ranks` (an
    `ops.ranks.Ranks`: the world or a group, whose size is world_size); `launch(a, b, out, scale_a,
    scale_b)` writes this rank's result (m / world_size rows with `scatter`, else m) into `out`.
    Each subclass names its kernel, which takes the arguments `launch` passes, and its plan.
    """

    kernel = None
    regions = 1
    scatter = False
    coresident = False

    def __init__(self, m: int, k: int, n: int, dtype: torch.dtype, config: dict, ranks: Ranks):
        super().__init__()
        self.ranks = w = ranks
        self.m, self.k, self.n, self.config = m, k, n, config
        shards = w.world_size if self.scatter else 1
        tiles = shards * triton.cdiv(m // shards, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"])
        self.programs = min(sizing.programs_for(w.device), tiles)
        self.fitted = not self.coresident
        slot_tiles = self.regions * w.world_size * (tiles // shards)
        self.workspace = self.own(Workspace(slot_tiles * config["BLOCK_M"] * config["BLOCK_N"],
                                            persistent.out_dtype(dtype), slot_tiles, group=w.group))

    def launch(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, scale_a: torch.Tensor | None,
               scale_b: torch.Tensor | None) -> None:
        a_desc, b_desc = persistent.descriptors(a, b, self.config)
        ws = self.workspace
        args = dict(a_desc=a_desc, b_desc=b_desc, scale_a_ptr=scale_a, scale_b_ptr=scale_b, out_ptr=out,
                    tiles_ptr=ws.staging, flags_ptr=ws.flags, calls_ptr=ws.calls, M=self.m, N=self.n, K=self.k,
                    local_world_size=self.ranks.local_world_size, group=self.ranks.group, **self.config)
        if not self.fitted:
            self.programs = sizing.fit_coresident(self.kernel, self.programs, 1, **args)
            self.fitted = True
        self.kernel[(self.programs,)](**args, coresident=self.coresident)
