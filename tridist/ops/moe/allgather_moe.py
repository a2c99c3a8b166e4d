"""AllGather-MoE: the up projection of a tensor-parallel MoE layer, the all-gather of the tokens
hidden behind the grouped GEMM.

Rank r holds x_shard (its T_r tokens, T_r x K: sequence parallel), their routing topk_idx_shard
(T_r x topk, int64) and every expert's weights split by columns, w_shard (E x K x N/world). h has a
row for every (token, k) pair of every rank's tokens: x[token] @ w_shard[topk_idx[token, k]], rows
grouped by expert (the layout: `tp_routing`).

Protocol
1. The transfer of the tokens is queued first, as ag_gemm's A (`ShardGather`): the copy engines
   write x_shard into every peer's `gathered` (comm="ce", one node), or a few SMs on a side stream
   push it with stores and NVSHMEM puts (comm="sm", any topology); shard s at rows s * T_r, with
   flags.
2. The routing (`tp_routing.Router`): a one-program kernel sorts this rank's pairs by expert,
   exchanges them with every peer and lays out h, on the device.
3. The GEMM (`ag_moe_kernel`), one persistent kernel over the tiles of h (`tp_routing`'s walks).
   By source: first the rows of this rank's own tokens, then of rank+1, rank+2, ...: the order in
   which the tokens arrive; before its first tile of rank s's rows a program waits for s's flags.
   By expert: before its first tile a program waits for every peer's flags. A tile's rows of A
   are tokens picked through pair_of_row, own tokens read straight from x_shard, loaded row by row
   (not by TMA, which reads blocks of consecutive rows); w_shard[expert] comes through a TMA
   descriptor.
"""
import torch
import triton
import triton.language as tl

import tridist
import tridist.language as dl
from tridist.runtime.jit import jit

from .. import checks, instances
from ..protocol import after_flags, call_epoch, finish_call
from ..gemm import grouped, persistent
from ..gemm.allgather_gemm import COMMS, ShardGather
from . import tp_routing
from .tp_routing import MoEHandle

DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def gathered_product(a_rows, row_mask, w_desc, expert, col, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """A @ w[expert][:, col:col+BLOCK_N] in fp32, row i of A at a_rows[i] (K elements; rows outside
    `row_mask` read as zeros)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Made 2-D before the loop: broadcast inside it, Triton 3.6 did not pipeline these loads (the
    # flattened tile loop then kept A in registers, 2026-11-25).
    starts = a_rows[:, None]
    rows = row_mask[:, None]
    columns = tl.arange(0, BLOCK_K)
    for k in tl.range(0, tl.cdiv(K, BLOCK_K)):
        inner = k * BLOCK_K + columns
        a = tl.load(starts + inner[None, :], mask=rows & (inner < K)[None, :], other=0.0)
        acc = dl.dot(a, grouped.expert_weights(w_desc, expert, k * BLOCK_K, col, BLOCK_N, BLOCK_K), acc)
    return acc


@jit
def ag_moe_kernel(x_ptr, gathered_ptr, w_desc, out_ptr, pair_ptr, counts_ptr, base_ptr, flags_ptr, calls_ptr, tokens,
                  N, K, slot_rows, TOPK: tl.constexpr, W_PAD: tl.constexpr, E_PAD: tl.constexpr,
                  FLAGS_PER_SHARD: tl.constexpr, EPOCH_FLAGS: tl.constexpr, BY_EXPERT: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                  FLATTEN: tl.constexpr):
    """x_ptr: this rank's tokens; gathered_ptr: `ShardGather.gathered` (slots of `slot_rows` rows
    of K); out_ptr: h; pair_ptr, counts_ptr, base_ptr: the call's `MoEHandle`. Flags as ag_gemm's
    (EPOCH_FLAGS: raised to the call epoch in slot epoch % 2; else slot 0's, raised to 1)."""
    epoch = call_epoch(calls_ptr)
    me = dl.rank()
    world = dl.num_ranks()
    slot = 0
    expected = 1
    if EPOCH_FLAGS:
        slot = epoch % 2
        expected = epoch
    row_tiles, phase_ends = tp_routing.phases(counts_ptr, me, world, W_PAD, E_PAD, BLOCK_M, BY_EXPERT)
    tiles_n = tl.cdiv(N, BLOCK_N)
    # Own tokens are read where they are; a peer's from its rows of this call's slot of `gathered`.
    own = x_ptr - me * tokens * K
    peers = gathered_ptr + slot * slot_rows * K
    flags = flags_ptr + slot * world * FLAGS_PER_SHARD
    ready = me * 0  # a zero that the rows' addresses take in, to keep their loads after the waits
    if BY_EXPERT:
        # Nearly every tile reads every rank's tokens: wait for them all before the first. (Waited
        # inside the tile loop, Triton 3.6 no longer pipelined the flattened loop's loads of A, and
        # ag_moe by expert took 2.4x the grouped GEMM alone at mixtral on 2 x H100, 2026-11-26.)
        for step in range(1, world):
            ready = after_flags(ready, flags + ((me + step) % world) * FLAGS_PER_SHARD, FLAGS_PER_SHARD, expected)
    arrived = me  # the last source whose flags this program has seen
    rows = tl.arange(0, BLOCK_M)
    for tile in tl.range(tl.program_id(0), tl.sum(row_tiles, 0) * tiles_n, tl.num_programs(0), flatten=FLATTEN):
        source, expert, row, end, tn = tp_routing.moe_tile(tile, row_tiles, phase_ends, me, world, counts_ptr,
                                                           base_ptr, tiles_n, W_PAD, E_PAD, BLOCK_M, GROUP_M,
                                                           BY_EXPERT)
        # The wait's token goes into an offset, not a pointer: a pointer chosen after a wait stopped
        # Triton from pipelining the loads computed from it (2026-11-25, tests/gpu_compile.py).
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
               dtype: torch.dtype) -> dict:
    """The GEMM config of an MoE op over `pairs` rows of h in world_size x experts segments (see
    `persistent.resolve_config`; candidates `grouped.configs`)."""
    segments = tridist.world().world_size * experts
    return persistent.resolve_config(config, name, key, make_op, make_inputs, device, pairs, n, dtype=dtype,
                                     candidates=grouped.configs(device, dtype),
                                     default=grouped.default_config(device, pairs, segments, n, dtype))


def random_routing(tokens: int, topk: int, experts: int, device: torch.device) -> torch.Tensor:
    """Distinct random experts for each token, for tuning."""
    return torch.rand(tokens, experts, device=device).argsort(dim=1)[:, :topk].contiguous()


