"""AllGather-MoE: the up projection of a tensor-parallel MoE layer, the all-gather of the tokens
hidden behind the grouped GEMM: the front (`AllGatherMoE`, `ag_moe`) and its one method
(`GatherGemm`).

Rank r holds x_shard (its T_r tokens, T_r x K: sequence parallel), their routing topk_idx_shard
(T_r x topk, int64) and every expert's weights split by columns, w_shard (E x K x N/world). h has a
row for every (token, k) pair of every rank's tokens: x[token] @ w_shard[topk_idx[token, k]], rows
grouped by expert (the layout: `routing`). With a process group (`group=`), ranks and world are
the group's: rank r of the group, its size the number of shards.

Expert ids out of range [0, E): where the host reads them (the emulator, TRIDIST_DEBUG=1) the call
refuses them; elsewhere (GPUs) they are dropped before the routing (`_sort.drop_ids`, one launch):
the pair goes to no expert and has no row of h, and `AllGatherMoE.dropped_expert_ids` counts them.

Protocol
1. The transfer of the tokens is queued first, as ag_gemm's A (`ShardGather`): the copy engines
   write x_shard into every peer's `gathered` (comm="ce", one node), or a few SMs on a side stream
   push it with stores and NVSHMEM puts (comm="sm", any topology); shard s at rows s * T_r, with
   flags.
2. The routing (`routing.Router`): a one-program kernel sorts this rank's pairs by expert,
   exchanges them with every peer and lays out h, on the device.
3. The GEMM (`ag_moe_kernel`), one persistent kernel over the tiles of h (`routing`'s walks).
   By source: first the rows of this rank's own tokens, then of rank+1, rank+2, ...: the order in
   which the tokens arrive; before its first tile of rank s's rows a program waits for s's flags.
   By expert: before its first tile a program waits for every peer's flags. A tile's rows of A
   are tokens picked through pair_of_row, own tokens read straight from x_shard, loaded row by row
   (not by TMA, which reads blocks of consecutive rows); w_shard[expert] comes through a TMA
   descriptor.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

import tridist.language as dl
from tridist.runtime.jit import jit

from ... import checks, instances
from ...protocol import after_flags, call_epoch, finish_call
from ...gemm import grouped, persistent
from ...gemm import policy as gemm_policy
from ...gemm.shard_gather import COMMS, ShardGather
from ...method import Method
from ...ranks import ranks_of
from .. import _sort, policy
from . import routing
from .routing import DTYPES, MoEHandle


class Gathered(NamedTuple):
    """The gathered tokens as `ag_moe_kernel` takes them, one tuple argument (unpacked by position
    there: a kernel compiled from the compile log sees a plain tuple)."""
    rows: torch.Tensor       # `ShardGather.gathered`: slots of `slot_rows` rows of K, shard s at row s * T_r
    flags: torch.Tensor      # `ShardGather.flags`
    calls: torch.Tensor      # the op's calls counter (`protocol.call_epoch`)
    slot_rows: int


class Segments(NamedTuple):
    """The call's layout of h (its `MoEHandle`) as `ag_moe_kernel` takes it, one tuple argument."""
    pair_of_row: torch.Tensor  # [P]: the pair each row of h holds
    counts: torch.Tensor       # [world, E_PAD]: rows of h per (source rank, expert)
    base: torch.Tensor         # [world, E_PAD]: the first of those rows


