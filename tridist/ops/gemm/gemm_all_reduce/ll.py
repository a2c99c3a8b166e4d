"""gemm_ar in low-latency packets ("ll", one node): every rank sends each of its partial tiles to
every peer as LL packets, then sums every tile over the ranks. For decode-sized M, where latency
dominates: each 4-byte word of two outputs travels with the call epoch as its flag (`dl.ll`), so
no release of a flag waits for a tile's stores to drain and the reader polls the data itself;
twice the bytes of `one_shot`.

Protocol (one persistent kernel; `protocol.py` for slots, call epochs and `PacketRows`)

- `own` (a regular tensor) holds this rank's partial tiles, BLOCK_M x BLOCK_N contiguous each,
  read back as int32 words, two 16-bit outputs each.
- Row src of a packet slot holds rank src's tiles as words, tile t at t * BLOCK_M * BLOCK_N / 2;
  call e uses slot e % 2 and sends its packets with the epoch e, so a reader knows a stale word
  from a fresh one without any flag.
- A program sends each of its tiles as soon as it is computed, into row `rank` of every peer's
  slot (stores through `symm_at`: one node only); then, in a second pass over the same tiles, it
  sums the words of ranks 0, 1, ... in that order, so every rank ends with the same bits.
- A program waits only for the packets of the same program on the peers, which every rank's
  program sends before it waits: any grid finishes.
"""
import torch
import triton
import triton.language as tl

import tridist.language as dl
from tridist.runtime.jit import jit

from ... import checks, sizing
from ...protocol import PacketRows, call_epoch, finish_call, in_slot, pack_halves, sync_program, unpack_halves
from ...method import Method
from ...ranks import Ranks
from .. import persistent
from .._tiles import tile_at, tile_offsets

# Words (two 16-bit values each) a loop step moves, or a whole tile if it holds fewer: a step of
# 2048, 16 KB of packets, compiled for Hopper without spilling registers.
LL_STEP = 2048


@jit
def gemm_ar_ll_kernel(a_desc, b_desc, scale_a_ptr, scale_b_ptr, out_ptr, own_ptr, packets_ptr, calls_ptr, M, N, K,
                      row, slot_numel, DTYPE: tl.constexpr, STEP: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, FLATTEN: tl.constexpr,
                      group):
    """out is viewed as M x N/2 int32 words (two outputs each), the same bits on every rank; `own`
    and the packet rows as the module docstring says; ranks of `group` (None: the world). STEP:
    the words a loop step moves. Its loop over the peers beside the K loop cannot be fused: no
    FLATTEN."""
    tl.static_assert(not FLATTEN, "gemm_ar_ll_kernel takes configs with FLATTEN=False")
    TILE_WORDS: tl.constexpr = BLOCK_M * BLOCK_N // 2
    epoch = call_epoch(calls_ptr)
    scale = persistent.load_scale(scale_a_ptr, scale_b_ptr)
    me = dl.rank(group)
    world = dl.num_ranks(group)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    stage = in_slot(packets_ptr, epoch, slot_numel)
    offsets = tile_offsets(BLOCK_M, BLOCK_N)
    words = tl.arange(0, STEP)
    every = words < STEP
    for t in range(tl.program_id(0), tiles_m * tiles_n, tl.num_programs(0)):
        tm, tn = persistent.tile_coords(t, tiles_m, tiles_n, GROUP_M)
        acc = persistent.tile_product(a_desc, b_desc, tm * BLOCK_M, tn * BLOCK_N, K, BLOCK_M, BLOCK_N, BLOCK_K)
        mine = tile_at(own_ptr, t, BLOCK_M, BLOCK_N)
        tl.store(mine + offsets, (acc * scale).to(own_ptr.dtype.element_ty))
        sync_program()  # the words are read back by other threads than stored them
        mine_words = mine.to(tl.pointer_type(tl.int32))
        for step in range(1, world):
            remote = dl.symm_at(stage + me * row + t * TILE_WORDS, (me + step) % world, group)
            for start in range(0, TILE_WORDS, STEP):
                dl.ll.send(remote + start + words, tl.load(mine_words + start + words), epoch, every)
    for t in range(tl.program_id(0), tiles_m * tiles_n, tl.num_programs(0)):
        tm, tn = persistent.tile_coords(t, tiles_m, tiles_n, GROUP_M)
        mine_words = tile_at(own_ptr, t, BLOCK_M, BLOCK_N).to(tl.pointer_type(tl.int32))
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


class LowLatency(Method):
    """gemm_ar in LL packets, one node: `PacketRows` with a row of this rank's tiles per rank, a
    tensor `own_tiles` of this rank's partial tiles, and `gemm_ar_ll_kernel` on a program per SM
    (fewer for fewer tiles). Built for an m x k by k x n product of `dtype` (16-bit outputs) with
    `config` (without FLATTEN), among `ranks` (an `ops.ranks.Ranks`); `launch(a, b, out, scale_a,
    scale_b)` writes the sum over ranks into `out`."""

    name = "ll"
    one_node = True
    flatten = False  # Triton cannot fuse its loop over the peers: it takes configs without FLATTEN

    def __init__(self, m: int, k: int, n: int, dtype: torch.dtype, config: dict, ranks: Ranks):
        super().__init__()
        self.ranks = w = ranks
        self.m, self.k, self.n, self.config = m, k, n, config
        self.out_dtype = persistent.out_dtype(dtype)
        block = config["BLOCK_M"] * config["BLOCK_N"]
        per_shard = triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"])
        self.programs = min(sizing.programs_for(w.device), per_shard)
        self.workspace = self.own(PacketRows("gemm_ar", per_shard * block * self.out_dtype.itemsize, self.programs,
                                             ranks=w))
        self.own_tiles = torch.empty(per_shard * block, dtype=self.out_dtype, device=w.device)
        self.step = min(LL_STEP, block // 2)

    def launch(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, scale_a: torch.Tensor | None,
               scale_b: torch.Tensor | None) -> None:
        a_desc, b_desc = persistent.descriptors(a, b, self.config)
        ws = self.workspace
        gemm_ar_ll_kernel[(self.programs,)](
            a_desc=a_desc, b_desc=b_desc, scale_a_ptr=scale_a, scale_b_ptr=scale_b, out_ptr=out.view(torch.int32),
            own_ptr=self.own_tiles, packets_ptr=ws.staging, calls_ptr=ws.calls, M=self.m, N=self.n, K=self.k,
            row=ws.row, slot_numel=ws.slot_numel, DTYPE=checks.TRITON_DTYPES[self.out_dtype], STEP=self.step,
            group=self.ranks.group, **self.config)
