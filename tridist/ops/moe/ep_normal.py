"""Expert parallelism, normal mode (prefill, training): the kernels of `EPBuffer.dispatch` and
`EPBuffer.combine` (`expert_parallel.py` is the host side). A token goes once to every rank that
holds one of its experts.

Both kernels run over a grid (lanes, splits) with lanes = world - 1 (1 at one rank): lane l serves
the l-th rank after this one, its peer, so every program pushes rows across the links (at 2 ranks a
grid row per rank, this rank's own included, left half the programs with nothing to send while the
other half pushed: 241 GB/s per GPU on 2 x H200). This rank's own tokens never leave it; every
program copies a share of them besides its sends.

Routing (`sort`, before the dispatch) gives each token its place among the tokens for each rank.
`dispatch_kernel` then runs the family's protocol (`exchange.py`) in three steps:
1. Counts. Program (l, s) writes what its peer p needs to place this rank's tokens (the tokens
   and the pairs per expert of p) into row `rank` of p's counts, and adds 1 to p's arrival
   counter for this rank (`exchange.arrive`). It then waits for the counts of the ranks before it:
   its own tokens go after theirs in recv_x.
2. Rows. It puts its share s of the tokens for p into region `rank` of p's staging (rows of x,
   and a meta row: the token's expert ids, weights and index), each at its place among them,
   copies its share of this rank's own tokens from x into recv_x, and adds 1 to p's counter again.
3. Receive. It waits until every source's counts are here and both arrivals of all of p's
   programs (2 x splits a call), and copies part s of p's tokens from the staging into recv_x
   after those of the ranks before p.

`combine_kernel` runs the way back: program (l, s) sends part s of the outputs of the tokens it
got from its peer to row (rank, token) of the peer's combine staging and arrives; then every
program sums its share of this rank's tokens over what every rank that got them sent, in rank
order (`exchange.sum_parts`; its own experts' outputs read where they are, in y).
"""
import triton
import triton.language as tl

import tridist.language as dl
from tridist.runtime.jit import jit

from .._protocol import finish_call
from .exchange import (arrive, arrivals_at_least, await_sources, copy_rows, exchange_program, send_rows, send_values,
                       split_rows, sum_parts)


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


@triton.jit
def _peer_of(lane):
    """The rank that grid row `lane` serves: the lane-th rank after this one (this rank at one rank)."""
    return (dl.rank() + 1 + lane) % dl.num_ranks()


