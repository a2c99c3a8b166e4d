"""Routing of the tensor-parallel MoE ops (`ag_moe`, `moe_rs`): which row of h holds which (token,
expert) pair, computed on the device by every rank alike, and how their GEMMs walk those rows:
what both ops share.

Layout. Rank s holds tokens t < T_r, global token g = s * T_r + t; pair p = g * topk + k is token g
routed to expert topk_idx[g, k]. h has a row per pair, the pairs sorted stably by expert: expert
after expert, and within an expert by source rank, then token, then k. Segment (s, e), the rows of
expert e that rank s's tokens send, starts at row base[s, e] and holds counts[s, e] rows. offs[e]
(the cumulative row ends per expert) is what `grouped_gemm` takes, so h can also go through it.
A pair whose id was dropped (out of range, where the host could not check it: `ag_moe`) has no
row: its id reads -1 here, and the rows past offs[E-1], one per dropped pair, hold none. Ranks
are those the op runs among: the world, or a process group (rank s of the group).

Protocol (`route_kernel`, one program per rank and call; epochs and slots as in `protocol.py`):
1. The rank sorts its own pairs by expert (`_sort`, two launches before `route_kernel`'s) and
   writes them into row `rank` of this call's slot of the symmetric `exchange` buffer: each pair's
   expert (-1: dropped), its position among this rank's pairs of that expert, and the count per
   expert.
2. It sends that row to every peer (stores through symm_at on this node, an NVSHMEM put with the
   signal attached to another) with flag (slot, rank) raised to the call epoch there, then waits
   for every peer's flag. Every call waits for every peer, so two slots need no handshake.
3. From all the rows every rank computes the same layout into the call's `MoEHandle`.

The GEMMs' tiles, in one of two orders (`tile_order`):
- by source: phase j of a rank's GEMM covers the segments of one source rank, (first + j) % world;
  within it the row tiles (BLOCK_M rows, never spanning two segments) come expert after expert.
  A tile then needs the tokens (ag_moe) or feeds the sums (moe_rs) of one rank only, so the
  transfers overlap the GEMM; but each expert's weights are read once per source rank, and each
  segment's last tile is partly empty.
- by expert: one phase, row tiles over each expert's rows of every source at once (never spanning
  two experts), as `grouped_gemm` walks them: each expert's weights are read once, but a tile may
  need every rank's tokens, and every rank's sums are done only near the end of the GEMM.
Either way the tiles come GROUP_M row tiles at a time (`persistent.tile_coords`). `phases` counts
the row tiles of every phase from `counts` before the tile loop, and `moe_tile` places a tile.
"""
import dataclasses

import torch
import triton
import triton.language as tl

import tridist.language as dl
from tridist.runtime.jit import jit

from ... import checks, protocol, sizing
from ...protocol import after_flags, call_epoch, finish_call, in_slot, push_slice, sync_program
from ...gemm import grouped, persistent
from .. import _sort

DTYPES = (torch.bfloat16, torch.float16)
PUSH_BLOCK = tl.constexpr(1024)  # int32 words a step of the exchange moves


