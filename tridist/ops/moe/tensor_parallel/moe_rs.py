"""MoE-ReduceScatter: the down projection of a tensor-parallel MoE layer, the grouped GEMM, the
top-k weighted sum and the reduce-scatter to the tokens' owners overlapped: the front
(`MoEReduceScatter`, `moe_rs`) and its one method (`GemmCombine`).

h is what `ag_moe` returned (P = world_size * T_r * topk rows grouped by expert, after any
activation, N/world columns), w_shard (E x N/world x K) this rank's rows of every expert's down
weights, topk_weights_shard (T_r x topk, float32) the weights of this rank's tokens. Rank r gets
y_shard (T_r x K): for each of its tokens t, sum over k of topk_weights[t, k] * (h[row of (t, k)] @
w[expert]), summed over the ranks (each holds a part of the N columns). With a process group
(`group=`), the ranks are the group's, as in the `ag_moe` call whose h and handle it takes. A pair
that `ag_moe` dropped (an expert id out of range) adds nothing to its token's sum.

Protocol (slots and call epochs as in `protocol.py`)
- The GEMM (`moe_rs_gemm_kernel`) walks the tiles of h (`routing`'s walks). By source, phase by
  phase: the rows of rank+1's tokens first, then rank+2's, ..., this rank's own last, as gemm_rs
  orders its tiles. Each tile's rows go to `products` (P x K, local, h's row order), and one tile
  late (so that the tile's stores have drained when the release is made) it adds 1 to done[slot,
  source], the count of finished tiles of that source's rows, which the peers' combine beside it
  waits for. By expert the peers' combine runs after the GEMM on the same stream, so nothing counts
  (each count is a system-scope release, which costs time); nor at world size 1, where nothing
  waits.
  Program 0 zeroes the other slot's counts for the next call (this call's other kernels have
  finished with it: each call waits for the last).
- The combine for the peers (`moe_combine_kernel` with OWN=False), by source on a side stream
  beside the GEMM (`policy.MOE_RS_COMM_SHARE` of the SMs: `comm_programs`), by expert after it
  (every rank's sums are done only near the GEMM's end), with every SM: program 0 first sends this
  rank's topk weights into row `rank` of every peer's weights exchange and raises flag (slot, rank)
  there to the epoch. Then, for each
  peer s in the GEMM's order, once done[slot, s] has reached the tile count of s's rows (computed
  from `counts`) and s's weights are here, piece after piece (CHUNK of s's tokens by a span of
  the K columns): the weighted sum of the products of their top-k pairs, in fp32, goes to rank
  s's `partials` row `rank`, in h's dtype (stores through symm_at on this node, an NVSHMEM put of
  a copy in `send` across nodes), and flag (slot, rank, piece) goes up there.
- The combine of the own tokens (OWN=True), on the current stream after the GEMM, with every SM:
  this rank's weighted sums plus every peer's partials of the same piece (waiting for its flag),
  in fp32, into y_shard. At world size 1 it is the only combine.
Nothing waits on a kernel that waits back: the GEMM waits for nothing, the peers' combine for the
GEMM and the peers' weights (sent before anything else), the own combine for the peers' combines.
"""
import contextlib
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

import tridist
import tridist.language as dl
from tridist.runtime.jit import jit

from ... import checks, copy_engines, instances, protocol, sizing
from ...protocol import after_flags, call_epoch, copy_slice, finish_call, in_slot, push_slice, sync_program
from ...gemm import grouped, persistent
from ...method import Method
from ...ranks import ranks_of
from .. import policy
from . import routing
from .routing import DTYPES, MoEHandle

# Tokens per piece of the combine, and columns per step; small in the emulator, where tests use a
# few tokens and want several pieces.
CHUNK = {"cuda": 16, "cpu": 2}
BLOCK_C = {"cuda": 256, "cpu": 16}
WEIGHTS_BLOCK = tl.constexpr(1024)  # weights moved per step of their exchange


class Products(NamedTuple):
    """What the GEMM hands the combines, one tuple argument of `moe_combine_kernel` (unpacked by
    position there: a kernel compiled from the compile log sees a plain tuple)."""
    products: torch.Tensor   # [P, K]: h @ w[expert], h's row order
    done: torch.Tensor       # [2, world]: per slot, the GEMM's finished tiles of each source's rows
    tiles_n: int             # the GEMM's column tiles (K / its BLOCK_N)


