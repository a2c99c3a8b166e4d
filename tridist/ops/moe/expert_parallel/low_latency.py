"""Expert parallelism, low-latency mode (decode): `EPBuffer.low_latency_dispatch` and
`EPBuffer.low_latency_combine`, their kernels, staging and launches. One copy per (token, expert)
pair, grouped by expert: recv_x[e] holds local expert e's pairs, from rank 0 first.

Routing (`_routing.pairs_to_experts`, before the dispatch) gives each pair its place among this
rank's pairs of its expert; `ll_dispatch_kernel` puts pair (t, k) into the region of (expert, rank)
of the expert's rank with the pair's index as meta, and the receiver packs each expert's regions in
rank order. A rank's own pairs skip the staging (copied from x once the counts of the ranks before
it are in), except with a receive hook: the send and the receive are then two launches
(`return_recv_hook=True`, so compute overlaps the transfer), and x may change between them.

`ll_combine_kernel` sends each pair's output to row t * topk + k of its source's staging, and each
token sums topk_weights[t, k] x its pairs, in k order (`_staging.sum_parts`; the pairs of its own
experts read where the dispatch put them, in y).
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

import tridist.language as dl
from tridist.runtime.jit import jit

from ... import call_order, checks
from ...protocol import call_epoch, finish_call, in_slot
from .._exchange import (arrivals_at_least, arrive, await_counts, chunk_of, copy_rows, exchange_program, gather,
                         send_rows, send_values, split_rows)
from ._routing import pairs_to_experts
from ._staging import BLOCK_R, Exchange, Layer, block_w, combine_blocks, nonempty, sum_parts, token_words

FP8 = torch.float8_e4m3fn
FP8_GROUP = 128   # columns that share one fp8 scale
FP8_MAX = 448.0   # the largest e4m3 value


def row_words(hidden: int, fp8: bool) -> int:
    """4-byte words of a low-latency row: the token (bf16/fp16), or fp8 values and a float32 scale
    per FP8_GROUP columns."""
    if fp8:
        return (hidden + 4 * (hidden // FP8_GROUP)) // 4
    return hidden // 2


class DispatchStaging(NamedTuple):
    """The dispatch's symmetric buffers and counters, one tuple argument of `ll_dispatch_kernel`
    (unpacked by position there: a kernel compiled from the compile log sees a plain tuple)."""
    rows: torch.Tensor       # int32 [2, slot_numel]: per slot, [E_local, world, max_tokens] rows
    meta: torch.Tensor       # int32 [2, meta_slot]: per slot, a word per row (the pair's index)
    counts: torch.Tensor     # int32 [2, W_PAD * E_PAD]: per slot, a row of E_PAD per source
    arrivals: torch.Tensor   # an arrival counter per source (`_exchange.arrive`)
    calls: torch.Tensor      # the calls counter (`protocol.call_epoch`)
    slot_numel: int
    meta_slot: int


class Received(NamedTuple):
    """What a dispatch receives, one tuple argument of `ll_dispatch_kernel` (unpacked by position)."""
    x: torch.Tensor          # int32 [E_local, world * max_tokens, row words] (`launch` returns recv_x)
    src: torch.Tensor        # int32 [E_local, world * max_tokens]: source_rank * max_tokens * topk + pair
    count: torch.Tensor      # int32 [E_local]: pairs received per expert
    layout: torch.Tensor     # int32 [2, W_PAD, E_PAD]: pairs from each (rank, expert), and their first row


class CombineStaging(NamedTuple):
    """The combine's symmetric buffers and counters, one tuple argument of `ll_combine_kernel`
    (unpacked by position there)."""
    rows: torch.Tensor       # [2, slot_numel]: per slot, max_tokens * topk rows of outputs
    arrivals: torch.Tensor   # an arrival counter per source (`_exchange.arrive`)
    calls: torch.Tensor      # the calls counter (`protocol.call_epoch`)
    slot_numel: int


@triton.jit
def await_dispatch(arrivals_ptr, counts, stage, meta_stage, peer, epoch, splits, group=None):
    """A dispatch receiver's wait: every source's counts, then all of `peer`'s parts (ranks of
    `group`, if given). Returns `counts`, `stage` and `meta_stage` made to depend on the waits, for
    the loads that read them."""
    counts = await_counts(arrivals_ptr, counts, dl.num_ranks(group), epoch, splits)
    arrived = arrivals_at_least(arrivals_ptr, peer, epoch * splits)
    return counts, dl.consume_token(stage, arrived), dl.consume_token(meta_stage, arrived)


@triton.jit
def await_own_counts(arrivals_ptr, counts, epoch, splits, writes_layout, group=None):
    """The wait of a dispatch program that copies this rank's own rows from x: they go after the
    rows of the ranks before it, so the counts of those are all it needs (`writes_layout`: the
    program that also writes the whole layout, which waits for every rank's). No grid-wide wait:
    at one rank, none at all. Ranks of `group`, if given."""
    sources = dl.rank(group)
    if writes_layout:
        sources = dl.num_ranks(group)
    return await_counts(arrivals_ptr, counts, sources, epoch, splits)


@triton.jit
def await_combine(arrivals_ptr, stage, epoch, splits, group=None):
    """A combine receiver's wait: every program of every source (of `group`, if given) has arrived.
    Returns `stage` made to depend on the waits."""
    for source in range(dl.num_ranks(group)):
        stage = dl.consume_token(stage, arrivals_at_least(arrivals_ptr, source, epoch * splits))
    return stage


@triton.jit
def expert_blocks(counts, peer, world, experts_local, W_PAD: tl.constexpr, E_PAD: tl.constexpr):
    """A receiver's layout from `counts` (a row of E_PAD words per source: the pairs it sent for
    each local expert). Returns the matrix [W_PAD, E_PAD], each source's first row in each expert's
    block (`placed`: after the lower sources' pairs), and `peer`'s row of each (`mine`,
    `mine_at`)."""
    sources = tl.arange(0, W_PAD)
    experts = tl.arange(0, E_PAD)
    matrix = tl.load(counts + sources[:, None] * E_PAD + experts[None, :],
                     mask=(sources < world)[:, None] & (experts < experts_local)[None, :], other=0)
    placed = tl.cumsum(matrix, 0) - matrix
    mine = tl.sum(tl.where(sources[:, None] == peer, matrix, 0), 0)
    mine_at = tl.sum(tl.where(sources[:, None] == peer, placed, 0), 0)
    return matrix, placed, mine, mine_at


@triton.jit
def block_rows(rows, mine, mine_at, peer, world, max_tokens):
    """For rows 0, 1, ... of `peer`'s pairs (expert by expert, `mine` of each), the staging row they
    are in ([expert, source, place] rows, `max_tokens` places) and their row of the output ([expert,
    world * max_tokens] rows, `peer`'s pairs of an expert from `mine_at` on)."""
    ends = tl.cumsum(mine, 0)
    expert = chunk_of(rows, ends)
    index = rows - gather(ends - mine, expert)
    return (expert * world + peer) * max_tokens + index, expert * world * max_tokens + gather(mine_at, expert) + index


@triton.jit
def _pairs_to(idx_ptr, positions_ptr, pairs, inside, peer, experts_local, max_tokens):
    """Of this rank's (token, expert) pairs `pairs`, those whose expert is `peer`'s: (going, the
    expert as `peer`'s local index, the pair's place among this rank's pairs of that expert). A
    place past max_tokens (only a token routed twice to one expert gets there) is refused in debug
    mode and dropped otherwise."""
    ids = tl.load(idx_ptr + pairs, mask=inside, other=-1)
    going = inside & (ids >= 0) & (ids // experts_local == peer)
    place = tl.load(positions_ptr + pairs, mask=going, other=0)
    dl.check(tl.max(tl.where(going, place, 0), 0) < max_tokens,
             "low_latency_dispatch: pairs of one expert from one rank > max_tokens_per_rank (a token "
             "routed twice to an expert?)", tl.max(tl.where(going, place, 0), 0), max_tokens)
    return going & (place < max_tokens), ids % experts_local, place


@jit
def ll_dispatch_kernel(x_ptr, idx_ptr, positions_ptr, routed_ptr, pair_ids_ptr, staging, recv, tokens, width,
                       max_tokens, experts_local, topk, local_world_size, splits, SEND: tl.constexpr,
                       RECEIVE: tl.constexpr, W_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_W: tl.constexpr, group=None):
    """Low-latency mode. Grid (world, splits), ranks of `group` if given. x: T rows of `width` words; positions: each pair's
    place among this rank's pairs of its expert; routed: pairs per expert [E]; pair_ids: 0, 1, ...
    (the meta word each pair sends). staging: a `DispatchStaging`; recv: a `Received`, recv_x
    [E_local, world * max_tokens] rows. SEND and RECEIVE: the two halves (both: one launch; apart:
    `return_recv_hook`, the receive launch counting no call of its own)."""
    staging_ptr, meta_staging_ptr, counts_ptr, arrivals_ptr, calls_ptr, slot_numel, meta_slot = staging
    recv_x_ptr, recv_src_ptr, recv_count_ptr, recv_layout_ptr = recv
    epoch = call_epoch(calls_ptr)
    if not SEND:
        epoch -= 1  # the send launch of this call has counted it already
    me = dl.rank(group)
    world = dl.num_ranks(group)
    peer = tl.program_id(0)
    split = tl.program_id(1)
    stage = in_slot(staging_ptr, epoch, slot_numel)
    meta_stage = in_slot(meta_staging_ptr, epoch, meta_slot)
    counts = in_slot(counts_ptr, epoch, W_PAD * E_PAD)
    experts = tl.arange(0, E_PAD)
    local = experts < experts_local
    # With both halves in one launch this rank's own pairs skip the staging: the receive copies them
    # straight from x. With a hook the receive is a later launch, when x may have changed.
    own_direct = False
    if SEND and RECEIVE:
        own_direct = peer == me
    if SEND:
        if not own_direct:
            first, stop = split_rows(tokens * topk, split, splits)
            for first_pair in range(first, stop, BLOCK_R):
                pairs = first_pair + tl.arange(0, BLOCK_R)
                going, expert, place = _pairs_to(idx_ptr, positions_ptr, pairs, pairs < stop, peer, experts_local,
                                                 max_tokens)
                target = (expert * world + me) * max_tokens + place
                send_rows(x_ptr, pairs // topk, stage, target, going, width, peer, local_world_size, BLOCK_R, BLOCK_W,
                          group)
                send_rows(pair_ids_ptr, pairs, meta_stage, target, going, 1, peer, local_world_size, BLOCK_R, 2,
                          group)
        per_expert = tl.load(routed_ptr + peer * experts_local + experts, mask=local, other=0)
        send_values(counts, me * E_PAD + experts, tl.minimum(per_expert, max_tokens), local, peer,
                    local_world_size, E_PAD, group)
        arrive(arrivals_ptr + me, peer, local_world_size, group)
    if RECEIVE:
        writes_layout = (peer == 0) & (split == 0)
        if own_direct:
            counts = await_own_counts(arrivals_ptr, counts, epoch, splits, writes_layout, group)
        else:
            counts, stage, meta_stage = await_dispatch(arrivals_ptr, counts, stage, meta_stage, peer, epoch, splits,
                                                       group)
        matrix, placed, mine, mine_at = expert_blocks(counts, peer, world, experts_local, W_PAD, E_PAD)
        sources = tl.arange(0, W_PAD)
        if own_direct:
            first, stop = split_rows(tokens * topk, split, splits)
            for first_pair in range(first, stop, BLOCK_R):
                pairs = first_pair + tl.arange(0, BLOCK_R)
                going, expert, place = _pairs_to(idx_ptr, positions_ptr, pairs, pairs < stop, me, experts_local,
                                                 max_tokens)
                target = expert * world * max_tokens + gather(mine_at, expert.to(tl.int32)) + place
                copy_rows(x_ptr, pairs // topk, recv_x_ptr, target, going, width, BLOCK_W)
                tl.store(recv_src_ptr + target, me * max_tokens * topk + pairs, mask=going)
        else:
            first, stop = split_rows(tl.sum(mine, 0), split, splits)
            for at in range(first, stop, BLOCK_R):
                rows = at + tl.arange(0, BLOCK_R)
                inside = rows < stop
                source_rows, target = block_rows(rows, mine, mine_at, peer, world, max_tokens)
                copy_rows(stage, source_rows, recv_x_ptr, target, inside, width, BLOCK_W)
                pair_index = tl.load(meta_stage + source_rows, mask=inside, other=0)
                tl.store(recv_src_ptr + target, peer * max_tokens * topk + pair_index, mask=inside)
        if writes_layout:  # all of it, the padding's zero counts included: the combine reads whole rows
            tl.store(recv_count_ptr + experts, tl.sum(matrix, 0), mask=local)
            tl.store(recv_layout_ptr + sources[:, None] * E_PAD + experts[None, :], matrix)
            tl.store(recv_layout_ptr + W_PAD * E_PAD + sources[:, None] * E_PAD + experts[None, :], placed)
        dl.shmem.quiet()
    if SEND:
        finish_call(calls_ptr)


@jit
def ll_combine_kernel(y_ptr, recv_src_ptr, recv_layout_ptr, idx_ptr, weights_ptr, positions_ptr, staging, out_ptr,
                      tokens, hidden, max_tokens, experts_local, local_world_size, splits, TOPK: tl.constexpr,
                      W_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
                      group=None):
    """Low-latency mode, the way back. Grid (world, splits), ranks of `group` if given. y: recv_x's layout, [E_local, world *
    max_tokens] rows of `hidden`; positions: the dispatch's place of each of this rank's pairs among
    its pairs of the expert; staging: a `CombineStaging`, whose rows are per slot [max_tokens *
    TOPK]: row t * TOPK + k holds the output of this rank's pair (t, k). Program (p, s) sends part s
    of the pairs received from p (none from itself: the sum reads those from y), then sums part
    p * splits + s of this rank's tokens."""
    staging_ptr, arrivals_ptr, calls_ptr, slot_numel = staging
    epoch, me, world, peer, split, stage = exchange_program(calls_ptr, staging_ptr, slot_numel, group)
    experts = tl.arange(0, E_PAD)
    mine = tl.load(recv_layout_ptr + peer * E_PAD + experts)
    mine_at = tl.load(recv_layout_ptr + W_PAD * E_PAD + peer * E_PAD + experts)
    first, stop = split_rows(tl.sum(mine, 0), split, splits)
    if peer != me:
        for at in range(first, stop, BLOCK_R):
            rows = at + tl.arange(0, BLOCK_R)
            inside = rows < stop
            _, source_rows = block_rows(rows, mine, mine_at, peer, world, max_tokens)
            pair = tl.load(recv_src_ptr + source_rows, mask=inside, other=0) - peer * max_tokens * TOPK
            send_rows(y_ptr, source_rows, stage, pair, inside, hidden, peer, local_world_size, BLOCK_R, BLOCK_W,
                      group)
    arrive(arrivals_ptr + me, peer, local_world_size, group)

    stage = await_combine(arrivals_ptr, stage, epoch, splits, group)
    first, stop = split_rows(tokens, peer * splits + split, world * splits)
    own_at = recv_layout_ptr + W_PAD * E_PAD + me * E_PAD  # where this rank's pairs start in each expert's block
    sum_parts(stage, out_ptr, first, stop, hidden, idx_ptr, weights_ptr, y_ptr, own_at, positions_ptr, max_tokens,
              experts_local, TOPK, True, BLOCK_R, BLOCK_W, group)
    finish_call(calls_ptr)


class LowLatencyDispatch(Exchange):
    """`EPBuffer.low_latency_dispatch` for tokens of `topk` experts, with `fp8` casts or not: per
    slot, staging for num_experts x max_tokens rows (expert, source, place) of a word of meta each,
    and a row of counts per source."""

    name = "low_latency_dispatch"

    def __init__(self, layer: Layer, topk: int, fp8: bool):
        super().__init__(layer, "ll_dispatch_fp8" if fp8 else "ll_dispatch")
        w = self.ranks
        self.fp8 = fp8
        rows, self.width = layer.num_experts * layer.max_tokens, row_words(layer.hidden, fp8)
        checks.check_offsets("EPBuffer", 2 * rows * self.width)
        self.staging = DispatchStaging(
            rows=self.symmetric("staging", (2, rows * self.width), torch.int32),
            meta=self.symmetric("meta", (2, rows), torch.int32),
            counts=self.symmetric("counts", (2, layer.w_pad * layer.e_pad), torch.int32),
            arrivals=self.signals("arrivals", w.world_size),
            calls=torch.zeros(1, dtype=torch.int64, device=w.device),
            slot_numel=rows * self.width, meta_slot=rows)
        pair_ids = torch.arange(layer.max_tokens * topk, dtype=torch.int32, device=w.device)
        self.pair_ids = self.sendable(pair_ids, self.send_buffer(w, pair_ids.numel(), torch.int32, "EPBuffer pair ids"))
        self.send = self.send_buffer(w, layer.max_tokens * self.width, torch.int32, "EPBuffer low_latency_dispatch")

    def payload(self, x: torch.Tensor) -> torch.Tensor:
        """The rows the dispatch moves, as int32 words: x itself, or with fp8 each token's e4m3
        values followed by its float32 scales (one per FP8_GROUP columns)."""
        if not self.fp8:
            return token_words(x)
        if not x.shape[0]:
            return torch.empty((0, self.width), dtype=torch.int32, device=x.device)
        hidden = self.layer.hidden
        groups = x.float().view(x.shape[0], hidden // FP8_GROUP, FP8_GROUP)
        scales = groups.abs().amax(-1).clamp(min=1e-12) / FP8_MAX
        values = (groups / scales[..., None]).to(FP8).view(torch.uint8).view(x.shape[0], hidden)
        return torch.cat([values, scales.view(torch.uint8)], 1).view(torch.int32)

    def launch(self, x: torch.Tensor, topk_idx: torch.Tensor, hook: bool):
        """Send one copy of each token of x ([T, hidden]) to each of its experts (`topk_idx`, ids out
        of range already made -1). Returns (a `Received`, its x made recv_x (`unpack`); positions,
        int32 [T * topk]: each pair's row among this rank's pairs of its expert; receive: None, or
        with `hook` the launch of the receive half, which the send half leaves to it)."""
        layer, w = self.layer, self.ranks
        tokens, topk = topk_idx.shape
        positions, routed = pairs_to_experts(topk_idx, layer.num_experts, w.device)
        slots = w.world_size * layer.max_tokens
        received = torch.empty((layer.experts_local, slots, 4 * self.width), dtype=torch.uint8, device=w.device)
        recv = Received(x=received.view(torch.int32),
                        src=torch.empty((layer.experts_local, slots), dtype=torch.int32, device=w.device),
                        count=torch.empty(layer.experts_local, dtype=torch.int32, device=w.device),
                        layout=torch.empty((2, layer.w_pad, layer.e_pad), dtype=torch.int32, device=w.device))
        args = dict(x_ptr=nonempty(self.sendable(self.payload(x), self.send)), idx_ptr=nonempty(topk_idx),
                    positions_ptr=nonempty(positions), routed_ptr=routed, pair_ids_ptr=self.pair_ids,
                    staging=self.staging, recv=recv, tokens=tokens, width=self.width, max_tokens=layer.max_tokens,
                    experts_local=layer.experts_local, topk=topk, local_world_size=w.local_world_size,
                    W_PAD=layer.w_pad, E_PAD=layer.e_pad, BLOCK_R=BLOCK_R, BLOCK_W=block_w(self.width), num_warps=8)
        self.fit(ll_dispatch_kernel, SEND=True, RECEIVE=True, **args)
        if not hook:
            self.start(ll_dispatch_kernel, SEND=True, RECEIVE=True, **args)
            return recv._replace(x=self.unpack(received)), positions, None

        def receive():  # it waits on the peers' sends, so it takes its turn as an op does
            call_order.take_turn()
            self.start(ll_dispatch_kernel, coresident=False, SEND=False, RECEIVE=True, **args)

        self.start(ll_dispatch_kernel, coresident=False, SEND=True, RECEIVE=False, **args)
        return recv._replace(x=self.unpack(received)), positions, receive

    def unpack(self, received: torch.Tensor):
        """recv_x as `EPBuffer.low_latency_dispatch` returns it, from the received rows (uint8): the
        tokens in the buffer's dtype, or with fp8 (values in float8_e4m3fn, float32 scales [...,
        hidden // FP8_GROUP]), views of the rows."""
        hidden = self.layer.hidden
        if not self.fp8:
            return received.view(self.layer.dtype)
        return received[..., :hidden].view(FP8), received[..., hidden:].view(torch.float32)


class LowLatencyCombine(Exchange):
    """`EPBuffer.low_latency_combine` for tokens of `topk` experts: per slot, staging for
    max_tokens x topk rows of outputs (row t * topk + k: the output of this rank's pair (t, k))."""

    name = "low_latency_combine"

    def __init__(self, layer: Layer, topk: int):
        super().__init__(layer, "ll_combine")
        w = self.ranks
        rows = layer.max_tokens * topk
        checks.check_offsets("EPBuffer", 2 * rows * layer.hidden)
        self.staging = CombineStaging(rows=self.symmetric("staging", (2, rows * layer.hidden), layer.dtype),
                                      arrivals=self.signals("arrivals", w.world_size),
                                      calls=torch.zeros(1, dtype=torch.int64, device=w.device),
                                      slot_numel=rows * layer.hidden)
        self.send = self.send_buffer(w, layer.experts_local * w.world_size * layer.max_tokens * layer.hidden,
                                     layer.dtype, "EPBuffer low_latency_combine")

    def launch(self, y: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, recv_src: torch.Tensor,
               recv_layout: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Send each pair's output (y, recv_x's layout) back to its token's rank; returns [T, hidden]:
        per token t of this rank, the sum over k of topk_weights[t, k] x the output of expert
        topk_idx[t, k], in k order (fp32). topk_idx, recv_src, recv_layout, positions: the
        dispatch's."""
        layer, w = self.layer, self.ranks
        tokens, topk = topk_idx.shape
        out = torch.empty((max(tokens, 1), layer.hidden), dtype=layer.dtype, device=w.device)
        self.start(ll_combine_kernel, y_ptr=self.sendable(y, self.send), recv_src_ptr=recv_src,
                   recv_layout_ptr=recv_layout, idx_ptr=nonempty(topk_idx), weights_ptr=nonempty(topk_weights),
                   positions_ptr=nonempty(positions), staging=self.staging, out_ptr=out, tokens=tokens,
                   hidden=layer.hidden, max_tokens=layer.max_tokens, experts_local=layer.experts_local,
                   local_world_size=w.local_world_size, TOPK=topk, W_PAD=layer.w_pad, E_PAD=layer.e_pad,
                   **combine_blocks(layer))
        return out[:tokens]
