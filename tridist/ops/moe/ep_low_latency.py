"""Expert parallelism, low-latency mode (decode): the kernels of `EPBuffer.low_latency_dispatch`
and `EPBuffer.low_latency_combine` (`expert_parallel.py` is the host side). One copy per (token,
expert) pair, grouped by expert: recv_x[e] holds local expert e's pairs, from rank 0 first.

Routing (`sort`, before the dispatch) gives each pair its place among this rank's pairs of its
expert; `ll_dispatch_kernel` puts pair (t, k) into the region of (expert, rank) of the expert's
rank with the pair's index as meta, and the receiver packs each expert's regions in rank order. A
rank's own pairs skip the staging (copied from x once the counts of the ranks before it are in),
except with a receive hook: the send and the receive are then two launches
(`return_recv_hook=True`, so compute overlaps the transfer), and x may change between them.

`ll_combine_kernel` sends each pair's output to row t * topk + k of its source's staging, and each
token sums topk_weights[t, k] x its pairs, in k order (`exchange.sum_parts`; the pairs of its own
experts read where the dispatch put them, in y).
"""
import triton
import triton.language as tl

import tridist.language as dl
from tridist.runtime.jit import jit

from ..protocol import call_epoch, finish_call
from .exchange import (arrive, await_combine, await_dispatch, await_own_counts, block_rows, copy_rows,
                       exchange_program, expert_blocks, gather, send_rows, send_values, split_rows, sum_parts)


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
    epoch, me, world, peer, split, stage = exchange_program(calls_ptr, staging_ptr, slot_numel)
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
