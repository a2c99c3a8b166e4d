"""GEMM-ReduceScatter and GEMM-AllReduce: the partial products of a row-parallel layer, summed
over ranks while the GEMM runs.

Shapes: a is M x K_local, b is K_local x N on every rank; the partial product a @ b is M x N.
gemm_rs gives rank r rows [r * M/world, (r+1) * M/world) of the sum over ranks; gemm_ar gives every
rank all of it.

Protocol (one persistent kernel; see `_protocol.py` for slots and call epochs)

- `tiles` is a symmetric buffer of partial tiles: tiles[slot, src, t] holds rank src's partial
  product of output tile t, BLOCK_M x BLOCK_N contiguous elements; flag (slot, src, t) says it has
  arrived.
- gemm_rs (`gemm_rs_kernel`): tile t of shard s is computed by every rank and sent to rank s, which sums it. Each rank
  takes the shards in the order rank+1, rank+2, ..., its own last: by the time it reaches its own
  tiles, every peer has long sent its part of them, so the reductions rarely wait; the sum is
  added to the fp32 accumulator of this rank's own part and stored once.
- gemm_ar (`gemm_ar_kernel`): every rank computes every tile and sends it to every peer; a second pass over the same
  tiles sums the partials of ranks 0, 1, ... in that order, so every rank ends with the same bits.
  method="ll" (`gemm_ar_ll_kernel`, one node) sends the tiles as low-latency packets (`dl.ll`):
  each 4-byte word of two outputs travels with the call epoch as its flag, so no release of a flag
  waits for the tile's stores to drain and the reader polls the data itself. Twice the bytes: for
  decode-sized M, where latency dominates.
- gemm_rs across nodes (`gemm_rs_2d_kernel`) reduces in two steps so that each tile crosses to a
  node once: partial tiles for a rank on another node go to this node's rank with the same local
  index (its "counterpart"), which sums them and puts the node's sum to the owner; the owner adds
  its node's partials and one sum per other node.
- A tile goes to a peer on the node as stores through symm_at followed by a release of its flag;
  to another node as an NVSHMEM put with the signal attached, from this rank's symmetric copy.
- gemm_rs's programs wait for tiles that any program of a peer may compute, perhaps one that
  comes after them in the grid, so they launch co-resident (`kernel[grid](..., coresident=True)`):
  one per SM this process may use, fewer if fewer fit (`_protocol.fit_coresident`, asked at the
  first call). gemm_ar's programs wait only for the tiles of the same program on the peers, which
  every rank's program sends before it waits, so any grid finishes.
Partial tiles travel in the output dtype (bf16 for fp8 operands, each rank's partial scaled by
its own scales); sums accumulate in fp32.
"""
import torch
import triton
import triton.language as tl

import tridist
import tridist.language as dl
from tridist.runtime.jit import jit

from .. import _protocol
from . import persistent
from .._protocol import (PacketRows, Workspace, after_flags, call_epoch, finish_call, pack_halves, placement,
                        sync_program, unpack_halves)

GEMM_AR_METHODS = ("auto", "one_shot", "ll")
# Words (two 16-bit values each) gemm_ar's LL kernel moves per loop step, or a whole tile if it holds
# fewer: a step of 2048, 16 KB of packets, compiled for Hopper without spilling registers.
LL_STEP = 2048