class CombineStaging(NamedTuple):
    """The combines' symmetric buffers and counters, one tuple argument of `moe_combine_kernel`."""
    partials: torch.Tensor   # [2, slot_numel]: per slot, rank src's sums for this rank at row src
    send: torch.Tensor       # this rank's sums for peers on other nodes, as partials' rows (else partials)
    exchange: torch.Tensor   # float32 [2, world, weights_row]: per slot, every rank's topk weights
    weights_row: int
    flags: torch.Tensor      # per slot: world x pieces for the partials, then world for the weights
    calls: torch.Tensor      # the launch's calls counter (`protocol.call_epoch`)
    slot_numel: int


@jit
def moe_rs_gemm_kernel(h_desc, w_desc, products_ptr, counts_ptr, base_ptr, done_ptr, calls_ptr, N, K,
                       COUNT: tl.constexpr, W_PAD: tl.constexpr, E_PAD: tl.constexpr, BY_EXPERT: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       FLATTEN: tl.constexpr, ZERO_TAIL: tl.constexpr, group=None):
    """products (P x N) = h (P x K, rows grouped by segment) @ w[expert] per segment; done_ptr: a
    count per source rank, two slots, raised with COUNT (by source with peers: the peers' combine
    beside the GEMM waits for them).
    `late` takes the tile's source inside a branch (always taken): flattened by Triton 3.6, a plain
    assignment there is handed on at the tile's first K step instead of its last, so each count
    would go to the tile's own source; in the branch the fused loop hands it on from the epilogue
    (test_moe_rs_gemm_counts_each_tile_once; tests/test_triton_loops.py's "count in a branch").
    Ranks of `group`, if given."""
    epoch = call_epoch(calls_ptr)
    me = dl.rank(group)
    world = dl.num_ranks(group)
    sources = tl.arange(0, W_PAD)
    if tl.program_id(0) == 0:
        tl.store(in_slot(done_ptr, epoch + 1, world) + sources, 0, mask=sources < world)
    done = in_slot(done_ptr, epoch, world)
    first = (me + 1) % world
    row_tiles, phase_ends = routing.phases(counts_ptr, first, world, W_PAD, E_PAD, BLOCK_M, BY_EXPERT)
    tiles_n = tl.cdiv(N, BLOCK_N)
    late = tl.cast(-1, tl.int32)  # the source of the tile stored last, whose count is still to raise
    for tile in tl.range(tl.program_id(0), tl.sum(row_tiles, 0) * tiles_n, tl.num_programs(0), flatten=FLATTEN):
        source, expert, row, end, tn = routing.moe_tile(tile, row_tiles, phase_ends, first, world, counts_ptr,
                                                           base_ptr, tiles_n, W_PAD, E_PAD, BLOCK_M, GROUP_M,
                                                           BY_EXPERT)
        acc = grouped.group_product(h_desc, w_desc, row, end, expert, tn * BLOCK_N, K, BLOCK_M, BLOCK_N, BLOCK_K,
                                    ZERO_TAIL)
        if COUNT:
            if late >= 0:
                dl.notify(done + late, me, signal=1, sig_op="add", group=group)
            if source >= 0:  # always: see the docstring
                late = source
        persistent.store_tile(products_ptr, acc, row, tn * BLOCK_N, end, N, BLOCK_M, BLOCK_N)
    if late >= 0:
        dl.notify(done + late, me, signal=1, sig_op="add", group=group)
    finish_call(calls_ptr)


@triton.jit
def _weighted_sum(products_ptr, row_of_pair_ptr, weights_ptr, pair0, t0, tokens, col, K, TOPK: tl.constexpr,
                  CHUNK: tl.constexpr, BLOCK_C: tl.constexpr):
    """For tokens t0..t0+CHUNK (of `tokens`) whose pairs start at pair0 (global token * TOPK):
    sum over k of weights[t, k] * products[row of pair (t, k), col:col+BLOCK_C], in fp32; a pair
    that has no row (-1: its id was dropped) adds nothing."""
    t = t0 + tl.arange(0, CHUNK)
    cols = col + tl.arange(0, BLOCK_C)
    mask = (t < tokens)[:, None] & (cols < K)[None, :]
    acc = tl.zeros((CHUNK, BLOCK_C), dtype=tl.float32)
    # Unrolled, so that the TOPK gathers, independent of each other, can all be in flight at once.
    for k in tl.static_range(TOPK):
        rows = tl.load(row_of_pair_ptr + pair0 + t * TOPK + k, mask=t < tokens, other=-1)
        weight = tl.load(weights_ptr + t * TOPK + k, mask=t < tokens, other=0.0)
        values = tl.load(products_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :],
                         mask=mask & (rows >= 0)[:, None], other=0.0)
        acc += weight[:, None] * values.to(tl.float32)
    return acc