@triton.jit
def gathered_product(a_rows, row_mask, w_desc, expert, col, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """A @ w[expert][:, col:col+BLOCK_N] in fp32, row i of A at a_rows[i] (K elements; rows outside
    `row_mask` read as zeros)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Made 2-D before the loop: broadcast inside it, Triton 3.6 did not pipeline these loads (the
    # flattened tile loop then kept A in registers).
    starts = a_rows[:, None]
    rows = row_mask[:, None]
    columns = tl.arange(0, BLOCK_K)
    for k in tl.range(0, tl.cdiv(K, BLOCK_K)):
        inner = k * BLOCK_K + columns
        a = tl.load(starts + inner[None, :], mask=rows & (inner < K)[None, :], other=0.0)
        acc = dl.dot(a, grouped.expert_weights(w_desc, expert, k * BLOCK_K, col, BLOCK_N, BLOCK_K), acc)
    return acc


@jit
def ag_moe_kernel(x_ptr, gathered, w_desc, out_ptr, segments, tokens, N, K, TOPK: tl.constexpr, W_PAD: tl.constexpr,
                  E_PAD: tl.constexpr, FLAGS_PER_SHARD: tl.constexpr, EPOCH_FLAGS: tl.constexpr,
                  BY_EXPERT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_M: tl.constexpr, FLATTEN: tl.constexpr, group=None):
    """x_ptr: this rank's tokens; gathered: a `Gathered`, flags as ag_gemm's (EPOCH_FLAGS: raised to
    the call epoch in slot epoch % 2; else slot 0's, raised to 1); out_ptr: h; segments: the call's
    `Segments`. Ranks of `group`, if given."""
    gathered_ptr, flags_ptr, calls_ptr, slot_rows = gathered
    pair_ptr, counts_ptr, base_ptr = segments
    epoch = call_epoch(calls_ptr)
    me = dl.rank(group)
    world = dl.num_ranks(group)
    slot = 0
    expected = 1
    if EPOCH_FLAGS:
        slot = epoch % 2
        expected = epoch
    row_tiles, phase_ends = routing.phases(counts_ptr, me, world, W_PAD, E_PAD, BLOCK_M, BY_EXPERT)
    tiles_n = tl.cdiv(N, BLOCK_N)
    # Own tokens are read where they are; a peer's from its rows of this call's slot of `gathered`.
    own = x_ptr - me * tokens * K
    peers = gathered_ptr + slot * slot_rows * K
    flags = flags_ptr + slot * world * FLAGS_PER_SHARD
    ready = me * 0  # a zero that the rows' addresses take in, to keep their loads after the waits
    if BY_EXPERT:
        # Nearly every tile reads every rank's tokens: wait for them all before the first. (Waited
        # inside the tile loop, Triton 3.6 no longer pipelined the flattened loop's loads of A.)
        for step in range(1, world):
            ready = after_flags(ready, flags + ((me + step) % world) * FLAGS_PER_SHARD, FLAGS_PER_SHARD, expected)
    arrived = me  # the last source whose flags this program has seen
    rows = tl.arange(0, BLOCK_M)
    for tile in tl.range(tl.program_id(0), tl.sum(row_tiles, 0) * tiles_n, tl.num_programs(0), flatten=FLATTEN):
        source, expert, row, end, tn = routing.moe_tile(tile, row_tiles, phase_ends, me, world, counts_ptr,
                                                           base_ptr, tiles_n, W_PAD, E_PAD, BLOCK_M, GROUP_M,
                                                           BY_EXPERT)
        # The wait's token goes into an offset, not a pointer: a pointer chosen after a wait stopped
        # Triton from pipelining the loads computed from it (tests/gpu_compile.py's `unpipelined`).
        offset = ready
        if source != arrived:  # by source only: by expert every tile's phase is this rank's
            offset = after_flags(offset, flags + source * FLAGS_PER_SHARD, FLAGS_PER_SHARD, expected)
            arrived = source
        row_mask = row + rows < end
        token = tl.load(pair_ptr + row + rows, mask=row_mask, other=0) // TOPK
        a_rows = tl.where(token // tokens == me, own, peers) + (offset + token).to(tl.int64) * K
        acc = gathered_product(a_rows, row_mask, w_desc, expert, tn * BLOCK_N, K, BLOCK_M, BLOCK_N, BLOCK_K)
        persistent.store_tile(out_ptr, acc, row, tn * BLOCK_N, end, N, BLOCK_M, BLOCK_N)
    finish_call(calls_ptr)


class GatherGemm(Method):
    """ag_moe's method for `tokens` tokens of k features per rank, `topk` of `experts` experts each,
    and weights of n columns per rank, among `ranks` (an `ops.ranks.Ranks`): the tokens gathered by
    `ShardGather` (`comm` "ce" or "sm", `comm_programs`) behind one persistent grouped GEMM over the
    routed rows, its tiles walked by expert or by source (`by_expert`) at `config`."""

    name = "gather_gemm"

    def __init__(self, tokens: int, k: int, n: int, experts: int, topk: int, dtype: torch.dtype, comm: str,
                 comm_programs: int | None, config: dict, by_expert: bool, ranks):
        super().__init__()
        self.ranks = w = ranks
        self.tokens, self.k, self.n, self.experts, self.topk = tokens, k, n, experts, topk
        self.config, self.by_expert = config, by_expert
        self.router = self.own(routing.Router(tokens, topk, experts, w))
        self.gather = self.own(ShardGather(tokens, k, dtype, comm, comm_programs, ranks=w))
        self.gathered = Gathered(rows=self.gather.gathered, flags=self.gather.flags,
                                 calls=torch.zeros(1, dtype=torch.int64, device=w.device),
                                 slot_rows=self.gather.slot_rows)

    def launch(self, x_shard: torch.Tensor, topk_idx_shard: torch.Tensor, w_shard: torch.Tensor,
               out: torch.Tensor, dropped_expert_ids: torch.Tensor) -> MoEHandle:
        """One call into `out` (h), routed by `topk_idx_shard` (ids in [0, experts), or -1 where
        one was dropped, counted in `dropped_expert_ids`); returns the call's `MoEHandle`."""
        w, config, gather = self.ranks, self.config, self.gather
        gather.start(x_shard)
        handle = self.router(topk_idx_shard, dropped_expert_ids)
        bound = w.world_size * (triton.cdiv(self.tokens * self.topk, config["BLOCK_M"]) + self.experts) * \
            triton.cdiv(self.n, config["BLOCK_N"])
        ag_moe_kernel[(min(bound, gather.gemm_programs),)](
            x_ptr=x_shard, gathered=self.gathered, w_desc=grouped.weight_descriptor(w_shard, config), out_ptr=out,
            segments=Segments(pair_of_row=handle.pair_of_row, counts=handle.padded_counts, base=handle.padded_base),
            tokens=self.tokens, N=self.n, K=self.k, TOPK=self.topk, W_PAD=triton.next_power_of_2(w.world_size),
            E_PAD=handle.e_pad, FLAGS_PER_SHARD=gather.flags_per_shard, EPOCH_FLAGS=gather.epoch_flags,
            BY_EXPERT=self.by_expert, group=w.group, **config)
        gather.finish()
        return handle


class AllGatherMoE:
    """`ag_moe` for `tokens` tokens of k features per rank, `topk` of `experts` experts each, and
    weights split to n columns per rank, with its buffers allocated once; one instance per stream.
    `comm`: "ce", "sm" or "auto" as for `AllGatherGEMM`; `config`: a dict of
    `tridist.ops.gemm.grouped.configs`, None for the default, or "tune" (a collective);
    `tile_order`: "source", "expert" or "auto" (`policy.choose_tile_order`): how the GEMM walks
    its tiles (`routing`'s docstring); `group`: as for `ag_moe`.

    Attributes:
        dropped_expert_ids: int64 [1] on this rank's device: the expert ids out of [0, experts)
            that this rank's calls dropped (the pair sent to no expert) since the op was built;
            zero where the host checks the ids, which it refuses instead. Read it when you like
            (the handles of its calls refer to it too).
    """

    def __init__(self, tokens: int, k: int, n: int, experts: int, topk: int, dtype: torch.dtype, comm: str = "auto",
                 comm_programs: int | None = None, config: dict | str | None = None, tile_order: str = "auto",
                 group=None):
        if comm not in COMMS:
            raise checks.method_error("ag_moe comm", comm, COMMS)
        routing.check_build("ag_moe", tokens, topk, experts, k, n, dtype)
        if comm_programs is not None:
            checks.check_programs(comm_programs, "comm_programs", "the programs that push the tokens with comm='sm'")
        self.ranks = w = ranks_of(group)
        self.comm = gemm_policy.choose_ag_gemm_comm(w) if comm == "auto" else comm
        if self.comm == "ce":
            checks.require_one_node("ag_moe comm='ce'", "comm='sm'", w)
        self.tokens, self.k, self.n, self.experts, self.topk, self.dtype = tokens, k, n, experts, topk, dtype
        self.pairs = w.world_size * tokens * topk
        checks.check_offsets("ag_moe", max(self.pairs * n, 2 * w.world_size * tokens * k))
        self.by_expert = policy.choose_tile_order(tile_order, self.pairs, experts, policy.AG_MOE_SOURCE_ROWS, w)
        self.config = routing.moe_config(
            config, "ag_moe", (tokens, k, n, experts, topk, str(dtype), self.comm, comm_programs, self.by_expert),
            lambda c: AllGatherMoE(tokens, k, n, experts, topk, dtype, self.comm, comm_programs, c, tile_order, group),
            lambda: (torch.randn(tokens, k, device=w.device).to(dtype),
                     routing.random_routing(tokens, topk, experts, w.device),
                     torch.randn(experts, k, n, device=w.device).to(dtype)),
            w.device, self.pairs, experts, n, dtype, w)
        self.method = GatherGemm(tokens, k, n, experts, topk, dtype, self.comm, comm_programs, self.config,
                                 self.by_expert, w)
        self.dropped_expert_ids = torch.zeros(1, dtype=torch.int64, device=w.device)

    def __call__(self, x_shard: torch.Tensor, topk_idx_shard: torch.Tensor, w_shard: torch.Tensor,
                 out: torch.Tensor | None = None) -> tuple[torch.Tensor, MoEHandle]:
        """`(h, handle)` for this rank's tokens, as `ag_moe` (which keeps an instance of this class per
        shape and stream): `out`, if given, is h's storage, `world_size * tokens * topk` rows of the
        built N columns."""
        def check() -> None:
            checks.check_input(x_shard, "x_shard", (self.dtype,))
            if tuple(x_shard.shape) != (self.tokens, self.k):
                raise ValueError(f"this ag_moe takes x_shard {self.dtype} of shape {(self.tokens, self.k)}; got "
                                 f"shape {tuple(x_shard.shape)}: build another instance, or call tridist.ops.ag_moe")
            routing.check_routing(topk_idx_shard, "topk_idx_shard", self.tokens, self.topk, torch.int64)
            routing.check_weights(w_shard, "w_shard", self.experts, self.k, self.n, self.dtype)
            routing.check_experts(topk_idx_shard, self.experts)
            if out is not None:
                checks.check_output(out, (self.pairs, self.n), self.dtype)

        checks.agree("ag_moe", check, {"shape and dtype of x_shard": checks.shape_of(x_shard)},
                     group=self.ranks.group)
        if out is None:
            out = torch.empty((self.pairs, self.n), dtype=self.dtype, device=x_shard.device)
        if not checks.host_reads(topk_idx_shard):  # else `check_experts` refused the ids out of range
            topk_idx_shard = _sort.drop_ids(topk_idx_shard, 0, self.experts, self.dropped_expert_ids)
        return out, self.method.launch(x_shard, topk_idx_shard, w_shard, out, self.dropped_expert_ids)

    def free(self) -> None:
        """Give the symmetric buffers back (collective: every rank, in the same order)."""
        self.method.free()


def ag_moe(x_shard: torch.Tensor, topk_idx_shard: torch.Tensor, w_shard: torch.Tensor, out: torch.Tensor | None = None,
           comm: str = "auto", config: dict | str | None = None, tile_order: str = "auto",
           group=None) -> tuple[torch.Tensor, MoEHandle]:
    """The up projection of a tensor-parallel MoE layer, the all-gather of the tokens overlapped with
    the grouped GEMM. A collective: every rank (of `group`) calls it with the same shapes.

    Args:
        x_shard: this rank's tokens, T_r x K, bf16 or fp16 (every rank the same T_r: pad if needed).
        topk_idx_shard: int64 T_r x topk, the experts of each token (ids in [0, E); checked before
            launch in the emulator and with TRIDIST_DEBUG=1, which read them back; otherwise an id
            out of range is dropped: that pair goes to no expert and gets no row of h, and is
            counted in `handle.dropped_expert_ids`, `AllGatherMoE.dropped_expert_ids`).
        w_shard: E x K x N/world of x_shard's dtype: this rank's columns of every expert's weights.
        out: h, or None for a new tensor.
        comm: "ce" (copy engines, one node), "sm" (any topology) or "auto" (ce on one node).
        config: a dict of `tridist.ops.gemm.grouped.configs`, None, or "tune".
        tile_order: "source" (the tiles of each rank's tokens in the order they arrive: the
            all-gather hidden, each expert's weights read once per rank), "expert" (each expert's
            rows of every rank together: its weights read once, the all-gather waited for before the
            first tile), or "auto": by expert where the (rank, expert) segments are small enough
            for the weights' reads to be what the GEMM waits on (`policy.AG_MOE_SOURCE_ROWS`).
        group: the ranks it runs among (tensor parallelism within them): a `torch.distributed`
            process group (`dist.new_group`, a DeviceMesh's `get_group("tp")`), a `tridist.Group`,
            or None for the world. world_size and the ranks are then the group's: w_shard holds
            N/group.size() columns, and h a row for every pair of the members' tokens. Other
            groups may run their own calls meanwhile.

    Returns:
        (h, handle): h is (world_size * T_r * topk) x N/world, a row for every (token, k) pair of
        every rank's tokens, x[token] @ w_shard[topk_idx[token, k]], rows grouped by expert (within an
        expert by source rank, token, k; the rows of dropped pairs, last, unspecified); `handle`
        (`MoEHandle`) says which pair each row is, holds the gathered routing, the counter of
        dropped ids and what `moe_rs` needs.

    K and N/world must be multiples of 8. Keeps one `AllGatherMoE` per shape, group and stream.
    Raises ValueError before launching anything for shapes, dtypes or layouts it does not take, or
    on a rank that is not a member of `group`.
    """
    def check() -> None:
        checks.check_input(x_shard, "x_shard", DTYPES)
        checks.check_input(topk_idx_shard, "topk_idx_shard", (torch.int64,))
        grouped.check_weights(w_shard, "w_shard", DTYPES)
        if x_shard.dim() != 2 or topk_idx_shard.dim() != 2:
            raise ValueError(f"x_shard and topk_idx_shard must be matrices (tokens x K, tokens x topk); got shapes "
                             f"{tuple(x_shard.shape)} and {tuple(topk_idx_shard.shape)}")

    shape_of = checks.shape_of
    ranks = ranks_of(group)  # a rank outside the group is refused here, before anything else
    checks.agree("ag_moe", check, {"shape and dtype of x_shard": shape_of(x_shard),
                                      "shape of topk_idx_shard": shape_of(topk_idx_shard),
                                      "shape of w_shard": shape_of(w_shard), "comm": comm, "config": repr(config),
                                      "tile_order": tile_order}, group=ranks.group)
    (tokens, k), topk, (experts, _, n) = x_shard.shape, topk_idx_shard.shape[1], w_shard.shape
    op = instances.instance(lambda: AllGatherMoE(tokens, k, n, experts, topk, x_shard.dtype, comm, config=config,
                                                 tile_order=tile_order, group=ranks.group),
                            AllGatherMoE, tokens, k, n, experts, topk, x_shard.dtype, comm, repr(config), tile_order,
                            ranks.key, device=x_shard.device)
    return op(x_shard, topk_idx_shard, w_shard, out)