@jit
def route_kernel(idx_ptr, sorted_ptr, exchange_ptr, flags_ptr, calls_ptr, layout_ptr, pairs, E, row, slot_numel,
                 local_world_size, E_PAD: tl.constexpr, group=None):
    """One program. `idx_ptr`: this rank's expert ids, in [0, E) or -1 (dropped); `pairs` = T_r *
    topk per rank; `sorted_ptr`: this rank's pairs sorted by `_sort` (a position each, then the
    count per expert); exchange rows `row` int32 apart (2 pairs + E_PAD used); `layout_ptr`: the
    call's `MoEHandle.layout` (see there). Ranks of `group`, if given."""
    epoch = call_epoch(calls_ptr)
    me = dl.rank(group)
    world = dl.num_ranks(group)
    stage = in_slot(exchange_ptr, epoch, slot_numel)
    flags = in_slot(flags_ptr, epoch, world)
    own = stage + me * row
    for start in range(0, pairs, PUSH_BLOCK):
        p = start + tl.arange(0, PUSH_BLOCK)
        mask = p < pairs
        tl.store(own + p, tl.load(idx_ptr + p, mask=mask).to(tl.int32), mask=mask)
        tl.store(own + pairs + p, tl.load(sorted_ptr + p, mask=mask), mask=mask)
    experts = tl.arange(0, E_PAD)
    tl.store(own + 2 * pairs + experts, tl.load(sorted_ptr + pairs + experts, mask=experts < E, other=0))
    sync_program()  # the row is read back below, by other threads than stored it
    for step in range(1, world):
        push_slice(stage + me * row, stage + me * row, 0, 2 * pairs + E_PAD, flags + me, epoch, (me + step) % world,
                   local_world_size, PUSH_BLOCK, group=group)
    for step in range(1, world):
        stage = after_flags(stage, flags + (me + step) % world, 1, epoch)
    # Step 3: counts, segment bases and offs, from every rank's counts.
    pair_of_row = layout_ptr
    row_of_pair = pair_of_row + world * pairs
    routing = row_of_pair + world * pairs
    counts_out = routing + world * pairs
    base_out = counts_out + world * E_PAD
    offs_out = base_out + world * E_PAD
    experts = tl.arange(0, E_PAD)
    total = tl.zeros([E_PAD], dtype=tl.int32)
    for s in range(world):
        total += tl.load(stage + s * row + 2 * pairs + experts)
    ends = tl.cumsum(total, 0)
    tl.store(offs_out + experts, ends)
    base = ends - total
    for s in range(world):
        counts = tl.load(stage + s * row + 2 * pairs + experts)
        tl.store(counts_out + s * E_PAD + experts, counts)
        tl.store(base_out + s * E_PAD + experts, base)
        base += counts
    sync_program()  # base_out is gathered from below
    for s in range(world):
        for start in range(0, pairs, PUSH_BLOCK):
            p = start + tl.arange(0, PUSH_BLOCK)
            mask = p < pairs
            expert = tl.load(stage + s * row + p, mask=mask, other=-1)
            routed = mask & (expert >= 0)
            at = tl.load(base_out + s * E_PAD + expert, mask=routed, other=0) + \
                tl.load(stage + s * row + pairs + p, mask=routed, other=0)
            pair = s * pairs + p
            tl.store(pair_of_row + at, pair, mask=routed)
            tl.store(row_of_pair + pair, tl.where(routed, at, -1), mask=mask)
            tl.store(routing + pair, expert, mask=mask)
    # The rows that dropped pairs leave, past the last expert's: no pair.
    for start in range(tl.sum(total, 0), world * pairs, PUSH_BLOCK):
        rows = start + tl.arange(0, PUSH_BLOCK)
        tl.store(pair_of_row + rows, -1, mask=rows < world * pairs)
    dl.shmem.quiet()
    finish_call(calls_ptr)


@dataclasses.dataclass
class MoEHandle:
    """What `ag_moe` returns beside h, and `moe_rs` takes: the routing of one call, on the device.
    Ranks and world_size are those of the group the call ran in (the world, or a process group).

    Attributes (views of one int32 tensor, `layout`; P = world_size * tokens * topk pairs):
        pair_of_row: [P], the pair (global token * topk + k) that each row of h holds (-1 for the
            rows past offs[-1]: as many as pairs were dropped).
        row_of_pair: [P], the inverse: the row of h of each pair (-1: dropped).
        topk_idx: [world_size * tokens, topk], every rank's routing, gathered (int32; -1 where
            an id out of range was dropped).
        counts: [world_size, experts], the rows of h that rank s's tokens send to expert e.
        base: [world_size, experts], the first of those rows.
        offs: [experts], the cumulative row ends per expert, as `grouped_gemm` takes them.
        dropped_expert_ids: the `AllGatherMoE.dropped_expert_ids` of the op that routed the call
            (int64 [1] on the device: the ids it dropped since it was built), or None for a
            handle made from a layout alone (`torch.ops.tridist.moe_rs`).
    """
    layout: torch.Tensor
    world_size: int
    tokens: int
    topk: int
    experts: int
    dropped_expert_ids: torch.Tensor | None = None

    @property
    def pairs(self) -> int:
        return self.world_size * self.tokens * self.topk

    @property
    def e_pad(self) -> int:
        return triton.next_power_of_2(self.experts)

    def _part(self, index: int, size: int) -> torch.Tensor:
        starts = [0, self.pairs, 2 * self.pairs, 3 * self.pairs, 3 * self.pairs + self.world_size * self.e_pad,
                  3 * self.pairs + 2 * self.world_size * self.e_pad]
        return self.layout[starts[index]:starts[index] + size]

    @property
    def pair_of_row(self) -> torch.Tensor:
        return self._part(0, self.pairs)

    @property
    def row_of_pair(self) -> torch.Tensor:
        return self._part(1, self.pairs)

    @property
    def topk_idx(self) -> torch.Tensor:
        return self._part(2, self.pairs).view(self.world_size * self.tokens, self.topk)

    @property
    def padded_counts(self) -> torch.Tensor:
        return self._part(3, self.world_size * self.e_pad)

    @property
    def counts(self) -> torch.Tensor:
        return self.padded_counts.view(self.world_size, self.e_pad)[:, :self.experts]

    @property
    def padded_base(self) -> torch.Tensor:
        return self._part(4, self.world_size * self.e_pad)

    @property
    def base(self) -> torch.Tensor:
        return self.padded_base.view(self.world_size, self.e_pad)[:, :self.experts]

    @property
    def offs(self) -> torch.Tensor:
        return self._part(5, self.experts)

    @staticmethod
    def numel(world_size: int, tokens: int, topk: int, experts: int) -> int:
        """The int32 words a handle of these sizes holds (its layout's storage)."""
        pairs = world_size * tokens * topk
        return 3 * pairs + (2 * world_size + 1) * triton.next_power_of_2(experts)