@triton.jit
def _piece_offsets(col, span, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr):
    """Offsets of columns col..col+BLOCK_C of a piece: CHUNK rows of `span` columns, contiguous."""
    return tl.arange(0, CHUNK)[:, None] * span + col + tl.arange(0, BLOCK_C)[None, :]


@jit
def moe_combine_kernel(gemm, row_of_pair_ptr, counts_ptr, weights_ptr, staging, out_ptr, tokens, K, local_world_size,
                       spans, span, TOPK: tl.constexpr, GEMM_BLOCK_M: tl.constexpr, OWN: tl.constexpr,
                       W_PAD: tl.constexpr, E_PAD: tl.constexpr, BY_EXPERT: tl.constexpr, CHUNK: tl.constexpr,
                       BLOCK_C: tl.constexpr, group=None):
    """OWN=False: the combine for the peers; OWN=True: of this rank's own tokens (see the module
    docstring). gemm: the GEMM's `Products`; row_of_pair, counts: the call's `MoEHandle`; weights:
    this rank's topk weights; staging: a `CombineStaging`. The work comes in pieces: CHUNK tokens by
    `span` columns (`spans` of them across K), piece p = chunk * spans + j. The weights' exchange
    has rows `weights_row` apart; partials: rank src's sums at row src, piece after piece, each
    CHUNK x span contiguous; send: this rank's sums for peers on other nodes, laid out as partials'
    rows. Ranks (and `local_world_size`) of `group`, if given."""
    products_ptr, done_ptr, gemm_tiles_n = gemm
    partials_ptr, send_ptr, exchange_ptr, weights_row, flags_ptr, calls_ptr, slot_numel = staging
    epoch = call_epoch(calls_ptr)
    me = dl.rank(group)
    world = dl.num_ranks(group)
    pieces = tl.cdiv(tokens, CHUNK) * spans
    flags = in_slot(flags_ptr, epoch, world * pieces + world)
    weights_flags = flags + world * pieces
    exchange = in_slot(exchange_ptr, epoch, world * weights_row)
    partials = in_slot(partials_ptr, epoch, slot_numel)
    row = pieces * CHUNK * span  # elements of a row of partials
    if not OWN:
        if tl.program_id(0) == 0:
            copy_slice(weights_ptr, exchange + me * weights_row, 0, tokens * TOPK, WEIGHTS_BLOCK)
            sync_program()  # pushed below by other threads than stored it
            for step in range(1, world):
                push_slice(exchange + me * weights_row, exchange + me * weights_row, 0, tokens * TOPK,
                           weights_flags + me, epoch, (me + step) % world, local_world_size, WEIGHTS_BLOCK,
                           group=group)
        first = (me + 1) % world
        row_tiles, phase_ends = routing.phases(counts_ptr, first, world, W_PAD, E_PAD, GEMM_BLOCK_M, BY_EXPERT)
        for j in range(world - 1):
            source = (first + j) % world
            if BY_EXPERT:  # launched after the GEMM, on its stream: nothing to wait for
                products = products_ptr
            else:
                products = after_flags(products_ptr, in_slot(done_ptr, epoch, world) + source, 1,
                                       grouped.pick(row_tiles, j) * gemm_tiles_n)
            weights = after_flags(exchange + source * weights_row, weights_flags + source, 1, epoch)
            same_node = source // local_world_size == me // local_world_size
            for piece in range(tl.program_id(0), pieces, tl.num_programs(0)):
                t0 = (piece // spans) * CHUNK
                first_col = (piece % spans) * span
                to = partials + me * row + piece * CHUNK * span
                staged = send_ptr + source * row + piece * CHUNK * span
                for col in range(0, tl.minimum(span, K - first_col), BLOCK_C):
                    total = _weighted_sum(products, row_of_pair_ptr, weights, source * tokens * TOPK, t0, tokens,
                                          first_col + col, K, TOPK, CHUNK, BLOCK_C)
                    at = _piece_offsets(col, span, CHUNK, BLOCK_C)
                    if same_node:
                        tl.store(dl.symm_at(to, source, group) + at, total.to(partials_ptr.dtype.element_ty))
                    else:
                        tl.store(staged + at, total.to(partials_ptr.dtype.element_ty))
                flag = flags + me * pieces + piece
                if same_node:
                    dl.notify(flag, source, signal=epoch, sig_op="set", group=group)
                else:
                    sync_program()  # the whole block puts what its threads stored
                    nbytes = CHUNK * span * (partials_ptr.dtype.element_ty.primitive_bitwidth // 8)
                    dl.shmem.putmem_signal_nbi_block(to, staged, nbytes, flag, epoch, dl.shmem.SIGNAL_SET, source,
                                                     group)
    else:
        for piece in range(tl.program_id(0), pieces, tl.num_programs(0)):
            t0 = (piece // spans) * CHUNK
            first_col = (piece % spans) * span
            received = partials + piece * CHUNK * span
            for step in range(1, world):
                received = after_flags(received, flags + ((me + step) % world) * pieces + piece, 1, epoch)
            for col in range(0, tl.minimum(span, K - first_col), BLOCK_C):
                total = _weighted_sum(products_ptr, row_of_pair_ptr, weights_ptr, me * tokens * TOPK, t0, tokens,
                                      first_col + col, K, TOPK, CHUNK, BLOCK_C)
                at = _piece_offsets(col, span, CHUNK, BLOCK_C)
                for step in range(1, world):
                    total += tl.load(received + ((me + step) % world) * row + at).to(tl.float32)
                rows = t0 + tl.arange(0, CHUNK)[:, None]
                cols = first_col + col + tl.arange(0, BLOCK_C)[None, :]
                mask = (rows < tokens) & (cols < K)
                tl.store(out_ptr + rows * K + cols, total.to(out_ptr.dtype.element_ty), mask=mask)
    dl.shmem.quiet()
    finish_call(calls_ptr)


class GemmCombine(Method):
    """moe_rs's method for h of `n` columns, `experts` x n x k down weights and `tokens` tokens of
    `topk` experts per rank, among `ranks` (an `ops.ranks.Ranks`): the grouped GEMM
    (`moe_rs_gemm_kernel`, at `config`, its tiles walked by expert or by source: `by_expert`), the
    combine for the peers (on `comm_programs` programs beside the GEMM by source, after it by
    expert) and the combine of the own tokens."""

    name = "gemm_combine"

    def __init__(self, tokens: int, n: int, k: int, experts: int, topk: int, dtype: torch.dtype, comm_programs: int,
                 config: dict, by_expert: bool, ranks):
        super().__init__()
        self.ranks = w = ranks
        self.tokens, self.n, self.k, self.experts, self.topk = tokens, n, k, experts, topk
        self.config, self.by_expert, self.comm_programs = config, by_expert, comm_programs
        self.peers = w.world_size > 1  # the peers' tokens get a combine of their own
        # By source it runs beside the GEMM, which counts its tiles for it (COUNT); by expert after it.
        self.overlap = self.peers and not by_expert
        self.programs = programs = sizing.programs_for(w.device)
        self.gemm_programs = max(1, programs - comm_programs) if self.overlap else programs
        kind = w.device.type
        self.chunk, self.block_c = CHUNK[kind], BLOCK_C[kind]
        chunks = triton.cdiv(tokens, self.chunk)
        # Pieces across K as well where the tokens alone would leave SMs without work: about two
        # pieces per SM for the combine of the own tokens, which nothing overlaps.
        spans = max(1, min(triton.cdiv(k, self.block_c), triton.cdiv(2 * programs, chunks)))
        self.span = triton.cdiv(triton.cdiv(k, spans), self.block_c) * self.block_c
        self.spans = triton.cdiv(k, self.span)
        self.pieces = chunks * self.spans
        row = self.pieces * self.chunk * self.span
        checks.check_offsets("moe_rs", 2 * w.world_size * row)
        workspace = self.own(protocol.Workspace(w.world_size * row, dtype, w.world_size * (self.pieces + 1),
                                                 group=w.group))
        weights_row = sizing.row_stride(tokens * topk)
        exchange = self.own(tridist.symm_empty((2 * w.world_size * weights_row,), torch.float32, w.group))
        send = workspace.staging
        if w.nnodes > 1:
            send = self.own(tridist.symm_empty((w.world_size * row,), dtype, w.group))
        self.gemm = Products(products=torch.empty((w.world_size * tokens * topk, k), dtype=dtype, device=w.device),
                             done=self.own(tridist.signals(2 * w.world_size, w.group)),
                             tiles_n=triton.cdiv(k, config["BLOCK_N"]))
        self.gemm_calls = torch.zeros(1, dtype=torch.int64, device=w.device)
        # The two combines share the staging, each launch counting its own calls.
        self.own_staging = CombineStaging(partials=workspace.staging, send=send, exchange=exchange,
                                          weights_row=weights_row, flags=workspace.flags, calls=workspace.calls,
                                          slot_numel=workspace.slot_numel)
        self.peer_staging = self.own_staging._replace(calls=torch.zeros(1, dtype=torch.int64, device=w.device))
        self.side = copy_engines.SideStream(w.device)

    def launch(self, h: torch.Tensor, w_shard: torch.Tensor, handle: MoEHandle, topk_weights_shard: torch.Tensor,
               out: torch.Tensor) -> None:
        """One call into `out` (tokens x K)."""
        w, config = self.ranks, self.config
        h_desc = TensorDescriptor.from_tensor(h, [config["BLOCK_M"], config["BLOCK_K"]])
        bound = w.world_size * (triton.cdiv(self.tokens * self.topk, config["BLOCK_M"]) + self.experts) * \
            triton.cdiv(self.k, config["BLOCK_N"])
        w_pad, e_pad = triton.next_power_of_2(w.world_size), handle.e_pad
        moe_rs_gemm_kernel[(min(bound, self.gemm_programs),)](
            h_desc=h_desc, w_desc=grouped.weight_descriptor(w_shard, config), products_ptr=self.gemm.products,
            counts_ptr=handle.padded_counts, base_ptr=handle.padded_base, done_ptr=self.gemm.done,
            calls_ptr=self.gemm_calls, N=self.k, K=self.n, COUNT=self.overlap, W_PAD=w_pad, E_PAD=e_pad,
            BY_EXPERT=self.by_expert, ZERO_TAIL=grouped.zero_tail(h.device), group=w.group, **config)
        args = dict(gemm=self.gemm, row_of_pair_ptr=handle.row_of_pair, counts_ptr=handle.padded_counts,
                    weights_ptr=topk_weights_shard, out_ptr=out, tokens=self.tokens, K=self.k,
                    local_world_size=w.local_world_size, spans=self.spans, span=self.span, TOPK=self.topk,
                    GEMM_BLOCK_M=config["BLOCK_M"], W_PAD=w_pad, E_PAD=e_pad, BY_EXPERT=self.by_expert,
                    CHUNK=self.chunk, BLOCK_C=self.block_c, group=w.group)
        if self.peers:
            programs = self.comm_programs if self.overlap else self.programs
            with self.side.fork() if self.overlap else contextlib.nullcontext():
                moe_combine_kernel[(min(programs, self.pieces),)](staging=self.peer_staging, OWN=False, **args)
        moe_combine_kernel[(min(self.programs, self.pieces),)](staging=self.own_staging, OWN=True, **args)
        if self.overlap:
            self.side.join()


class MoEReduceScatter:
    """`moe_rs` for h of `n` columns (N/world), `experts` x n x k down weights, and `tokens` tokens
    of `topk` experts per rank, with its buffers allocated once; one instance per stream.
    `comm_programs`: the programs of the peers' combine, beside the GEMM (default
    `policy.MOE_RS_COMM_SHARE`'s part of the SMs; by expert it runs after the GEMM, on every SM);
    `config`, `tile_order`: as for `AllGatherMoE`; `group`: as for `moe_rs`."""

    def __init__(self, tokens: int, n: int, k: int, experts: int, topk: int, dtype: torch.dtype,
                 comm_programs: int | None = None, config: dict | str | None = None, tile_order: str = "auto",
                 group=None):
        routing.check_build("moe_rs", tokens, topk, experts, n, k, dtype)
        if comm_programs is not None:
            checks.check_programs(comm_programs, "comm_programs", "the programs of the peers' combine")
        self.ranks = w = ranks_of(group)
        self.tokens, self.n, self.k, self.experts, self.topk, self.dtype = tokens, n, k, experts, topk, dtype
        self.pairs = w.world_size * tokens * topk
        checks.check_offsets("moe_rs", max(self.pairs * max(n, k), 2 * w.world_size * tokens * k))
        self.by_expert = policy.choose_tile_order(tile_order, self.pairs, experts, policy.MOE_RS_SOURCE_ROWS, w)
        self.config = routing.moe_config(
            config, "moe_rs", (tokens, n, k, experts, topk, str(dtype), comm_programs, self.by_expert),
            lambda c: _Tuning(MoEReduceScatter(tokens, n, k, experts, topk, dtype, comm_programs, c, tile_order,
                                               group)),
            lambda: _Tuning.inputs(tokens, n, k, experts, topk, dtype, w), w.device, self.pairs, experts, k,
            dtype, w)
        self.comm_programs = policy.moe_rs_comm_programs(comm_programs, sizing.programs_for(w.device))
        self.method = GemmCombine(tokens, n, k, experts, topk, dtype, self.comm_programs, self.config,
                                  self.by_expert, w)

    def __call__(self, h: torch.Tensor, w_shard: torch.Tensor, handle: MoEHandle, topk_weights_shard: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's tokens' outputs, as `moe_rs` (which keeps an instance of this class per shape
        and stream): `out`, if given, is the tokens x K result's storage."""
        w = self.ranks

        def check() -> None:
            routing.check_routing(topk_weights_shard, "topk_weights_shard", self.tokens, self.topk, torch.float32)
            routing.check_weights(w_shard, "w_shard", self.experts, self.n, self.k, self.dtype)
            check_handle(handle, w.world_size, self.tokens, self.topk, self.experts, w.device)
            checks.check_input(h, "h", (self.dtype,))
            if tuple(h.shape) != (self.pairs, self.n):
                raise ValueError(f"this moe_rs takes h {self.dtype} of shape {(self.pairs, self.n)} (a row per pair "
                                 f"of every rank's tokens); got shape {tuple(h.shape)}: build another instance, or "
                                 "call tridist.ops.moe_rs")
            if h.data_ptr() % 16:
                raise ValueError("h does not start on a 16-byte boundary, as TMA needs (a view at an odd offset?): "
                                 "pass h.clone()")
            if out is not None:
                checks.check_output(out, (self.tokens, self.k), self.dtype)

        checks.agree("moe_rs", check, {"shape and dtype of h": checks.shape_of(h)}, group=self.ranks.group)
        if out is None:
            out = torch.empty((self.tokens, self.k), dtype=self.dtype, device=h.device)
        self.method.launch(h, w_shard, handle, topk_weights_shard, out)
        return out

    def free(self) -> None:
        """Give the symmetric buffers back (collective: every rank, in the same order)."""
        self.method.free()


class _Tuning:
    """A MoEReduceScatter called as `tridist.tune` calls an op: with random inputs and a handle of
    their own routing (a routing step of its own runs once, untimed)."""

    def __init__(self, op: MoEReduceScatter):
        self.op = op

    @staticmethod
    def inputs(tokens: int, n: int, k: int, experts: int, topk: int, dtype: torch.dtype, ranks):
        device = ranks.device
        router = routing.Router(tokens, topk, experts, ranks)
        handle = router(routing.random_routing(tokens, topk, experts, device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        tridist.barrier_all(ranks.group)
        router.free()
        pairs = ranks.world_size * tokens * topk
        return (torch.randn(pairs, n, device=device).to(dtype), torch.randn(experts, n, k, device=device).to(dtype),
                handle, torch.rand(tokens, topk, device=device))

    def __call__(self, *inputs):
        return self.op(*inputs)

    def free(self) -> None:
        self.op.free()


def check_handle(handle, world_size: int, tokens: int, topk: int, experts: int, device: torch.device) -> None:
    """handle is an `ag_moe` handle of these sizes."""
    if not isinstance(handle, MoEHandle):
        raise ValueError(f"handle must be the MoEHandle that ag_moe returned; got {type(handle).__name__}")
    got = (handle.world_size, handle.tokens, handle.topk, handle.experts)
    if got != (world_size, tokens, topk, experts):
        raise ValueError(f"the handle is of an ag_moe call with (world size, tokens, topk, experts) = {got}; this "
                         f"moe_rs call has {(world_size, tokens, topk, experts)} (topk_weights_shard, w_shard)")
    numel = MoEHandle.numel(world_size, tokens, topk, experts)
    layout = handle.layout
    if layout.dtype != torch.int32 or layout.numel() != numel or layout.device != device or not layout.is_contiguous():
        raise ValueError(f"the handle's layout must be contiguous int32 of {numel} elements on {device}")


def moe_rs(h: torch.Tensor, w_shard: torch.Tensor, handle: MoEHandle, topk_weights_shard: torch.Tensor,
           out: torch.Tensor | None = None, config: dict | str | None = None, tile_order: str = "auto",
           group=None) -> torch.Tensor:
    """The down projection of a tensor-parallel MoE layer: the grouped GEMM, the top-k weighted sum
    and the reduce-scatter to the tokens' owners, overlapped. A collective (of `group`'s ranks).

    Args:
        h: what `ag_moe` returned (after any activation): (world_size * T_r * topk) x N/world, bf16 or
            fp16, a row per pair in the handle's order.
        w_shard: E x N/world x K of h's dtype: this rank's rows of every expert's down weights.
        handle: the `MoEHandle` that `ag_moe` returned with h.
        topk_weights_shard: float32 T_r x topk, the weights of this rank's tokens' experts.
        out: T_r x K in h's dtype, or None for a new tensor.
        config: a dict of `tridist.ops.gemm.grouped.configs`, None, or "tune".
        tile_order: "source" (the tiles of each rank's tokens in turn, their sums sent while the
            GEMM goes on; each expert's weights read once per rank), "expert" (each expert's rows of
            every rank together, its weights read once; the sums sent after the GEMM), or "auto"
            (with peers by expert, the faster at every layer measured: `policy.MOE_RS_SOURCE_ROWS`).
        group: the ranks it runs among: the `group` of the `ag_moe` call that made h and the
            handle (a `torch.distributed` process group, a `tridist.Group`, or None for the world).

    Returns:
        y_shard, T_r x K: for each of this rank's tokens, sum over k of topk_weights[t, k] *
        (h[row of (t, k)] @ w[expert]), summed over the ranks (a pair that ag_moe dropped adds
        nothing); products rounded to h's dtype before the sums (each rank's partial sums too, as
        gemm_rs sends them), sums in fp32.

    N/world and K must be multiples of 8. Keeps one `MoEReduceScatter` per shape, group and stream.
    Raises ValueError before launching anything for shapes, dtypes, layouts or a handle it does not
    take, or on a rank that is not a member of `group`.
    """
    def check() -> None:
        checks.check_input(h, "h", DTYPES)
        checks.check_input(topk_weights_shard, "topk_weights_shard", (torch.float32,))
        grouped.check_weights(w_shard, "w_shard", DTYPES)
        if h.dim() != 2 or topk_weights_shard.dim() != 2:
            raise ValueError(f"h and topk_weights_shard must be matrices; got shapes {tuple(h.shape)} and "
                             f"{tuple(topk_weights_shard.shape)}")

    shape_of = checks.shape_of
    ranks = ranks_of(group)  # a rank outside the group is refused here, before anything else
    checks.agree("moe_rs", check, {"shape and dtype of h": shape_of(h), "shape of w_shard": shape_of(w_shard),
                                      "shape of topk_weights_shard": shape_of(topk_weights_shard),
                                      "config": repr(config), "tile_order": tile_order}, group=ranks.group)
    (tokens, topk), (experts, n, k) = topk_weights_shard.shape, w_shard.shape
    op = instances.instance(lambda: MoEReduceScatter(tokens, n, k, experts, topk, h.dtype, config=config,
                                                     tile_order=tile_order, group=ranks.group),
                            MoEReduceScatter, tokens, n, k, experts, topk, h.dtype, repr(config), tile_order,
                            ranks.key, device=h.device)
    return op(h, w_shard, handle, topk_weights_shard, out)