class AllGatherMoE:
    """`ag_moe` for `tokens` tokens of k features per rank, `topk` of `experts` experts each, and
    weights split to n columns per rank, with its buffers allocated once; one instance per stream.
    `comm`: "ce", "sm" or "auto" as for `AllGatherGEMM`; `config`: a dict of
    `tridist.ops.gemm.grouped.configs`, None for the default, or "tune" (a collective);
    `tile_order`: "source", "expert" or "auto" (`tp_routing.choose_tile_order`): how the GEMM walks
    its tiles (`tp_routing`'s docstring)."""

    def __init__(self, tokens: int, k: int, n: int, experts: int, topk: int, dtype: torch.dtype, comm: str = "auto",
                 comm_programs: int | None = None, config: dict | str | None = None, tile_order: str = "auto"):
        if comm not in COMMS:
            raise checks.method_error("ag_moe comm", comm, COMMS)
        check_build("ag_moe", tokens, topk, experts, k, n, dtype)
        if comm_programs is not None:
            checks.check_programs(comm_programs, "comm_programs", "the programs that push the tokens with comm='sm'")
        self.world = w = tridist.world()
        self.comm = ("ce" if w.nnodes == 1 else "sm") if comm == "auto" else comm
        if self.comm == "ce":
            checks.require_one_node("ag_moe comm='ce'", "comm='sm'")
        self.tokens, self.k, self.n, self.experts, self.topk, self.dtype = tokens, k, n, experts, topk, dtype
        self.pairs = w.world_size * tokens * topk
        checks.check_offsets("ag_moe", max(self.pairs * n, 2 * w.world_size * tokens * k))
        self.by_expert = tp_routing.choose_tile_order(tile_order, self.pairs, experts, tp_routing.AG_MOE_SOURCE_ROWS)
        self.config = moe_config(
            config, "ag_moe", (tokens, k, n, experts, topk, str(dtype), self.comm, comm_programs, self.by_expert),
            lambda c: AllGatherMoE(tokens, k, n, experts, topk, dtype, self.comm, comm_programs, c, tile_order),
            lambda: (torch.randn(tokens, k, device=w.device).to(dtype),
                     random_routing(tokens, topk, experts, w.device),
                     torch.randn(experts, k, n, device=w.device).to(dtype)),
            w.device, self.pairs, experts, n, dtype)
        self.router = tp_routing.Router(tokens, topk, experts)
        self.gather = ShardGather(tokens, k, dtype, self.comm, comm_programs)
        self.calls = torch.zeros(1, dtype=torch.int64, device=w.device)

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
            check_routing(topk_idx_shard, "topk_idx_shard", self.tokens, self.topk, torch.int64)
            check_weights(w_shard, "w_shard", self.experts, self.k, self.n, self.dtype)
            tp_routing.check_experts(topk_idx_shard, self.experts)
            if out is not None:
                checks.check_output(out, (self.pairs, self.n), self.dtype)

        checks.agree("ag_moe", check, {"shape and dtype of x_shard": checks.shape_of(x_shard)})
        if out is None:
            out = torch.empty((self.pairs, self.n), dtype=self.dtype, device=x_shard.device)
        config = self.config
        self.gather.start(x_shard)
        handle = self.router(topk_idx_shard)
        w = self.world
        bound = w.world_size * (triton.cdiv(self.tokens * self.topk, config["BLOCK_M"]) + self.experts) * \
            triton.cdiv(self.n, config["BLOCK_N"])
        ag_moe_kernel[(min(bound, self.gather.gemm_programs),)](
            x_shard, self.gather.gathered, grouped.weight_descriptor(w_shard, config), out, handle.pair_of_row,
            handle.padded_counts, handle.padded_base, self.gather.flags, self.calls, self.tokens, self.n, self.k,
            self.gather.slot_rows, TOPK=self.topk, W_PAD=triton.next_power_of_2(w.world_size), E_PAD=handle.e_pad,
            FLAGS_PER_SHARD=self.gather.flags_per_shard, EPOCH_FLAGS=self.gather.epoch_flags, BY_EXPERT=self.by_expert,
            **config)
        self.gather.finish()
        return out, handle

    def free(self) -> None:
        """Give the symmetric buffers back (collective: every rank, in the same order)."""
        self.router.free()
        self.gather.free()