class Router:
    """The routing step of an ag_moe instance for `tokens` tokens per rank, `topk` experts each, of
    `experts`, among `ranks` (an `ops.ranks.Ranks`): its symmetric exchange buffer, flags and calls
    counter."""

    def __init__(self, tokens: int, topk: int, experts: int, ranks):
        self.ranks = w = ranks
        self.tokens, self.topk, self.experts = tokens, topk, experts
        self.pairs = tokens * topk
        self.e_pad = triton.next_power_of_2(experts)
        self.row = sizing.row_stride(2 * self.pairs + self.e_pad)
        checks.check_offsets("ag_moe", max(2 * w.world_size * self.row, 3 * w.world_size * self.pairs))
        self.workspace = protocol.Workspace(w.world_size * self.row, torch.int32, w.world_size, group=w.group)

    def __call__(self, topk_idx: torch.Tensor, dropped_expert_ids: torch.Tensor | None = None) -> MoEHandle:
        """Queue the routing of this call's `topk_idx` (this rank's, tokens x topk int64, ids in
        [0, experts) or -1 for a pair that goes nowhere); returns its handle, filled once the queued
        kernel has run, which carries `dropped_expert_ids` (the op's counter of the -1s)."""
        w = self.ranks
        layout = torch.empty(MoEHandle.numel(w.world_size, self.tokens, self.topk, self.experts), dtype=torch.int32,
                             device=w.device)
        ws = self.workspace
        own = torch.empty(self.pairs + self.experts, dtype=torch.int32, device=w.device)
        _sort.sort(topk_idx.view(-1), own[:self.pairs], own[self.pairs:], self.experts, 1, one_group=True)
        route_kernel[(1,)](idx_ptr=topk_idx, sorted_ptr=own, exchange_ptr=ws.staging, flags_ptr=ws.flags,
                           calls_ptr=ws.calls, layout_ptr=layout, pairs=self.pairs, E=self.experts, row=self.row,
                           slot_numel=ws.slot_numel, local_world_size=w.local_world_size, E_PAD=self.e_pad,
                           num_warps=8, group=w.group)
        return MoEHandle(layout, w.world_size, self.tokens, self.topk, self.experts, dropped_expert_ids)

    def free(self) -> None:
        self.workspace.free()


def check_experts(topk_idx: torch.Tensor, experts: int) -> None:
    """Expert ids in [0, experts), checked where reading them costs no synchronisation (on the CPU:
    the emulator) or where it is asked for (TRIDIST_DEBUG=1), but not while a CUDA graph is captured
    (the read would end the capture)."""
    if not checks.host_reads(topk_idx):
        return
    if topk_idx.numel() and (int(topk_idx.min()) < 0 or int(topk_idx.max()) >= experts):
        raise ValueError(f"topk_idx holds expert ids from {int(topk_idx.min())} to {int(topk_idx.max())}; there are "
                         f"{experts} experts (ids 0 to {experts - 1})")


def check_weights(w_shard: torch.Tensor, name: str, experts: int, k: int, n: int, dtype: torch.dtype) -> None:
    """w_shard is what an op built for `experts` x k x n weights of `dtype` takes."""
    grouped.check_weights(w_shard, name, DTYPES)
    if tuple(w_shard.shape) != (experts, k, n) or w_shard.dtype != dtype:
        raise ValueError(f"{name} must be {dtype} of shape {(experts, k, n)}; got {w_shard.dtype} of shape "
                         f"{tuple(w_shard.shape)}")


def check_routing(tensor: torch.Tensor, name: str, tokens: int, topk: int, dtype: torch.dtype) -> None:
    checks.check_input(tensor, name, (dtype,))
    if tuple(tensor.shape) != (tokens, topk):
        raise ValueError(f"{name} must be {dtype} of shape {(tokens, topk)} (tokens x topk); got shape "
                         f"{tuple(tensor.shape)}")


