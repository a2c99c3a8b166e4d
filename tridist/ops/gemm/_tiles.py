"""Device helpers of gemm_rs and gemm_ar: partial tiles in a symmetric buffer, sent to peers and
read once their flags say they have arrived.

A buffer of tiles holds BLOCK_M x BLOCK_N tiles back to back, each tile's elements contiguous,
row by row, with one flag per tile. A tile goes to a peer on this node as stores through
`symm_at` followed by a release of its flag; to another node as an NVSHMEM put with the signal
attached. A reader waits for the flag with an acquire and only then loads the tile.
"""
import triton
import triton.language as tl

import tridist.language as dl

from .._protocol import after_flags, in_slot, sync_program


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
              BLOCK_N: tl.constexpr):
    """Write `values` to `peer`'s copy of the tile at `tile_ptr` and raise its flag to `epoch`;
    across nodes through `staging_ptr`, a symmetric tile of this rank's that the put reads (the
    caller's `dl.shmem.quiet` completes it)."""
    offsets = tile_offsets(BLOCK_M, BLOCK_N)
    if peer // local_world_size == dl.rank() // local_world_size:
        tl.store(dl.symm_at(tile_ptr, peer) + offsets, values)
        dl.notify(flag_ptr, peer, signal=epoch, sig_op="set")
    else:
        sync_program()  # the staging tile may have just been read by other threads of the block
        tl.store(staging_ptr + offsets, values)
        sync_program()  # the whole block reads the tile it stored
        nbytes = BLOCK_M * BLOCK_N * (tile_ptr.dtype.element_ty.primitive_bitwidth // 8)
        dl.shmem.putmem_signal_block(tile_ptr, staging_ptr, nbytes, flag_ptr, epoch, dl.shmem.SIGNAL_SET, peer)


@triton.jit
def received_tile(tiles, flags, src, t, per_shard, epoch, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Tile t of rank src's `per_shard` tiles in `tiles` (its flags in `flags`), in fp32, once its
    flag reads `epoch`."""
    tile_ptr = after_flags(tile_at(tiles, src * per_shard + t, BLOCK_M, BLOCK_N), flags + src * per_shard + t, 1,
                           epoch)
    return tl.load(tile_ptr + tile_offsets(BLOCK_M, BLOCK_N)).to(tl.float32)