def ag_moe(x_shard: torch.Tensor, topk_idx_shard: torch.Tensor, w_shard: torch.Tensor, out: torch.Tensor | None = None,
           comm: str = "auto", config: dict | str | None = None,
           tile_order: str = "auto") -> tuple[torch.Tensor, MoEHandle]:
    """The up projection of a tensor-parallel MoE layer, the all-gather of the tokens overlapped with
    the grouped GEMM. A collective: every rank calls it with the same shapes.

    Args:
        x_shard: this rank's tokens, T_r x K, bf16 or fp16 (every rank the same T_r: pad if needed).
        topk_idx_shard: int64 T_r x topk, the experts of each token (ids in [0, E); checked before
            launch in the emulator and with TRIDIST_DEBUG=1, which read them back; otherwise an id
            out of range is clamped into it).
        w_shard: E x K x N/world of x_shard's dtype: this rank's columns of every expert's weights.
        out: h, or None for a new tensor.
        comm: "ce" (copy engines, one node), "sm" (any topology) or "auto" (ce on one node).
        config: a dict of `tridist.ops.gemm.grouped.configs`, None, or "tune".
        tile_order: "source" (the tiles of each rank's tokens in the order they arrive: the
            all-gather hidden, each expert's weights read once per rank), "expert" (each expert's
            rows of every rank together: its weights read once, the all-gather waited for before the
            first tile), or "auto": by expert where the (rank, expert) segments are small enough
            for the weights' reads to be what the GEMM waits on (`tp_routing.AG_MOE_SOURCE_ROWS`).

    Returns:
        (h, handle): h is (world_size * T_r * topk) x N/world, a row for every (token, k) pair of
        every rank's tokens, x[token] @ w_shard[topk_idx[token, k]], rows grouped by expert (within an
        expert by source rank, token, k); `handle` (`MoEHandle`) says which pair each row is, holds
        the gathered routing and what `moe_rs` needs.

    K and N/world must be multiples of 8. Keeps one `AllGatherMoE` per shape and stream. Raises
    ValueError before launching anything for shapes, dtypes or layouts it does not take.
    """
    def check() -> None:
        checks.check_input(x_shard, "x_shard", DTYPES)
        checks.check_input(topk_idx_shard, "topk_idx_shard", (torch.int64,))
        grouped.check_weights(w_shard, "w_shard", DTYPES)
        if x_shard.dim() != 2 or topk_idx_shard.dim() != 2:
            raise ValueError(f"x_shard and topk_idx_shard must be matrices (tokens x K, tokens x topk); got shapes "
                             f"{tuple(x_shard.shape)} and {tuple(topk_idx_shard.shape)}")

    shape_of = checks.shape_of
    checks.agree("ag_moe", check, {"shape and dtype of x_shard": shape_of(x_shard),
                                      "shape of topk_idx_shard": shape_of(topk_idx_shard),
                                      "shape of w_shard": shape_of(w_shard), "comm": comm, "config": repr(config),
                                      "tile_order": tile_order})
    (tokens, k), topk, (experts, _, n) = x_shard.shape, topk_idx_shard.shape[1], w_shard.shape
    op = instances.instance(lambda: AllGatherMoE(tokens, k, n, experts, topk, x_shard.dtype, comm, config=config,
                                                 tile_order=tile_order),
                            AllGatherMoE, tokens, k, n, experts, topk, x_shard.dtype, comm, repr(config), tile_order,
                            device=x_shard.device)
    return op(x_shard, topk_idx_shard, w_shard, out)


@torch.library.custom_op("tridist::ag_moe", mutates_args=())
def ag_moe_op(x_shard: torch.Tensor, topk_idx_shard: torch.Tensor, w_shard: torch.Tensor,
              comm: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """`ag_moe` as a PyTorch custom op (`torch.ops.tridist.ag_moe`), for torch.compile: returns h and
    the handle's `layout`, which `torch.ops.tridist.moe_rs` takes."""
    h, handle = ag_moe(x_shard, topk_idx_shard, w_shard, comm=comm)
    return h, handle.layout


@ag_moe_op.register_fake
def _ag_moe_shape(x_shard: torch.Tensor, topk_idx_shard: torch.Tensor, w_shard: torch.Tensor,
                  comm: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    world_size = tridist.world().world_size
    (tokens, topk), (experts, _, n) = topk_idx_shard.shape, w_shard.shape
    return (x_shard.new_empty((world_size * tokens * topk, n)),
            x_shard.new_empty((MoEHandle.numel(world_size, tokens, topk, experts),), dtype=torch.int32))
