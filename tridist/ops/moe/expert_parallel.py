"""Expert parallelism: dispatch tokens to the ranks that hold their experts, and combine the experts'
outputs back, with top-k routing computed on the device (`EPBuffer`, DeepEP's shape of API).

Experts are spread evenly: rank r holds experts r * E_local ... (r + 1) * E_local - 1. A token t
with `topk_idx[t]` = its experts (-1: none) takes two ways, one per mode:

**Normal mode** (prefill, training): a token goes once to every rank that holds one of its
experts. Routing (`sort`) gives each token its place among the tokens for each rank;
`dispatch_kernel` then runs the family's protocol (`exchange.py`): program (p, s) puts its
share s of the tokens for rank p into region `rank` of p's staging (rows of x, and a meta row:
the token's expert ids, weights and index), writes the count and the pairs per expert of p there,
and adds 1 to p's arrival counter for this rank (`exchange.arrive`); then, as a receiver, it waits
until every source's counts are here and all of rank p's programs have arrived, and copies p's
tokens into recv_x after those of ranks before p. `combine_kernel`
runs the way back: each received token's output goes to row (rank, token) of its source's
combine staging, and each token sums what every rank that got it sent, in rank order.

**Low-latency mode** (decode): one copy per (token, expert) pair, grouped by expert:
recv_x[e] holds local expert e's pairs, from rank 0 first. Routing gives each pair its place
among this rank's pairs of its expert; `ll_dispatch_kernel` puts pair (t, k) into the region of
(expert, rank) of the expert's rank with the pair's index as meta; the receiver packs each
expert's regions in rank order. `ll_combine_kernel` sends each pair's output to row t * topk + k
of its source's staging, and each token sums topk_weights[t, k] x its pairs, in k order. The send
and the receive can be two launches (`return_recv_hook=True`), so compute overlaps the transfer.

A rank's rows for itself never pass through staging: its dispatch copies them from x straight
to their place in recv_x once the counts say where that is, and its combine sums its own experts'
outputs from y where they are (with a receive hook the low-latency dispatch still stages them,
since x may change before the hook runs). At one rank each way is then a single copy.

In both modes sums run in fp32 in a fixed order, so equal inputs give equal bits. Every call
waits for a flag from every peer, so two slots of staging (by epoch) make back-to-back calls and
CUDA-graph replays safe without a handshake.
"""
import dataclasses

import torch
import triton
import triton.language as tl

import tridist
import tridist.language as dl
from tridist.runtime import config
from tridist.runtime.jit import jit
from tridist.runtime.tensors import check_tensor

from .. import _protocol
from .._protocol import call_epoch, finish_call
from . import exchange, sort
from .exchange import (arrive, await_combine, await_dispatch, await_own_counts, block_rows, copy_rows,
                       expert_blocks, gather, send_rows, send_values, split_rows)

DTYPES = (torch.bfloat16, torch.float16)
FP8 = torch.float8_e4m3fn
FP8_GROUP = 128   # columns that share one fp8 scale
FP8_MAX = 448.0   # the largest e4m3 value
BLOCK_R = 8       # rows a step moves
TILE = 8192       # elements a step moves at most
CALLS = ("dispatch", "combine", "low_latency_dispatch", "low_latency_dispatch fp8", "low_latency_combine")


def _words(t: torch.Tensor) -> torch.Tensor:
    """Tokens as 4-byte words, as the kernels move them."""
    return t.view(torch.int32)


# ---- kernels -------------------------------------------------------------------------------------
@triton.jit
def _receive_tokens(x_ptr, meta_ptr, rows, out_rows, inside, source, recv_x_ptr, recv_idx_ptr, recv_weights_ptr,
                    recv_src_ptr, width, max_tokens, experts_local, topk, K_PAD: tl.constexpr, BLOCK_W: tl.constexpr):
    """Normal mode's receive of `source`'s tokens: x and meta rows `rows` (in its staging region, or
    the source's own x and meta where the source is this rank) to recv rows `out_rows`, with the
    expert ids made local (-1 for other ranks' experts), the weights and the token's origin."""
    me = dl.rank()
    meta_width = 2 * topk + 1
    copy_rows(x_ptr, rows, recv_x_ptr, out_rows, inside, width, BLOCK_W)
    k = tl.arange(0, K_PAD)[None, :]
    where = meta_ptr + rows.to(tl.int64)[:, None] * meta_width
    valid = inside[:, None] & (k < topk)
    ids = tl.load(where + k, mask=valid, other=-1)
    mine = (ids >= me * experts_local) & (ids < (me + 1) * experts_local)
    out = out_rows.to(tl.int64)[:, None]
    tl.store(recv_idx_ptr + out * topk + k, tl.where(mine, ids - me * experts_local, -1).to(tl.int64), mask=valid)
    weights = tl.load(where + topk + k, mask=valid, other=0)
    tl.store(recv_weights_ptr + out * topk + k, weights.to(tl.float32, bitcast=True), mask=valid)
    token = tl.load(meta_ptr + rows.to(tl.int64) * meta_width + 2 * topk, mask=inside, other=0)
    tl.store(recv_src_ptr + out_rows, source * max_tokens + token, mask=inside)