def check_build(op: str, tokens: int, topk: int, experts: int, k: int, n: int, dtype: torch.dtype) -> None:
    for what, value in (("tokens", tokens), ("topk", topk), ("experts", experts)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{op} needs a positive int {what}, got {value!r}")
    if topk > experts:
        raise ValueError(f"{op}: topk = {topk} is more than the {experts} experts")
    if dtype not in DTYPES:
        raise ValueError(f"{op} takes {', '.join(map(str, DTYPES))}; got {dtype}")
    persistent.check_sizes(op, dtype, k, n)


def moe_config(config, name: str, key, make_op, make_inputs, device: torch.device, pairs: int, experts: int, n: int,
               dtype: torch.dtype, ranks) -> dict:
    """The GEMM config of an MoE op over `pairs` rows of h in world_size x experts segments of
    `ranks` (an `ops.ranks.Ranks`; "tune" times among them: see `persistent.resolve_config`;
    candidates `grouped.configs`)."""
    segments = ranks.world_size * experts
    return persistent.resolve_config(config, name, key, make_op, make_inputs, device, pairs, n, dtype=dtype,
                                     candidates=grouped.configs(device, dtype),
                                     default=grouped.default_config(device, pairs, segments, n, dtype),
                                     group=ranks.group)


def random_routing(tokens: int, topk: int, experts: int, device: torch.device) -> torch.Tensor:
    """Distinct random experts for each token, for tuning."""
    return torch.rand(tokens, experts, device=device).argsort(dim=1)[:, :topk].contiguous()


@triton.jit
def _rows_per_expert(counts_ptr, source, world, W_PAD: tl.constexpr, E_PAD: tl.constexpr, BY_EXPERT: tl.constexpr):
    """The rows per expert a phase covers: source's segments, or (BY_EXPERT) every rank's."""
    if BY_EXPERT:
        ranks = tl.arange(0, W_PAD)
        return tl.sum(tl.load(counts_ptr + ranks[:, None] * E_PAD + tl.arange(0, E_PAD)[None, :],
                              mask=(ranks < world)[:, None], other=0), 0)
    else:
        return tl.load(counts_ptr + source * E_PAD + tl.arange(0, E_PAD))


@triton.jit
def phases(counts_ptr, first, world, W_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
           BY_EXPERT: tl.constexpr):
    """(row tiles of phase j, their cumulative ends): vectors over the phases j < world, phase j
    taking the segments of source rank (first + j) % world; BY_EXPERT, phase 0 takes every row
    and the others none."""
    j = tl.arange(0, W_PAD)
    if BY_EXPERT:
        row_tiles = tl.where(j == 0, tl.sum(tl.cdiv(_rows_per_expert(counts_ptr, first, world, W_PAD, E_PAD, True),
                                                     BLOCK_M), 0), 0)
    else:
        source = (first + j) % world
        counts = tl.load(counts_ptr + source[:, None] * E_PAD + tl.arange(0, E_PAD)[None, :],
                         mask=(j < world)[:, None], other=0)
        row_tiles = tl.sum(tl.cdiv(counts, BLOCK_M), 1)
    return row_tiles, tl.cumsum(row_tiles, 0)


@triton.jit
def moe_tile(tile, row_tiles, phase_ends, first, world, counts_ptr, base_ptr, tiles_n, W_PAD: tl.constexpr,
             E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr, BY_EXPERT: tl.constexpr):
    """Tile `tile` of the walk `phases` counted -> (its phase's source rank, expert, first row of h,
    the end row of the expert's rows in that phase, column tile). BY_EXPERT, the source is `first`
    for every tile, whose rows may be any rank's."""
    phase = tl.sum((phase_ends * tiles_n <= tile).to(tl.int32), 0)
    source = (first + phase) % world
    phase_tiles = grouped.pick(row_tiles, phase)
    start = (grouped.pick(phase_ends, phase) - phase_tiles) * tiles_n
    tm, tn = persistent.tile_coords(tile - start, phase_tiles, tiles_n, GROUP_M)
    counts = _rows_per_expert(counts_ptr, source, world, W_PAD, E_PAD, BY_EXPERT)
    expert, first_tile = grouped.locate(tm, tl.cdiv(counts, BLOCK_M))
    at = source
    if BY_EXPERT:
        at = 0  # every rank's rows of an expert start where rank 0's do
    base = tl.load(base_ptr + at * E_PAD + expert)
    end = base + grouped.pick(counts, expert)
    return source, expert, base + (tm - first_tile) * BLOCK_M, end, tn