@triton.jit
def _tile(tiles, index, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The address of tile `index` of a block of contiguous BLOCK_M x BLOCK_N tiles."""
    return tiles + tl.cast(index, tl.int64) * (BLOCK_M * BLOCK_N)


@triton.jit
def _slot(tiles_ptr, flags_ptr, epoch, tiles_per_slot, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The tiles and the flags of this call's slot (`_protocol.py`: call e uses slot e % 2)."""
    slot = epoch % 2
    return _tile(tiles_ptr, slot * tiles_per_slot, BLOCK_M, BLOCK_N), flags_ptr + slot * tiles_per_slot


@triton.jit
def _tile_offsets(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Offsets of the elements of a BLOCK_M x BLOCK_N tile stored contiguously, row by row."""
    return tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]


@triton.jit
def _send_tile(values, tile_ptr, staging_ptr, flag_ptr, epoch, peer, local_world_size, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Write `values` to `peer`'s copy of the tile at `tile_ptr` and raise its flag to `epoch`;
    across nodes through `staging_ptr`, a symmetric tile of this rank's."""
    offsets = _tile_offsets(BLOCK_M, BLOCK_N)
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
def _received_tile(tiles, flags, src, t, per_shard, epoch, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rank src's partial tile t of this slot, once its flag says it is here."""
    tile_ptr = after_flags(_tile(tiles, src * per_shard + t, BLOCK_M, BLOCK_N), flags + src * per_shard + t, 1, epoch)
    offsets = _tile_offsets(BLOCK_M, BLOCK_N)
    return tl.load(tile_ptr + offsets).to(tl.float32)


@jit
def gemm_rs_kernel(a_desc, b_desc, scale_a_ptr, scale_b_ptr, out_ptr, tiles_ptr, flags_ptr, calls_ptr, M, N, K,
                   local_world_size, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, FLATTEN: tl.constexpr):
    """gemm_rs on one node: out is M/world x N. A slot of `tiles` holds world x (tiles per shard)
    tiles, rank src's partial of tile t of this rank's shard at src * per_shard + t. The tiles of
    shard rank+1 come first, this rank's own last: by then the peers' partials of them have arrived.
    FLATTEN lets Triton load the next tile's operands during this one's epilogue. Triton 3.6's loop
    fusion fails on a value computed after the K loop and used only inside a branch of the
    epilogue, so every branch computes its own addresses."""
    epoch = call_epoch(calls_ptr)
    scale = persistent.load_scale(scale_a_ptr, scale_b_ptr)
    me = dl.rank()
    world = dl.num_ranks()
    rows = M // world
    tiles_m = tl.cdiv(rows, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_shard = tiles_m * tiles_n
    tiles, flags = _slot(tiles_ptr, flags_ptr, epoch, world * per_shard, BLOCK_M, BLOCK_N)
    offsets = _tile_offsets(BLOCK_M, BLOCK_N)
    # A peer's flag for a tile goes up one tile late: by then the tile's stores have drained over
    # NVLink and the release costs nothing, where at once it would stall the program.
    late_peer = tl.cast(-1, tl.int32)
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
            mine = _tile(tiles, me * per_shard + t, BLOCK_M, BLOCK_N)
            tl.store(dl.symm_at(mine, shard) + offsets, (acc * scale).to(tiles_ptr.dtype.element_ty))
            late_peer = shard
            late_flag = flags + me * per_shard + t
        else:
            acc *= scale
            for step in range(1, world):
                acc += _received_tile(tiles, flags, (me + step) % world, t, per_shard, epoch, BLOCK_M, BLOCK_N)
            persistent.store_tile(out_ptr, acc, tm * BLOCK_M, tn * BLOCK_N, rows, N, BLOCK_M, BLOCK_N)
    if late_peer >= 0:
        dl.notify(late_flag, late_peer, signal=epoch, sig_op="set")
    finish_call(calls_ptr)


@jit
def gemm_ar_kernel(a_desc, b_desc, scale_a_ptr, scale_b_ptr, out_ptr, tiles_ptr, flags_ptr, calls_ptr, M, N, K,
                   local_world_size, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, FLATTEN: tl.constexpr):
    """gemm_ar, one-shot: out is M x N. A slot of `tiles` holds world x (tiles of out) tiles, rank
    src's partial of tile t at src * per_shard + t. A program sends each of its tiles to every rank
    as soon as it is computed, then sums the same tiles over the ranks in rank order. Its loop over
    the peers beside the K loop cannot be fused: no FLATTEN."""
    tl.static_assert(not FLATTEN, "gemm_ar takes configs with FLATTEN=False")
    epoch = call_epoch(calls_ptr)
    scale = persistent.load_scale(scale_a_ptr, scale_b_ptr)
    me = dl.rank()
    world = dl.num_ranks()
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_shard = tiles_m * tiles_n
    tiles, flags = _slot(tiles_ptr, flags_ptr, epoch, world * per_shard, BLOCK_M, BLOCK_N)
    offsets = _tile_offsets(BLOCK_M, BLOCK_N)
    for t in tl.range(tl.program_id(0), per_shard, tl.num_programs(0), flatten=FLATTEN):
        tm, tn = persistent.tile_coords(t, tiles_m, tiles_n, GROUP_M)
        acc = persistent.tile_product(a_desc, b_desc, tm * BLOCK_M, tn * BLOCK_N, K, BLOCK_M, BLOCK_N, BLOCK_K)
        mine = _tile(tiles, me * per_shard + t, BLOCK_M, BLOCK_N)
        my_flag = flags + me * per_shard + t
        values = (acc * scale).to(tiles_ptr.dtype.element_ty)
        tl.store(mine + offsets, values)
        for step in range(1, world):
            _send_tile(values, mine, mine, my_flag, epoch, (me + step) % world, local_world_size, BLOCK_M, BLOCK_N)
    sync_program()  # this program's own tiles, stored by all its threads, are read back below
    for t in range(tl.program_id(0), per_shard, tl.num_programs(0)):
        tm, tn = persistent.tile_coords(t, tiles_m, tiles_n, GROUP_M)
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for src in range(world):
            if src == me:
                total += tl.load(_tile(tiles, me * per_shard + t, BLOCK_M, BLOCK_N) + offsets).to(tl.float32)
            else:
                total += _received_tile(tiles, flags, src, t, per_shard, epoch, BLOCK_M, BLOCK_N)
        persistent.store_tile(out_ptr, total, tm * BLOCK_M, tn * BLOCK_N, M, N, BLOCK_M, BLOCK_N)
    dl.shmem.quiet()
    finish_call(calls_ptr)


@jit
def gemm_rs_2d_kernel(a_desc, b_desc, scale_a_ptr, scale_b_ptr, out_ptr, tiles_ptr, flags_ptr, calls_ptr, M, N, K,
                      local_world_size, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr, FLATTEN: tl.constexpr):
    """gemm_rs across nodes, with L ranks per node and `nodes` nodes. A slot holds two regions of
    world x (tiles per shard) tiles, each with a flag per tile:
    - received[src, t]: a partial of tile t of this rank's shard from src on this node (src = this
      rank: its own), or the sum of node n's partials from src, this rank's counterpart on node n;
    - gathered[l, n, t]: local rank l's partial of tile t of the shard of the rank with this local
      index on node n (so this rank is its counterpart), later this node's sum of them.
    Three passes, each waiting only on the ones before it, so no rank waits on one that waits back:
    compute and send every tile; sum and put the node's sums; sum this rank's own tiles."""
    tl.static_assert(not FLATTEN, "gemm_rs_2d_kernel takes configs with FLATTEN=False")
    epoch = call_epoch(calls_ptr)
    scale = persistent.load_scale(scale_a_ptr, scale_b_ptr)
    me, world, nodes, node, local = placement(local_world_size)
    rows = M // world
    tiles_m = tl.cdiv(rows, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_shard = tiles_m * tiles_n
    slot = epoch % 2
    received = _tile(tiles_ptr, slot * 2 * world * per_shard, BLOCK_M, BLOCK_N)
    gathered = _tile(received, world * per_shard, BLOCK_M, BLOCK_N)
    received_flags = flags_ptr + slot * 2 * world * per_shard
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
            to = _tile(received, index, BLOCK_M, BLOCK_N)
            _send_tile(values, to, to, received_flags + index, epoch, shard, local_world_size, BLOCK_M, BLOCK_N)
        else:
            index = (local * nodes + shard // local_world_size) * per_shard + t
            to = _tile(gathered, index, BLOCK_M, BLOCK_N)
            _send_tile(values, to, to, gathered_flags + index, epoch, node * local_world_size + shard % local_world_size,
                       local_world_size, BLOCK_M, BLOCK_N)
    for item in range(tl.program_id(0), (nodes - 1) * per_shard, tl.num_programs(0)):
        other = (node + 1 + item // per_shard) % nodes
        t = item % per_shard
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for l in range(local_world_size):
            total += _received_tile(gathered, gathered_flags, l * nodes + other, t, per_shard, epoch, BLOCK_M, BLOCK_N)
        # The sum is staged where this rank's own partial was, which it has just read.
        node_sum = _tile(gathered, (local * nodes + other) * per_shard + t, BLOCK_M, BLOCK_N)
        _send_tile(total.to(tiles_ptr.dtype.element_ty), _tile(received, me * per_shard + t, BLOCK_M, BLOCK_N),
                   node_sum, received_flags + me * per_shard + t, epoch, other * local_world_size + local,
                   local_world_size, BLOCK_M, BLOCK_N)
    for t in range(tl.program_id(0), per_shard, tl.num_programs(0)):
        tm, tn = persistent.tile_coords(t, tiles_m, tiles_n, GROUP_M)
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for l in range(local_world_size):
            total += _received_tile(received, received_flags, node * local_world_size + l, t, per_shard, epoch,
                                    BLOCK_M, BLOCK_N)
        for n in range(nodes):
            if n != node:
                total += _received_tile(received, received_flags, n * local_world_size + local, t, per_shard, epoch,
                                        BLOCK_M, BLOCK_N)
        persistent.store_tile(out_ptr, total, tm * BLOCK_M, tn * BLOCK_N, rows, N, BLOCK_M, BLOCK_N)
    dl.shmem.quiet()
    finish_call(calls_ptr)


@jit
def gemm_ar_ll_kernel(a_desc, b_desc, scale_a_ptr, scale_b_ptr, out_ptr, own_ptr, packets_ptr, calls_ptr, M, N, K,
                      row, slot_numel, DTYPE: tl.constexpr, STEP: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, FLATTEN: tl.constexpr):
    """gemm_ar in packets. out is viewed as M x N/2 int32 words (two outputs each); `own` holds this
    rank's tiles, BLOCK_M x BLOCK_N contiguous each, read back as words; row `src` of a packet slot
    holds rank src's tiles as words, tile t at t * BLOCK_M * BLOCK_N / 2. A program sends each of
    its tiles as soon as it is computed, then sums the same tiles over the ranks in rank order."""
    tl.static_assert(not FLATTEN, "gemm_ar_ll_kernel takes configs with FLATTEN=False")
    TILE_WORDS: tl.constexpr = BLOCK_M * BLOCK_N // 2
    epoch = call_epoch(calls_ptr)
    scale = persistent.load_scale(scale_a_ptr, scale_b_ptr)
    me = dl.rank()
    world = dl.num_ranks()
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    stage = packets_ptr + (epoch % 2) * slot_numel
    offsets = _tile_offsets(BLOCK_M, BLOCK_N)
    words = tl.arange(0, STEP)
    every = words < STEP
    for t in range(tl.program_id(0), tiles_m * tiles_n, tl.num_programs(0)):
        tm, tn = persistent.tile_coords(t, tiles_m, tiles_n, GROUP_M)
        acc = persistent.tile_product(a_desc, b_desc, tm * BLOCK_M, tn * BLOCK_N, K, BLOCK_M, BLOCK_N, BLOCK_K)
        mine = _tile(own_ptr, t, BLOCK_M, BLOCK_N)
        tl.store(mine + offsets, (acc * scale).to(own_ptr.dtype.element_ty))
        sync_program()  # the words are read back by other threads than stored them
        mine_words = mine.to(tl.pointer_type(tl.int32))
        for step in range(1, world):
            remote = dl.symm_at(stage + me * row + t * TILE_WORDS, (me + step) % world)
            for start in range(0, TILE_WORDS, STEP):
                dl.ll.send(remote + start + words, tl.load(mine_words + start + words), epoch, every)
    for t in range(tl.program_id(0), tiles_m * tiles_n, tl.num_programs(0)):
        tm, tn = persistent.tile_coords(t, tiles_m, tiles_n, GROUP_M)
        mine_words = _tile(own_ptr, t, BLOCK_M, BLOCK_N).to(tl.pointer_type(tl.int32))
        for start in range(0, TILE_WORDS, STEP):
            low = tl.zeros([STEP], tl.float32)
            high = tl.zeros([STEP], tl.float32)
            for src in range(world):
                if src == me:
                    part = tl.load(mine_words + start + words)
                else:
                    part = dl.ll.recv(stage + src * row + t * TILE_WORDS + start + words, epoch, every)
                part_low, part_high = unpack_halves(part, DTYPE)
                low += part_low
                high += part_high
            rows = tm * BLOCK_M + (start + words) // (BLOCK_N // 2)
            cols = tn * (BLOCK_N // 2) + (start + words) % (BLOCK_N // 2)
            tl.store(out_ptr + rows.to(tl.int64) * (N // 2) + cols, pack_halves(low, high, DTYPE),
                     mask=(rows < M) & (cols < N // 2))
    finish_call(calls_ptr)


class _GemmReduce:
    def __init__(self, m: int, k: int, n: int, dtype: torch.dtype, scatter: bool, config: dict | str | None,
                 method: str = "one_shot"):
        self.world = w = tridist.world()
        name = "gemm_rs" if scatter else "gemm_ar"
        persistent.check_sizes(name, dtype, k, n)
        if scatter and m % w.world_size:
            raise ValueError(f"gemm_rs splits the M = {m} rows of the product over {w.world_size} ranks: make M a "
                             "multiple of the world size")
        self.name, self.m, self.k, self.n, self.dtype, self.scatter = name, m, k, n, dtype, scatter
        self.out_dtype = persistent.out_dtype(dtype)
        self.two_levels = scatter and w.nnodes > 1  # gemm_rs_2d_kernel, with two regions per slot
        flatten = scatter and not self.two_levels  # only gemm_rs_kernel's loop can be fused
        if isinstance(config, dict) and config.get("FLATTEN") and not flatten:
            what = "gemm_rs across nodes" if scatter else name
            raise ValueError(f"{what} takes configs with FLATTEN=False (Triton cannot flatten its loop nest); got "
                             f"{config}")
        self.rows = m // w.world_size if scatter else m
        self.method = method
        self.fitted = not scatter  # gemm_rs fits its grid to what can be resident at its first call
        self.config = persistent.resolve_config(
            config, name, (m, k, n, str(dtype), method), lambda c: self._with_config(c),
            lambda: persistent.random_operands(m, k, n, dtype, w.device), w.device, m, n, flatten=flatten,
            dtype=dtype)  # every rank computes all m rows
        block_m, block_n = self.config["BLOCK_M"], self.config["BLOCK_N"]
        self.per_shard = triton.cdiv(self.rows, block_m) * triton.cdiv(n, block_n)
        self.programs = min(_protocol.programs_for(w.device), (w.world_size if scatter else 1) * self.per_shard)
        if method == "ll":
            _protocol.require_one_node("gemm_ar method 'll'", "method='one_shot'")
            tile_bytes = block_m * block_n * self.out_dtype.itemsize
            self.workspace = PacketRows(name, self.per_shard * tile_bytes, self.programs)
            self.own = torch.empty(self.per_shard * block_m * block_n, dtype=self.out_dtype, device=w.device)
            return
        slot_tiles = (2 if self.two_levels else 1) * w.world_size * self.per_shard
        self.workspace = Workspace(slot_tiles * block_m * block_n, self.out_dtype, slot_tiles)

    def __call__(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None,
                 scale_a: torch.Tensor | None = None, scale_b: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's part of the sum over ranks of `a @ b`, into `out`.

        Args:
            a: m x k of `dtype` (as built), row-major, on this rank's device.
            b: k x n of `dtype` (column-major for fp8).
            out: the result (m / world_size rows for gemm_rs, m for gemm_ar) x n, of the output
                dtype (bf16 for fp8); a new tensor if None.
            scale_a: fp8 only: this rank's scale of a (a one-element float32 tensor).
            scale_b: fp8 only: this rank's scale of b.

        Returns:
            `out`.

        Raises:
            ValueError: operands, scales or `out` not what this instance was built for.
        """
        out = persistent.check_call(a, b, scale_a, scale_b, out, self.rows,
                              built=(self.name, (self.m, self.k), (self.k, self.n), self.dtype))
        ws = self.workspace
        a_desc, b_desc = persistent.descriptors(a, b, self.config)
        if self.method == "ll":
            gemm_ar_ll_kernel[(self.programs,)](
                a_desc, b_desc, scale_a, scale_b, out.view(torch.int32), self.own, ws.staging, ws.calls, self.m, self.n,
                self.k, ws.row, ws.slot_numel, DTYPE=_protocol.TRITON_DTYPES[self.out_dtype],
                STEP=min(LL_STEP, self.config["BLOCK_M"] * self.config["BLOCK_N"] // 2),
                **self.config)
            return out
        args = (a_desc, b_desc, scale_a, scale_b, out, ws.staging, ws.flags, ws.calls, self.m, self.n, self.k,
                self.world.local_world_size)
        if self.scatter:
            kernel = gemm_rs_2d_kernel if self.two_levels else gemm_rs_kernel
            if not self.fitted:
                self.programs = _protocol.fit_coresident(kernel, self.programs, 1, *args, **self.config)
                self.fitted = True
            kernel[(self.programs,)](*args, coresident=True, **self.config)
        else:
            gemm_ar_kernel[(self.programs,)](*args, **self.config)
        return out

    def free(self) -> None:
        """Give the symmetric buffers back (collective: every rank, in the same order)."""
        self.workspace.free()


class GemmReduceScatter(_GemmReduce):
    """`reduce_scatter(a @ b)` for a of m x k and b of k x n, with its own symmetric buffers: rank
    r gets rows `[r * m / world_size, (r + 1) * m / world_size)` of the sum over ranks.

    One persistent kernel: every rank computes every output tile of its partial product, and
    sends the tiles of rank s's rows to rank s from the GEMM's epilogue (stores through `symm_at`
    and a flag per tile on one node, a put with signal across nodes); each rank takes the shards
    in the order rank+1, rank+2, ..., its own last, and adds the partials it received to its own
    in fp32. Across nodes the tiles are summed on the node first, and one put per node carries
    the node's sum. Needs its whole grid resident (one program per SM): nothing else may occupy
    the SMs while it runs.

    Build it on every rank at once; call it back to back on one stream, also in CUDA graphs;
    `free()` it on every rank. `tridist.ops.gemm_rs` keeps one per shape and stream.

    Args:
        m: rows of a (all of the product's rows), a multiple of the world size.
        k: columns of a (this rank's part of the layer's K), rows of b.
        n: columns of b.
        dtype: bf16, fp16 or fp8.
        config: a dict from [`configs`][tridist.ops.gemm.configs], None for the default, or
            `"tune"`. Across nodes only configs without `FLATTEN`.

    Raises:
        ValueError: a dtype it does not take, K or N not a multiple of 8 (16 for fp8), m not a
            multiple of the world size, a `FLATTEN` config across nodes.
    """

    def __init__(self, m: int, k: int, n: int, dtype: torch.dtype, config: dict | str | None = None):
        super().__init__(m, k, n, dtype, scatter=True, config=config)

    def _with_config(self, config: dict) -> "GemmReduceScatter":
        return GemmReduceScatter(self.m, self.k, self.n, self.dtype, config=config)


class GemmAllReduce(_GemmReduce):
    """`all_reduce(a @ b)` for a of m x k and b of k x n, with its own symmetric buffers; made for
    decode-sized m (up to a few hundred rows). Every rank computes every tile of its partial
    product and sends it to every peer; a second pass sums the partials of ranks 0, 1, ... in that
    order, so every rank ends with the same bits.

    | method | how | where |
    | --- | --- | --- |
    | `"one_shot"` | tiles stored to every peer, a flag per tile | any topology |
    | `"ll"` | the tiles in low-latency packets: each 4-byte word of two outputs travels with the call's epoch as its flag, twice the bytes and no flag round trip | one node |
    | `"auto"` | [`choose_gemm_ar`][tridist.ops.gemm.gemm_reduce.choose_gemm_ar]: `ll` up to 128 rows on one node, else `one_shot` | |

    Build it on every rank at once; call it back to back on one stream, also in CUDA graphs;
    `free()` it on every rank. `tridist.ops.gemm_ar` keeps one per shape and stream.

    Args:
        m: rows of a and of the product.
        k: columns of a (this rank's part of the layer's K), rows of b.
        n: columns of b.
        dtype: bf16, fp16 or fp8.
        method: one of the methods above.
        config: a dict from [`configs`][tridist.ops.gemm.configs] without `FLATTEN`, None for
            the default, or `"tune"`.

    Raises:
        ValueError: an unknown method, a dtype it does not take, K or N not a multiple of 8 (16
            for fp8), a `FLATTEN` config, `"ll"` on several nodes.
    """

    def __init__(self, m: int, k: int, n: int, dtype: torch.dtype, method: str = "auto",
                 config: dict | str | None = None):
        if method not in GEMM_AR_METHODS:
            raise _protocol.method_error("gemm_ar", method, GEMM_AR_METHODS)
        super().__init__(m, k, n, dtype, scatter=False, config=config,
                         method=choose_gemm_ar(m, tridist.world()) if method == "auto" else method)

    def _with_config(self, config: dict) -> "GemmAllReduce":
        return GemmAllReduce(self.m, self.k, self.n, self.dtype, self.method, config=config)


def choose_gemm_ar(m: int, world) -> str:
    """The method `"auto"` runs for an m-row product.

    LL packets for decode-sized M on one node: on 2 x H200 (benchmarks/results/gemm_ar-*-2026-11-23.json,
    K = 8192, bf16) they took 37.2 us at M = 128, N = 8192 (one-shot 45.7, cuBLAS + NCCL 51.5) and
    119.7 us at N = 28672 (one-shot 162.3, cuBLAS + NCCL 152.3); at M = 32 the two ran even (29.8
    and 29.1 us). Above 128 rows the packets' doubled bytes are not worth their latency."""
    return "ll" if world.nnodes == 1 and m <= 128 else "one_shot"


def gemm_rs(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, config: dict | str | None = None,
            scale_a: torch.Tensor | None = None, scale_b: torch.Tensor | None = None) -> torch.Tensor:
    """`reduce_scatter(a @ b)` over the ranks, overlapped with the GEMM: the row-parallel layer of
    tensor parallelism, handing each rank back its own rows.

    A collective: every rank calls it with the same shapes. Keeps one
    [`GemmReduceScatter`][tridist.ops.GemmReduceScatter] per shape, dtype, config and stream.

    Args:
        a: M x K_local (this rank's columns of the activations), row-major; bf16, fp16 or fp8.
            M a multiple of the world size.
        b: K_local x N (this rank's rows of the weight; column-major for fp8).
        out: M / world_size x N; a new tensor if None.
        config: a dict from [`configs`][tridist.ops.gemm.configs], None for the default, or
            `"tune"`.
        scale_a: fp8 only: this rank's scale of a.
        scale_b: fp8 only: this rank's scale of b.

    Returns:
        `out`: this rank's rows of the sum over ranks of `a @ b`.

    Raises:
        ValueError: before any launch, for operands, scales, `out` or config it does not take.
    """
    return persistent.cached(GemmReduceScatter, a, b, config)(a, b, out, scale_a, scale_b)


def gemm_ar(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, method: str = "auto",
            config: dict | str | None = None, scale_a: torch.Tensor | None = None,
            scale_b: torch.Tensor | None = None) -> torch.Tensor:
    """`all_reduce(a @ b)` over the ranks, overlapped with the GEMM: the row-parallel layer at
    decode-sized M.

    A collective: every rank calls it with the same shapes. Keeps one
    [`GemmAllReduce`][tridist.ops.GemmAllReduce] per shape, dtype, method, config and stream.

    Args:
        a: M x K_local, row-major; bf16, fp16 or fp8.
        b: K_local x N (column-major for fp8).
        out: M x N; a new tensor if None.
        method: `"auto"`, `"one_shot"` or `"ll"` (see `GemmAllReduce`).
        config: a dict from [`configs`][tridist.ops.gemm.configs] without `FLATTEN`, None for
            the default, or `"tune"`.
        scale_a: fp8 only: this rank's scale of a.
        scale_b: fp8 only: this rank's scale of b.

    Returns:
        `out`: the sum over ranks of `a @ b`, the same bits on every rank.

    Raises:
        ValueError: before any launch, for operands, scales, `out`, method or config it does not
            take.
    """
    return persistent.cached(GemmAllReduce, a, b, config, method=method)(a, b, out, scale_a, scale_b)


@torch.library.custom_op("tridist::gemm_rs", mutates_args=())
def gemm_rs_op(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor | None = None,
               scale_b: torch.Tensor | None = None) -> torch.Tensor:
    """`gemm_rs` as a PyTorch custom op (`torch.ops.tridist.gemm_rs`), for torch.compile."""
    return gemm_rs(a, b, scale_a=scale_a, scale_b=scale_b)


@gemm_rs_op.register_fake
def _gemm_rs_shape(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor | None = None,
                   scale_b: torch.Tensor | None = None) -> torch.Tensor:
    return a.new_empty((a.shape[0] // tridist.world().world_size, b.shape[1]), dtype=persistent.out_dtype(a.dtype))


@torch.library.custom_op("tridist::gemm_ar", mutates_args=())
def gemm_ar_op(a: torch.Tensor, b: torch.Tensor, method: str = "auto", scale_a: torch.Tensor | None = None,
               scale_b: torch.Tensor | None = None) -> torch.Tensor:
    """`gemm_ar` as a PyTorch custom op (`torch.ops.tridist.gemm_ar`), for torch.compile."""
    return gemm_ar(a, b, method=method, scale_a=scale_a, scale_b=scale_b)


@gemm_ar_op.register_fake
def _gemm_ar_shape(a: torch.Tensor, b: torch.Tensor, method: str = "auto", scale_a: torch.Tensor | None = None,
                   scale_b: torch.Tensor | None = None) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[1]), dtype=persistent.out_dtype(a.dtype))