@jit
def dispatch_kernel(x_ptr, meta_ptr, positions_ptr, routed_ptr, staging_ptr, meta_staging_ptr, counts_ptr,
                    arrivals_ptr, calls_ptr, recv_x_ptr, recv_idx_ptr, recv_weights_ptr, recv_src_ptr, recv_layout_ptr,
                    recv_per_expert_ptr, tokens, width, max_tokens, experts_local, topk, slot_numel, meta_slot,
                    local_world_size, splits, W_PAD: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    """Normal mode. Grid (world, splits). x: T rows of `width` words; meta: T rows of 2 * topk + 1
    int32 (expert ids, weight bits, token index); positions: [T, world] from routing (-1: not for
    that rank); routed: tokens per rank [world], then pairs per expert [world * E_local]. Per slot,
    staging is [world, max_tokens] rows and counts a row of 2 * E_PAD int32 per source: word 0 the
    tokens it sent here, word E_PAD + e its pairs for local expert e."""
    epoch = call_epoch(calls_ptr)
    me = dl.rank()
    world = dl.num_ranks()
    peer = tl.program_id(0)
    split = tl.program_id(1)
    meta_width = 2 * topk + 1
    stage = staging_ptr + (epoch % 2) * slot_numel
    meta_stage = meta_staging_ptr + (epoch % 2) * meta_slot
    counts = counts_ptr + (epoch % 2) * W_PAD * 2 * E_PAD
    experts = tl.arange(0, E_PAD)
    local = experts < experts_local

    # Send this program's share of the tokens for `peer`, each at its place among them. This rank's
    # own tokens skip the staging: the receive below copies them straight from x.
    first, stop = split_rows(tokens, split, splits)
    if peer != me:
        for token in range(first, stop, BLOCK_R):
            rows = token + tl.arange(0, BLOCK_R)
            place = tl.load(positions_ptr + rows.to(tl.int64) * world + peer, mask=rows < stop, other=-1)
            going = place >= 0
            send_rows(x_ptr, rows, stage + me * max_tokens * width, place, going, width, peer, local_world_size,
                      BLOCK_R, BLOCK_W)
            send_rows(meta_ptr, rows, meta_stage + me * max_tokens * meta_width, place, going, meta_width, peer,
                      local_world_size, BLOCK_R, K_PAD)
    words = tl.arange(0, 2 * E_PAD)
    pair_words = (words >= E_PAD) & (words - E_PAD < experts_local)
    routed = tl.load(routed_ptr + tl.where(words == 0, peer, world + peer * experts_local + words - E_PAD),
                     mask=(words == 0) | pair_words, other=0)
    send_values(counts, me * 2 * E_PAD + words, routed, (words == 0) | pair_words, peer, local_world_size, 2 * E_PAD)
    arrive(arrivals_ptr + me, peer, local_world_size)

    writes_layout = (peer == 0) & (split == 0)
    if peer == me:
        counts = await_own_counts(arrivals_ptr, counts, epoch, splits, writes_layout)
    else:
        counts, stage, meta_stage = await_dispatch(arrivals_ptr, counts, stage, meta_stage, peer, epoch, splits)
    sources = tl.arange(0, W_PAD)
    received = tl.load(counts + sources * 2 * E_PAD, mask=sources < world, other=0)
    before = tl.cumsum(received, 0) - received
    start = tl.sum(tl.where(sources == peer, before, 0), 0)
    if peer == me:
        for token in range(first, stop, BLOCK_R):
            rows = token + tl.arange(0, BLOCK_R)
            place = tl.load(positions_ptr + rows.to(tl.int64) * world + me, mask=rows < stop, other=-1)
            _receive_tokens(x_ptr, meta_ptr, rows, start + place, place >= 0, me, recv_x_ptr, recv_idx_ptr,
                            recv_weights_ptr, recv_src_ptr, width, max_tokens, experts_local, topk, K_PAD, BLOCK_W)
    else:
        first, stop = split_rows(tl.sum(tl.where(sources == peer, received, 0), 0), split, splits)
        for at in range(first, stop, BLOCK_R):
            rows = at + tl.arange(0, BLOCK_R)
            _receive_tokens(stage + peer * max_tokens * width, meta_stage + peer * max_tokens * meta_width, rows,
                            start + rows, rows < stop, peer, recv_x_ptr, recv_idx_ptr, recv_weights_ptr,
                            recv_src_ptr, width, max_tokens, experts_local, topk, K_PAD, BLOCK_W)
    if writes_layout:
        pairs = tl.load(counts + sources[:, None] * 2 * E_PAD + E_PAD + experts[None, :],
                        mask=(sources < world)[:, None] & local[None, :], other=0)
        tl.store(recv_per_expert_ptr + experts, tl.sum(pairs, 0).to(tl.int64), mask=local)
        tl.store(recv_layout_ptr + sources, received, mask=sources < world)
        tl.store(recv_layout_ptr + world + sources, before, mask=sources < world)
    dl.shmem.quiet()
    finish_call(calls_ptr)


@triton.jit
def sum_parts(stage, out_ptr, first, stop, hidden, present_ptr, weights_ptr, own_ptr, own_at_ptr, own_rows_ptr,
              max_tokens, experts_local, PARTS: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK_R: tl.constexpr,
              BLOCK_W: tl.constexpr):
    """What the combines end with: out[t] = the sum over j < PARTS, in j order, in fp32, of part j of
    token t, for the tokens t in [first, stop). Part j is there where present[t * PARTS + j] >= 0.
    The loop over the parts is unrolled, so that their loads are in flight together (a program may
    have a single token: 128 tokens over 132 programs at one rank).
    Parts that this rank's own experts made are read where they are, in y (`own_ptr`), which
    nothing copied to the staging:
    - WEIGHTED (low-latency mode): present holds the expert ids; part j is the pair (t, k = j)
      times weights[t * PARTS + j], in staging row t * PARTS + j, or for an expert e of this rank
      in y's row e * world * max_tokens + own_at[e] + own_rows[t * PARTS + j] (where the dispatch
      placed the pair);
    - else (normal mode): present holds the token's place among those sent to rank j; part j is
      what rank j sent, already weighted, in staging row j * max_tokens + t, or for j = this rank
      in y's row own_at[0] + the place."""
    me = dl.rank()
    world = dl.num_ranks()
    columns = tl.arange(0, BLOCK_W)[None, :]
    for token in range(first, stop, BLOCK_R):
        rows = token + tl.arange(0, BLOCK_R)
        inside = rows < stop
        for column in range(0, hidden, BLOCK_W):
            where = column + columns
            total = tl.zeros([BLOCK_R, BLOCK_W], dtype=tl.float32)
            for j in tl.static_range(PARTS):
                index = rows.to(tl.int64) * PARTS + j
                value = tl.load(present_ptr + index, mask=inside, other=-1)
                present = inside & (value >= 0)
                if WEIGHTED:
                    own = present & (value // experts_local == me)
                    expert = value - me * experts_local
                    place = tl.load(own_rows_ptr + index, mask=own, other=0)
                    present = present & ~(own & (place >= max_tokens))  # a pair the dispatch dropped
                    own_row = expert * world * max_tokens + tl.load(own_at_ptr + expert, mask=own, other=0) + place
                    row = index
                    weight = tl.load(weights_ptr + index, mask=present, other=0.0)
                else:
                    own = present & (j == me)
                    own_row = tl.load(own_at_ptr) + value
                    row = (j * max_tokens + rows).to(tl.int64)
                    weight = present.to(tl.float32)
                source = tl.where(own[:, None], own_ptr + own_row.to(tl.int64)[:, None] * hidden,
                                  stage + row[:, None] * hidden)
                part = tl.load(source + where, mask=present[:, None] & (where < hidden), other=0.0)
                total += weight[:, None] * part.to(tl.float32)
            tl.store(out_ptr + rows.to(tl.int64)[:, None] * hidden + where, total.to(out_ptr.dtype.element_ty),
                     mask=inside[:, None] & (where < hidden))


@jit
def combine_kernel(y_ptr, recv_src_ptr, recv_layout_ptr, positions_ptr, staging_ptr, arrivals_ptr, calls_ptr, out_ptr,
                   tokens, hidden, max_tokens, slot_numel, local_world_size, splits, WORLD: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    """Normal mode, the way back. Grid (world, splits). y: the received tokens' outputs (rows of
    `hidden`); per slot, staging is [world, max_tokens] rows: row (q, t) holds rank q's output for
    this rank's token t. Program (p, s) sends part s of the tokens received from p (none from
    itself: the sum reads those from y), then sums part p * splits + s of this rank's tokens. WORLD:
    the world size, the parts of each sum."""
    epoch = call_epoch(calls_ptr)
    me = dl.rank()
    world = dl.num_ranks()
    peer = tl.program_id(0)
    split = tl.program_id(1)
    stage = staging_ptr + (epoch % 2) * slot_numel
    count = tl.load(recv_layout_ptr + peer)
    start = tl.load(recv_layout_ptr + world + peer)
    first, stop = split_rows(count, split, splits)
    if peer != me:  # this rank's own outputs are read from y in the sum below
        for at in range(first, stop, BLOCK_R):
            rows = start + at + tl.arange(0, BLOCK_R)
            inside = at + tl.arange(0, BLOCK_R) < stop
            token = tl.load(recv_src_ptr + rows, mask=inside, other=0) - peer * max_tokens
            send_rows(y_ptr, rows, stage + me * max_tokens * hidden, token, inside, hidden, peer, local_world_size,
                      BLOCK_R, BLOCK_W)
    arrive(arrivals_ptr + me, peer, local_world_size)

    stage = await_combine(arrivals_ptr, stage, epoch, splits)
    first, stop = split_rows(tokens, peer * splits + split, world * splits)
    sum_parts(stage, out_ptr, first, stop, hidden, positions_ptr, positions_ptr, y_ptr, recv_layout_ptr + world + me,
              positions_ptr, max_tokens, 1, WORLD, False, BLOCK_R, BLOCK_W)
    finish_call(calls_ptr)


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
def ll_dispatch_kernel(x_ptr, idx_ptr, positions_ptr, routed_ptr, pair_ids_ptr, staging_ptr, meta_staging_ptr,
                       counts_ptr, arrivals_ptr, calls_ptr, recv_x_ptr, recv_src_ptr, recv_count_ptr, recv_layout_ptr,
                       tokens, width, max_tokens, experts_local, topk, slot_numel, meta_slot, local_world_size,
                       splits, SEND: tl.constexpr, RECEIVE: tl.constexpr, W_PAD: tl.constexpr, E_PAD: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    """Low-latency mode. Grid (world, splits). x: T rows of `width` words; positions: each pair's
    place among this rank's pairs of its expert; routed: pairs per expert [E]. Per slot, staging is
    [E_local, world, max_tokens] rows (expert, source, place) with an int32 meta word each (the
    pair's index), counts a row of E_PAD per source. recv_x: [E_local, world * max_tokens] rows.
    SEND and RECEIVE: the two halves (both: one launch; apart: `return_recv_hook`, the receive
    launch counting no call of its own)."""
    epoch = call_epoch(calls_ptr)
    if not SEND:
        epoch -= 1  # the send launch of this call has counted it already
    me = dl.rank()
    world = dl.num_ranks()
    peer = tl.program_id(0)
    split = tl.program_id(1)
    stage = staging_ptr + (epoch % 2) * slot_numel
    meta_stage = meta_staging_ptr + (epoch % 2) * meta_slot
    counts = counts_ptr + (epoch % 2) * W_PAD * E_PAD
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
                send_rows(x_ptr, pairs // topk, stage, target, going, width, peer, local_world_size, BLOCK_R, BLOCK_W)
                send_rows(pair_ids_ptr, pairs, meta_stage, target, going, 1, peer, local_world_size, BLOCK_R, 2)
        per_expert = tl.load(routed_ptr + peer * experts_local + experts, mask=local, other=0)
        send_values(counts, me * E_PAD + experts, tl.minimum(per_expert, max_tokens), local, peer,
                    local_world_size, E_PAD)
        arrive(arrivals_ptr + me, peer, local_world_size)
    if RECEIVE:
        writes_layout = (peer == 0) & (split == 0)
        if own_direct:
            counts = await_own_counts(arrivals_ptr, counts, epoch, splits, writes_layout)
        else:
            counts, stage, meta_stage = await_dispatch(arrivals_ptr, counts, stage, meta_stage, peer, epoch, splits)
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
def ll_combine_kernel(y_ptr, recv_src_ptr, recv_layout_ptr, idx_ptr, weights_ptr, positions_ptr, staging_ptr,
                      arrivals_ptr, calls_ptr, out_ptr, tokens, hidden, max_tokens, experts_local, slot_numel,
                      local_world_size, splits, TOPK: tl.constexpr, W_PAD: tl.constexpr, E_PAD: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    """Low-latency mode, the way back. Grid (world, splits). y: recv_x's layout, [E_local, world *
    max_tokens] rows of `hidden`; positions: the dispatch's place of each of this rank's pairs among
    its pairs of the expert; per slot, staging is [max_tokens * TOPK] rows: row t * TOPK + k holds
    the output of this rank's pair (t, k). Program (p, s) sends part s of the pairs received from p
    (none from itself: the sum reads those from y), then sums part p * splits + s of this rank's
    tokens."""
    epoch = call_epoch(calls_ptr)
    me = dl.rank()
    world = dl.num_ranks()
    peer = tl.program_id(0)
    split = tl.program_id(1)
    stage = staging_ptr + (epoch % 2) * slot_numel
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
            send_rows(y_ptr, source_rows, stage, pair, inside, hidden, peer, local_world_size, BLOCK_R, BLOCK_W)
    arrive(arrivals_ptr + me, peer, local_world_size)

    stage = await_combine(arrivals_ptr, stage, epoch, splits)
    first, stop = split_rows(tokens, peer * splits + split, world * splits)
    own_at = recv_layout_ptr + W_PAD * E_PAD + me * E_PAD  # where this rank's pairs start in each expert's block
    sum_parts(stage, out_ptr, first, stop, hidden, idx_ptr, weights_ptr, y_ptr, own_at, positions_ptr, max_tokens,
              experts_local, TOPK, True, BLOCK_R, BLOCK_W)
    finish_call(calls_ptr)


# ---- host side -----------------------------------------------------------------------------------
@dataclasses.dataclass
class EPHandle:
    """What a dispatch returns for its combine: where every received row came from.

    Attributes:
        mode: "normal" or "low_latency".
        tokens: the tokens this rank dispatched (T).
        topk: experts per token.
        recv_src: for every row of recv_x, its source: normal mode source_rank * max_tokens + token;
            low-latency mode source_rank * max_tokens * topk + token * topk + k (int32).
        recv_layout: normal mode [2, world]: tokens received from each rank and their first row;
            low-latency mode [2, world, E_PAD]: pairs received from each (rank, local expert) and
            their first row within the expert's block.
        positions: normal mode, [T, world]: each token's row among those sent to each rank (-1: not
            sent there); low-latency mode, [T * topk]: each pair's row among this rank's pairs of its
            expert.
    """
    mode: str
    tokens: int
    topk: int
    recv_src: torch.Tensor
    recv_layout: torch.Tensor
    positions: torch.Tensor


class _Exchange:
    """The symmetric buffers of one kind of launch of an `EPBuffer`: per slot, staging of `rows` rows
    of `width` elements of `dtype` (and `meta_width` int32 per row, if any) and `count_words` int32
    of counts; an arrival counter per source (`exchange.arrive`) and the calls counter."""

    def __init__(self, rows: int, width: int, dtype: torch.dtype, meta_width: int, count_words: int, splits: int):
        w = tridist.world()
        _protocol.check_offsets("EPBuffer", 2 * rows * max(width, meta_width))
        self.splits = splits
        self.fitted = False
        self.slot_numel = rows * width
        self.staging = tridist.symm_zeros((2, self.slot_numel), dtype)
        self.meta = tridist.symm_zeros((2, rows * meta_width), torch.int32) if meta_width else None
        self.counts = tridist.symm_zeros((2, count_words), torch.int32) if count_words else None
        self.arrivals = tridist.signals(w.world_size)
        self.calls = torch.zeros(1, dtype=torch.int64, device=w.device)

    def fit(self, kernel, grid_world: int, args: tuple, meta: dict) -> None:
        """At the first call, shrink the splits to what a co-resident launch of `kernel` (the launch
        whose receiving programs wait for counters its own sending programs raise) can hold. Every
        launch of these buffers then has the same grid, which their call epochs count on."""
        if not self.fitted:
            self.splits = _protocol.fit_coresident(kernel, self.splits, grid_world, *args, splits=self.splits,
                                                   **meta)
            self.fitted = True

    def launch(self, kernel, grid_world: int, args: tuple, meta: dict, coresident: bool = True) -> None:
        """Launch `kernel` over (world, splits); co-resident unless it only sends or only receives."""
        self.fit(kernel, grid_world, args, meta)
        kernel[(grid_world, self.splits)](*args, splits=self.splits, coresident=coresident, **meta)

    def free(self) -> None:
        for buffer in (self.staging, self.meta, self.counts, self.arrivals):
            if buffer is not None:
                tridist.symm_free(buffer)


def _nonempty(t: torch.Tensor) -> torch.Tensor:
    """`t`, or one row of zeros where it has no rows (a rank with no tokens): the kernels read none of
    it, their loops stopping at the token count, but on GPUs an empty tensor has no address to pass."""
    return t if t.shape[0] else t.new_zeros((1, *t.shape[1:]))


def _block_w(width: int, rows: int = BLOCK_R) -> int:
    """BLOCK_W of a step of `rows` rows of `width` elements: TILE elements at most."""
    return triton.next_power_of_2(min(width, TILE // rows))


class EPBuffer:
    """Dispatch and combine of tokens for expert parallelism, in a normal mode (throughput) and a
    low-latency mode (decode); the symmetric buffers of one layer shape. DeepEP's `Buffer`, as far
    as its single-node and multi-node calls go.

    Build it on every rank at once; its calls are collectives (every rank calls the same method
    in the same order). Each mode allocates its symmetric staging at its first call (a collective,
    which cannot happen inside a CUDA-graph capture: call once before capturing). Calls need no
    host synchronisation (except `dispatch(..., sync=True)`), run back to back, and can be
    captured in CUDA graphs.

    Memory per rank, per slot (two slots): normal mode world_size x max_tokens_per_rank rows of
    `hidden` for each way; low-latency mode num_experts x max_tokens_per_rank rows for the
    dispatch and max_tokens_per_rank x topk rows for the combine.

    Args:
        num_experts: experts in all; a multiple of the world size (num_experts // world_size per
            rank: rank r holds experts r * E_local ... (r + 1) * E_local - 1).
        hidden: elements of a token (even; a multiple of 128 for fp8 dispatch).
        max_tokens_per_rank: the most tokens any rank passes to one call.
        dtype: of tokens and expert outputs: bf16 or fp16.

    Raises:
        ValueError: sizes that are not positive ints, experts that do not split evenly across
            ranks, an odd `hidden`, another dtype.
    """

    def __init__(self, num_experts: int, hidden: int, max_tokens_per_rank: int, dtype: torch.dtype = torch.bfloat16):
        self.world = w = tridist.world()
        for name, value in (("num_experts", num_experts), ("hidden", hidden),
                            ("max_tokens_per_rank", max_tokens_per_rank)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EPBuffer: {name} must be a positive int, got {value!r}")
        if num_experts % w.world_size:
            raise ValueError(f"EPBuffer: {num_experts} experts do not split evenly across {w.world_size} ranks")
        if hidden % 2:
            raise ValueError(f"EPBuffer: hidden must be even (rows move as 4-byte words), got {hidden}")
        if dtype not in DTYPES:
            raise ValueError(f"EPBuffer takes {', '.join(str(d) for d in DTYPES)}; got {dtype}")
        self.num_experts, self.hidden, self.max_tokens, self.dtype = num_experts, hidden, max_tokens_per_rank, dtype
        self.experts_local = num_experts // w.world_size
        self.w_pad = exchange.matrix_pad(w.world_size)
        self.e_pad = exchange.matrix_pad(self.experts_local)
        self.splits = max(1, _protocol.programs_for(w.device) // w.world_size)
        self._exchanges: dict = {}
        self._hook_pending = False
        self._pair_ids = None

    # ---- checks ----
    def _check_routing(self, topk_idx: torch.Tensor) -> tuple[int, int]:
        check_tensor(topk_idx, "topk_idx")
        if topk_idx.dtype != torch.int64 or topk_idx.dim() != 2:
            raise ValueError(f"topk_idx must be int64 of shape [tokens, topk]; got {topk_idx.dtype} of shape "
                             f"{tuple(topk_idx.shape)}")
        tokens, topk = topk_idx.shape
        if tokens > self.max_tokens:
            raise ValueError(f"{tokens} tokens, more than max_tokens_per_rank={self.max_tokens} this EPBuffer was "
                             "built for")
        if topk < 1 or topk > self.num_experts:
            raise ValueError(f"topk_idx has {topk} experts per token; this layer has {self.num_experts}")
        # Reading the ids costs a synchronisation on GPUs, which a CUDA-graph capture cannot take.
        if topk_idx.device.type == "cpu" or (config.debug() and not _protocol.capturing()):
            if tokens and (int(topk_idx.min()) < -1 or int(topk_idx.max()) >= self.num_experts):
                raise ValueError(f"topk_idx holds expert ids from {int(topk_idx.min())} to {int(topk_idx.max())}; "
                                 f"ids are -1 (none) or 0 to {self.num_experts - 1}")
        return tokens, topk

    def _agree(self, call: str, topk: int) -> None:
        """Every rank makes the same call with the same topk (emulator, TRIDIST_DEBUG=1): `call`'s
        index in CALLS and topk."""
        _protocol.agree(f"EPBuffer.{call}", "(call, topk)", (CALLS.index(call), topk))

    def _check_tokens(self, x: torch.Tensor, tokens: int, name: str = "x") -> None:
        check_tensor(x, name)
        if x.dtype != self.dtype or tuple(x.shape) != (tokens, self.hidden):
            raise ValueError(f"{name} must be {self.dtype} of shape ({tokens}, {self.hidden}); got {x.dtype} of "
                             f"shape {tuple(x.shape)}")

    def _check_weights(self, topk_weights: torch.Tensor, shape: tuple) -> None:
        check_tensor(topk_weights, "topk_weights")
        if topk_weights.dtype != torch.float32 or tuple(topk_weights.shape) != shape:
            raise ValueError(f"topk_weights must be float32 of shape {shape}; got {topk_weights.dtype} of shape "
                             f"{tuple(topk_weights.shape)}")

    def _exchange(self, kind: str, topk: int) -> _Exchange:
        """The buffers of `kind` for `topk` experts a token, allocated at their first use."""
        key = (kind, topk)
        if key not in self._exchanges:
            w, rows = self.world, self.max_tokens
            if kind == "dispatch":
                made = _Exchange(w.world_size * rows, self.hidden // 2, torch.int32, 2 * topk + 1,
                                 self.w_pad * 2 * self.e_pad, self.splits)
            elif kind == "combine":
                made = _Exchange(w.world_size * rows, self.hidden, self.dtype, 0, 0, self.splits)
            elif kind == "ll_dispatch":
                made = _Exchange(self.num_experts * rows, self._ll_words(False), torch.int32, 1,
                                 self.w_pad * self.e_pad, self.splits)
            elif kind == "ll_dispatch_fp8":
                made = _Exchange(self.num_experts * rows, self._ll_words(True), torch.int32, 1,
                                 self.w_pad * self.e_pad, self.splits)
            else:  # "ll_combine"
                made = _Exchange(rows * topk, self.hidden, self.dtype, 0, 0, self.splits)
            self._exchanges[key] = made
        return self._exchanges[key]

    def _ll_words(self, fp8: bool) -> int:
        """4-byte words of a low-latency row: the token (bf16/fp16), or fp8 values and a scale per
        FP8_GROUP columns."""
        if fp8:
            return (self.hidden + 4 * (self.hidden // FP8_GROUP)) // 4
        return self.hidden // 2

    # ---- layout ----
    def _route(self, topk_idx: torch.Tensor, per_rank: bool = True):
        """Where this rank's tokens go, on the device: (positions [T, world]: each token's row among
        those sent to each rank, -1 where not sent; routed: tokens per rank, then pairs per expert;
        pair positions [T * topk]: each pair's row among this rank's pairs of its expert). With
        `per_rank` (the normal mode, which sends tokens) the pair positions are left unset; without
        (the low-latency mode, which sends pairs) the token positions and counts are."""
        w = self.world
        tokens = topk_idx.shape[0]
        positions = torch.empty((tokens, w.world_size), dtype=torch.int32, device=w.device)
        # `count` adds to the pairs per expert; `sort` sets them (the low-latency mode)
        routed = (torch.zeros if per_rank or not tokens else torch.empty)(w.world_size + self.num_experts,
                                                                         dtype=torch.int32, device=w.device)
        pair_positions = torch.empty(topk_idx.numel(), dtype=torch.int32, device=w.device)
        if tokens and per_rank:
            sort.sort(topk_idx, positions, routed, w.world_size, self.experts_local, one_group=False)
            sort.count(topk_idx.view(-1), routed[w.world_size:], self.num_experts, 1)
        elif tokens:
            sort.sort(topk_idx.view(-1), pair_positions, routed[w.world_size:], self.num_experts, 1, one_group=True)
        return positions, routed, pair_positions

    def get_dispatch_layout(self, topk_idx: torch.Tensor):
        """How this rank's tokens spread, computed on the device (no host synchronisation).

        Args:
            topk_idx: int64 [T, topk], expert ids (-1: none).

        Returns:
            (tokens_per_rank int64 [world_size]: tokens with at least one expert on each rank;
            tokens_per_expert int64 [num_experts]; is_token_in_rank bool [T, world_size]).
        """
        self._check_routing(topk_idx)
        positions, routed, _ = self._route(topk_idx)
        w = self.world
        return routed[:w.world_size].long(), routed[w.world_size:].long(), positions >= 0

    # ---- normal mode ----
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, sync: bool = False):
        """Send each token once to every rank holding one of its experts.

        Args:
            x: [T, hidden] tokens (T <= max_tokens_per_rank), the buffer's dtype.
            topk_idx: int64 [T, topk] expert ids (-1: none).
            topk_weights: float32 [T, topk].
            sync: read the received count on the host and return tensors trimmed to it (a host
                synchronisation, as DeepEP's default does); else room for world_size *
                max_tokens_per_rank tokens, the rows past those received unspecified
                (recv_topk_idx -1 there).

        Returns:
            (recv_x [R, hidden]: the received tokens, from rank 0 first, each rank's in token
            order; recv_topk_idx int64 [R, topk]: their experts as indices among this rank's
            (-1: an expert of another rank); recv_topk_weights float32 [R, topk];
            recv_tokens_per_expert int64 [E_local]: received (token, local expert) pairs per
            expert; handle: for `combine`).
        """
        tokens, topk = self._check_routing(topk_idx)
        self._check_tokens(x, tokens)
        self._check_weights(topk_weights, (tokens, topk))
        self._no_hook_pending()
        self._agree("dispatch", topk)
        w = self.world
        exchange_ = self._exchange("dispatch", topk)
        positions, routed, _ = self._route(topk_idx)
        capacity = w.world_size * self.max_tokens
        token_index = torch.arange(tokens, dtype=torch.int32, device=w.device)[:, None]
        meta = torch.cat([topk_idx.to(torch.int32), topk_weights.view(torch.int32), token_index], 1)
        recv_x = torch.empty((capacity, self.hidden), dtype=self.dtype, device=w.device)
        recv_idx = torch.full((capacity, topk), -1, dtype=torch.int64, device=w.device)
        recv_weights = torch.zeros((capacity, topk), dtype=torch.float32, device=w.device)
        recv_src = torch.empty(capacity, dtype=torch.int32, device=w.device)
        recv_layout = torch.empty((2, w.world_size), dtype=torch.int32, device=w.device)
        recv_per_expert = torch.empty(self.experts_local, dtype=torch.int64, device=w.device)
        ex = exchange_
        args = (_nonempty(_words(x)), _nonempty(meta), _nonempty(positions), routed, ex.staging, ex.meta, ex.counts,
                ex.arrivals, ex.calls, _words(recv_x), recv_idx, recv_weights, recv_src, recv_layout, recv_per_expert,
                tokens, self.hidden // 2, self.max_tokens, self.experts_local, topk, ex.slot_numel, ex.meta.shape[1],
                w.local_world_size)
        exchange_.launch(dispatch_kernel, w.world_size, args,
                         {"W_PAD": self.w_pad, "E_PAD": self.e_pad, "K_PAD": triton.next_power_of_2(2 * topk + 1),
                          "BLOCK_R": BLOCK_R, "BLOCK_W": _block_w(self.hidden // 2), "num_warps": 8})
        handle = EPHandle("normal", tokens, topk, recv_src, recv_layout, positions)
        if sync:
            received = int(recv_layout[0].sum())
            return recv_x[:received], recv_idx[:received], recv_weights[:received], recv_per_expert, handle
        return recv_x, recv_idx, recv_weights, recv_per_expert, handle

    def combine(self, y: torch.Tensor, handle: EPHandle) -> torch.Tensor:
        """Send each received token's output back to its rank; every rank sums, per token, what each
        rank that got the token sent (in rank order, fp32).

        Args:
            y: [R, hidden] (R as recv_x, or the trimmed count with `sync=True`): for every received
                token, the sum of its local experts' outputs, already weighted.
            handle: the dispatch's.

        Returns:
            out [T, hidden], in this rank's token order (zeros for a token with no expert).
        """
        self._check_handle(handle, "normal")
        check_tensor(y, "y")
        w = self.world
        capacity = w.world_size * self.max_tokens
        if y.dtype != self.dtype or y.dim() != 2 or y.shape[1] != self.hidden or y.shape[0] > capacity:
            raise ValueError(f"y must be {self.dtype} of shape (received tokens, {self.hidden}); got {y.dtype} of "
                             f"shape {tuple(y.shape)}")
        self._no_hook_pending()
        self._agree("combine", handle.topk)
        exchange_ = self._exchange("combine", 1)
        out = torch.empty((max(handle.tokens, 1), self.hidden), dtype=self.dtype, device=w.device)
        ex = exchange_
        args = (y, handle.recv_src, handle.recv_layout, _nonempty(handle.positions), ex.staging, ex.arrivals, ex.calls,
                out,
                handle.tokens, self.hidden, self.max_tokens, ex.slot_numel, w.local_world_size)
        exchange_.launch(combine_kernel, w.world_size, args, {"WORLD": w.world_size, **self._combine_blocks()})
        return out[:handle.tokens]

    # ---- low-latency mode ----
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, return_recv_hook: bool = False,
                             use_fp8: bool = False):
        """Send one copy of each token to each of its experts, grouped by expert.

        Args:
            x: [T, hidden] tokens (T <= max_tokens_per_rank), the buffer's dtype.
            topk_idx: int64 [T, topk] expert ids (-1: none), each token's experts distinct.
            return_recv_hook: only send, and return at once; `hook()` receives (run compute in
                between). Call the hook before this buffer's next call.
            use_fp8: cast to fp8 e4m3 on the way, with a float32 scale per 128 columns of each token.

        Returns:
            (recv_x [E_local, world_size * max_tokens_per_rank, hidden]: for local expert e, its
            pairs from rank 0 first, each rank's in token order, packed; with use_fp8 the pair
            (recv_x in float8_e4m3fn, scales float32 [E_local, world_size * max_tokens_per_rank,
            hidden // 128]), views of one buffer; recv_count int32 [E_local]: pairs received per
            expert; handle: for `low_latency_combine`; hook: receives, or does nothing).

        Raises:
            ValueError: bad shapes or dtypes, an `hidden` not a multiple of 128 with use_fp8, or a
                hook still pending.
        """
        tokens, topk = self._check_routing(topk_idx)
        self._check_tokens(x, tokens)
        if use_fp8 and self.hidden % FP8_GROUP:
            raise ValueError(f"use_fp8 scales groups of {FP8_GROUP} columns: hidden must be a multiple, got "
                             f"{self.hidden}")
        self._no_hook_pending()
        self._agree("low_latency_dispatch fp8" if use_fp8 else "low_latency_dispatch", topk)
        w = self.world
        exchange_ = self._exchange("ll_dispatch_fp8" if use_fp8 else "ll_dispatch", topk)
        _, routed, positions = self._route(topk_idx, per_rank=False)
        rows = self._payload(x, use_fp8)
        width = self._ll_words(use_fp8)
        recv = torch.empty((self.experts_local, w.world_size * self.max_tokens, 4 * width), dtype=torch.uint8,
                           device=w.device)
        recv_src = torch.empty((self.experts_local, w.world_size * self.max_tokens), dtype=torch.int32,
                               device=w.device)
        recv_count = torch.empty(self.experts_local, dtype=torch.int32, device=w.device)
        recv_layout = torch.empty((2, self.w_pad, self.e_pad), dtype=torch.int32, device=w.device)
        ex = exchange_
        args = (_nonempty(rows), _nonempty(topk_idx), _nonempty(positions), routed[w.world_size:],
                self._pair_index(topk), ex.staging, ex.meta,
                ex.counts, ex.arrivals, ex.calls, recv.view(torch.int32), recv_src, recv_count, recv_layout,
                tokens, width, self.max_tokens, self.experts_local, topk, ex.slot_numel, ex.meta.shape[1],
                w.local_world_size)
        meta = {"W_PAD": self.w_pad, "E_PAD": self.e_pad, "BLOCK_R": BLOCK_R, "BLOCK_W": _block_w(width),
                "num_warps": 8}
        exchange_.fit(ll_dispatch_kernel, w.world_size, args, {**meta, "SEND": True, "RECEIVE": True})
        if return_recv_hook:
            exchange_.launch(ll_dispatch_kernel, w.world_size, args, {**meta, "SEND": True, "RECEIVE": False},
                             coresident=False)
            self._hook_pending = True

            def hook() -> None:
                if not self._hook_pending:
                    raise ValueError("this hook has run already")
                self._hook_pending = False
                exchange_.launch(ll_dispatch_kernel, w.world_size, args, {**meta, "SEND": False, "RECEIVE": True},
                                 coresident=False)
        else:
            exchange_.launch(ll_dispatch_kernel, w.world_size, args, {**meta, "SEND": True, "RECEIVE": True})

            def hook() -> None:
                pass
        handle = EPHandle("low_latency", tokens, topk, recv_src, recv_layout, positions)
        recv_x = recv[..., :self.hidden].view(FP8) if use_fp8 else recv.view(self.dtype)
        if use_fp8:
            recv_x = (recv_x, recv[..., self.hidden:].view(torch.float32))
        return recv_x, recv_count, handle, hook

    def low_latency_combine(self, y: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: EPHandle) -> torch.Tensor:
        """Send each pair's output back to its token's rank, which sums topk_weights[t, k] x the
        output of expert k of token t, in k order (fp32).

        Args:
            y: [E_local, world_size * max_tokens_per_rank, hidden], recv_x's layout, the buffer's
                dtype: each received pair's expert output.
            topk_idx: the dispatch's routing, int64 [T, topk].
            topk_weights: float32 [T, topk].
            handle: the dispatch's.

        Returns:
            out [T, hidden].
        """
        self._check_handle(handle, "low_latency")
        tokens, topk = self._check_routing(topk_idx)
        if (tokens, topk) != (handle.tokens, handle.topk):
            raise ValueError(f"topk_idx has shape {(tokens, topk)}; the handle's dispatch had "
                             f"{(handle.tokens, handle.topk)}")
        self._check_weights(topk_weights, (tokens, topk))
        w = self.world
        check_tensor(y, "y")
        shape = (self.experts_local, w.world_size * self.max_tokens, self.hidden)
        if y.dtype != self.dtype or tuple(y.shape) != shape:
            raise ValueError(f"y must be {self.dtype} of shape {shape} (recv_x's); got {y.dtype} of shape "
                             f"{tuple(y.shape)}")
        self._no_hook_pending()
        self._agree("low_latency_combine", topk)
        exchange_ = self._exchange("ll_combine", topk)
        out = torch.empty((max(tokens, 1), self.hidden), dtype=self.dtype, device=w.device)
        ex = exchange_
        args = (y, handle.recv_src, handle.recv_layout, _nonempty(topk_idx), _nonempty(topk_weights),
                _nonempty(handle.positions), ex.staging, ex.arrivals, ex.calls, out, tokens, self.hidden,
                self.max_tokens, self.experts_local, ex.slot_numel, w.local_world_size)
        exchange_.launch(ll_combine_kernel, w.world_size, args,
                         {"TOPK": topk, "W_PAD": self.w_pad, "E_PAD": self.e_pad, **self._combine_blocks()})
        return out[:tokens]

    # ---- helpers ----
    def _combine_blocks(self) -> dict:
        """The combines' tiles: (BLOCK_R, BLOCK_W) of TILE elements, as few rows as a program may sum
        (the tokens of max_tokens_per_rank over the world x splits programs: one row each at 128
        tokens on an H100), and 8 warps for the parts' loads in flight at once. Fixed per buffer:
        every call launches the variant whose co-resident grid `_Exchange.fit` measured."""
        rows = min(BLOCK_R, triton.next_power_of_2(triton.cdiv(self.max_tokens, self.world.world_size * self.splits)))
        return {"BLOCK_R": rows, "BLOCK_W": _block_w(self.hidden, rows), "num_warps": 8}

    def _payload(self, x: torch.Tensor, use_fp8: bool) -> torch.Tensor:
        """The rows the low-latency dispatch moves, as int32 words: x itself, or with use_fp8 each
        token's e4m3 values followed by its float32 scales (one per FP8_GROUP columns)."""
        if not use_fp8:
            return _words(x)
        if not x.shape[0]:
            return torch.empty((0, self._ll_words(True)), dtype=torch.int32, device=x.device)
        groups = x.float().view(x.shape[0], self.hidden // FP8_GROUP, FP8_GROUP)
        scales = groups.abs().amax(-1).clamp(min=1e-12) / FP8_MAX
        values = (groups / scales[..., None]).to(FP8).view(torch.uint8).view(x.shape[0], self.hidden)
        return torch.cat([values, scales.view(torch.uint8)], 1).view(torch.int32)

    def _pair_index(self, topk: int) -> torch.Tensor:
        """0, 1, 2, ...: the meta word each pair sends (its index), as rows of one int32."""
        needed = self.max_tokens * topk
        if self._pair_ids is None or self._pair_ids.numel() < needed:
            self._pair_ids = torch.arange(needed, dtype=torch.int32, device=self.world.device)
        return self._pair_ids

    def _check_handle(self, handle, mode: str) -> None:
        if not isinstance(handle, EPHandle) or handle.mode != mode:
            call = "dispatch" if mode == "normal" else "low_latency_dispatch"
            raise ValueError(f"handle must be the EPHandle of a {call} of this buffer, got {type(handle).__name__}"
                             + (f" of mode {handle.mode!r}" if isinstance(handle, EPHandle) else ""))

    def _no_hook_pending(self) -> None:
        if self._hook_pending:
            raise ValueError("a low_latency_dispatch's receive hook has not run: call it before this buffer's next "
                             "call")

    def free(self) -> None:
        """Give the symmetric buffers back (collective: every rank frees its buffer)."""
        for made in self._exchanges.values():  # allocated in call order, the same on every rank
            made.free()
        self._exchanges.clear()