@jit
def dispatch_kernel(x_ptr, meta_ptr, positions_ptr, routed_ptr, staging_ptr, meta_staging_ptr, counts_ptr,
                    arrivals_ptr, calls_ptr, recv_x_ptr, recv_idx_ptr, recv_weights_ptr, recv_src_ptr, recv_layout_ptr,
                    recv_per_expert_ptr, tokens, width, max_tokens, experts_local, topk, slot_numel, meta_slot,
                    local_world_size, splits, W_PAD: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    """Normal mode. Grid (lanes, splits). x: T rows of `width` words; meta: T rows of 2 * topk + 1
    int32 (expert ids, weight bits, token index); positions: [T, world] from routing (-1: not for
    that rank); routed: tokens per rank [world], then pairs per expert [world * E_local]. Per slot,
    staging is [world, max_tokens] rows and counts a row of 2 * E_PAD int32 per source: word 0 the
    tokens it sent here, word E_PAD + e its pairs for local expert e (this rank's own row unused:
    its counts are read from routed)."""
    epoch, me, world, lane, split, stage = exchange_program(calls_ptr, staging_ptr, slot_numel)
    peer = _peer_of(lane)
    meta_width = 2 * topk + 1
    meta_stage = meta_staging_ptr + (epoch % 2) * meta_slot
    counts = counts_ptr + (epoch % 2) * W_PAD * 2 * E_PAD
    counted = (epoch - 1) * 2 * splits + 1  # a source's counts of this call are here
    sources = tl.arange(0, W_PAD)
    experts = tl.arange(0, E_PAD)
    local = experts < experts_local

    if peer != me:
        words = tl.arange(0, 2 * E_PAD)
        pair_words = (words >= E_PAD) & (words - E_PAD < experts_local)
        routed = tl.load(routed_ptr + tl.where(words == 0, peer, world + peer * experts_local + words - E_PAD),
                         mask=(words == 0) | pair_words, other=0)
        send_values(counts, me * 2 * E_PAD + words, routed, (words == 0) | pair_words, peer, local_world_size,
                    2 * E_PAD)
        arrive(arrivals_ptr + me, peer, local_world_size)
    counts = await_sources(arrivals_ptr, counts, me, counted, -1)
    own_start = tl.sum(tl.load(counts + sources * 2 * E_PAD, mask=sources < me, other=0), 0)

    # The lanes split this rank's own tokens block by block, so that every program interleaves local
    # copies with its pushes and the two traffics overlap.
    first, stop = split_rows(tokens, split, splits)
    for token in range(first, stop, BLOCK_R):
        rows = token + tl.arange(0, BLOCK_R)
        inside = rows < stop
        if peer != me:
            place = tl.load(positions_ptr + rows.to(tl.int64) * world + peer, mask=inside, other=-1)
            going = place >= 0
            send_rows(x_ptr, rows, stage + me * max_tokens * width, place, going, width, peer, local_world_size,
                      BLOCK_R, BLOCK_W)
            send_rows(meta_ptr, rows, meta_stage + me * max_tokens * meta_width, place, going, meta_width, peer,
                      local_world_size, BLOCK_R, K_PAD)
        if ((token - first) // BLOCK_R) % tl.num_programs(0) == lane:
            place = tl.load(positions_ptr + rows.to(tl.int64) * world + me, mask=inside, other=-1)
            _receive_tokens(x_ptr, meta_ptr, rows, own_start + place, place >= 0, me, recv_x_ptr, recv_idx_ptr,
                            recv_weights_ptr, recv_src_ptr, width, max_tokens, experts_local, topk, K_PAD, BLOCK_W)

    if peer != me:
        arrive(arrivals_ptr + me, peer, local_world_size)
        counts = await_sources(arrivals_ptr, counts, world, counted, me)
        arrived = arrivals_at_least(arrivals_ptr, peer, epoch * 2 * splits)
        stage = dl.consume_token(stage, arrived)
        meta_stage = dl.consume_token(meta_stage, arrived)
    others = (sources < world) & (sources != me)
    received = tl.where(sources == me, tl.load(routed_ptr + me),
                        tl.load(counts + sources * 2 * E_PAD, mask=others, other=0))
    before = tl.cumsum(received, 0) - received
    if peer != me:
        start = tl.sum(tl.where(sources == peer, before, 0), 0)
        first, stop = split_rows(tl.sum(tl.where(sources == peer, received, 0), 0), split, splits)
        for at in range(first, stop, BLOCK_R):
            rows = at + tl.arange(0, BLOCK_R)
            _receive_tokens(stage + peer * max_tokens * width, meta_stage + peer * max_tokens * meta_width, rows,
                            start + rows, rows < stop, peer, recv_x_ptr, recv_idx_ptr, recv_weights_ptr,
                            recv_src_ptr, width, max_tokens, experts_local, topk, K_PAD, BLOCK_W)
    if (lane == 0) & (split == 0):  # the layout, from every source's counts (waited for above)
        pairs = tl.load(counts + sources[:, None] * 2 * E_PAD + E_PAD + experts[None, :],
                        mask=others[:, None] & local[None, :], other=0)
        own = tl.load(routed_ptr + world + me * experts_local + experts, mask=local, other=0)
        tl.store(recv_per_expert_ptr + experts, (tl.sum(pairs, 0) + own).to(tl.int64), mask=local)
        tl.store(recv_layout_ptr + sources, received, mask=sources < world)
        tl.store(recv_layout_ptr + world + sources, before, mask=sources < world)
    dl.shmem.quiet()
    finish_call(calls_ptr)


@jit
def combine_kernel(y_ptr, recv_src_ptr, recv_layout_ptr, positions_ptr, staging_ptr, arrivals_ptr, calls_ptr, out_ptr,
                   tokens, hidden, max_tokens, slot_numel, local_world_size, splits, WORLD: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    """Normal mode, the way back. Grid (lanes, splits). y: the received tokens' outputs (rows of
    `hidden`); per slot, staging is [world, max_tokens] rows: row (q, t) holds rank q's output for
    this rank's token t. Program (l, s) sends part s of the tokens received from its peer, then sums
    part l * splits + s of this rank's tokens. WORLD: the world size, the parts of each sum."""
    epoch, me, world, lane, split, stage = exchange_program(calls_ptr, staging_ptr, slot_numel)
    peer = _peer_of(lane)
    if peer != me:  # this rank's own outputs are read from y in the sum below
        count = tl.load(recv_layout_ptr + peer)
        start = tl.load(recv_layout_ptr + world + peer)
        first, stop = split_rows(count, split, splits)
        for at in range(first, stop, BLOCK_R):
            rows = start + at + tl.arange(0, BLOCK_R)
            inside = at + tl.arange(0, BLOCK_R) < stop
            token = tl.load(recv_src_ptr + rows, mask=inside, other=0) - peer * max_tokens
            send_rows(y_ptr, rows, stage + me * max_tokens * hidden, token, inside, hidden, peer, local_world_size,
                      BLOCK_R, BLOCK_W)
        arrive(arrivals_ptr + me, peer, local_world_size)

    stage = await_sources(arrivals_ptr, stage, world, epoch * splits, me)
    first, stop = split_rows(tokens, lane * splits + split, tl.num_programs(0) * splits)
    sum_parts(stage, out_ptr, first, stop, hidden, positions_ptr, positions_ptr, y_ptr, recv_layout_ptr + world + me,
              positions_ptr, max_tokens, 1, WORLD, False, BLOCK_R, BLOCK_W)
    finish_call(calls_ptr)
