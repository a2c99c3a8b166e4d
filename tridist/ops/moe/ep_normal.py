"""Expert parallelism, normal mode (prefill, training): the kernels of `EPBuffer.dispatch` and
`EPBuffer.combine` (`expert_parallel.py` is the host side). A token goes once to every rank that
holds one of its experts.

Routing (`sort`, before the dispatch) gives each token its place among the tokens for each rank.
`dispatch_kernel` then runs the family's protocol (`exchange.py`): program (p, s) puts its share s
of the tokens for rank p into region `rank` of p's staging (rows of x, and a meta row: the token's
expert ids, weights and index), writes the count and the pairs per expert of p there, and adds 1
to p's arrival counter for this rank (`exchange.arrive`); then, as a receiver, it waits until every
source's counts are here and all of rank p's programs have arrived, and copies p's tokens into
recv_x after those of ranks before p. A rank's own tokens skip the staging: program (rank, s)
copies them from x once the counts of the ranks before it are in.

`combine_kernel` runs the way back: each received token's output goes to row (rank, token) of its
source's combine staging, and each token sums what every rank that got it sent, in rank order
(`exchange.sum_parts`; its own experts' outputs read where they are, in y). The sums overlap the
sends. A rank's token indices are cut in `splits` parts; program (p, s) sends the outputs of p's
tokens of part s, in token order, and after every CHUNK steps sets its progress word (rank, s) on
p to epoch x PROGRESS_EPOCH + the next token index (at the end, + the part's end). The sums go
by blocks of tokens, which every program claims from a counter of this rank, in the order the
rows arrive (block c in part c % splits): this rank's own programs, which send nothing, start at
once, the others once they have sent. A block waits for its part's progress word of every peer.
On a 2 x H100, deepseek's 4096 tokens: 212 us where summing after all the sends took 236 (4 ranks:
504 against 575).
"""
import triton
import triton.language as tl

import tridist.language as dl
from tridist.runtime.jit import jit

from .._protocol import finish_call
from .exchange import (arrive, await_dispatch, await_own_counts, copy_rows, exchange_program, raise_flag, send_rows,
                       send_values, split_rows, sum_parts)

# A progress word holds epoch x PROGRESS_EPOCH + a token index: it only grows, from call to call
# too, so a receiver waits for at least a value, never for equality (max_tokens_per_rank is below).
PROGRESS_EPOCH = tl.constexpr(1 << 24)


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
    epoch, me, world, peer, split, stage = exchange_program(calls_ptr, staging_ptr, slot_numel)
    meta_width = 2 * topk + 1
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
def _rows_below(src_ptr, count, first, stop, BLOCK: tl.constexpr):
    """Of the `count` ascending values at src_ptr, how many are below `first`, and how many below
    `stop` (>= first)."""
    below_first = 0
    below_stop = 0
    for at in range(0, count, BLOCK):
        i = at + tl.arange(0, BLOCK)
        value = tl.load(src_ptr + i, mask=i < count, other=stop)
        below_first += tl.sum((value < first).to(tl.int32), 0)
        below_stop += tl.sum((value < stop).to(tl.int32), 0)
    return below_first, below_stop


@jit
def combine_kernel(y_ptr, recv_src_ptr, recv_layout_ptr, positions_ptr, staging_ptr, progress_ptr, claims_ptr,
                   calls_ptr, out_ptr, tokens, hidden, max_tokens, slot_numel, local_world_size, splits,
                   WORLD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, CHUNK: tl.constexpr):
    """Normal mode, the way back. Grid (world, splits). y: the received tokens' outputs (rows of
    `hidden`); per slot, staging is [world, max_tokens] rows: row (q, t) holds rank q's output for
    this rank's token t; progress: a word per (source, part); claims: this rank's two counters of
    blocks claimed (one per slot). WORLD: the world size, the parts of each sum."""
    epoch, me, world, peer, split, stage = exchange_program(calls_ptr, staging_ptr, slot_numel)
    per_part = tl.cdiv(max_tokens, splits)
    if (peer == 0) & (split == 0):
        tl.store(claims_ptr + (epoch + 1) % 2, 0)  # the next call's: every program of the last one has ended
    if peer != me:  # this rank's own outputs are read from y in the sum below
        first = split * per_part
        stop = tl.minimum(first + per_part, max_tokens)
        start = tl.load(recv_layout_ptr + world + peer)
        rows_from = recv_src_ptr + start
        lo, hi = _rows_below(rows_from, tl.load(recv_layout_ptr + peer), peer * max_tokens + first,
                             peer * max_tokens + stop, 1024)
        progress = progress_ptr + me * splits + split
        for chunk in range(lo, hi, CHUNK * BLOCK_R):
            chunk_end = tl.minimum(chunk + CHUNK * BLOCK_R, hi)
            for at in range(chunk, chunk_end, BLOCK_R):
                rows = at + tl.arange(0, BLOCK_R)
                inside = rows < chunk_end
                token = tl.load(rows_from + rows, mask=inside, other=0) - peer * max_tokens
                send_rows(y_ptr, start + rows, stage + me * max_tokens * hidden, token, inside, hidden, peer,
                          local_world_size, BLOCK_R, BLOCK_W)
            last = tl.load(rows_from + chunk_end - 1) - peer * max_tokens
            raise_flag(progress, epoch * PROGRESS_EPOCH + last + 1, peer, local_world_size)
        raise_flag(progress, epoch * PROGRESS_EPOCH + stop, peer, local_world_size)
        # Every call hears from every peer (what makes two staging slots enough, `_protocol.py`).
        dl.shmem.signal_wait_until(progress_ptr + peer * splits + split, dl.shmem.CMP_GE,
                                   epoch * PROGRESS_EPOCH + stop)

    # The sums, a block of BLOCK_R tokens at a time, claimed from this rank's counter by whichever
    # program is free: this rank's own row at once, the others once they have sent. Block c lies in
    # part c % splits, whose rows the peers' programs of that part send in token order, so that
    # the blocks claimed first are those that arrive first.
    blocks = splits * tl.cdiv(per_part, BLOCK_R)
    claim = dl.atomic_add(claims_ptr + epoch % 2, 1, scope="gpu", semantic="relaxed")
    while claim < blocks:
        part = claim % splits
        first = part * per_part + (claim // splits) * BLOCK_R
        stop = tl.minimum(tl.minimum(first + BLOCK_R, (part + 1) * per_part), tokens)
        if first < stop:
            here = stage
            for source in range(world):
                target = tl.where(source == me, 0, epoch * PROGRESS_EPOCH + stop)
                here = dl.consume_token(here, dl.shmem.signal_wait_until(progress_ptr + source * splits + part,
                                                                         dl.shmem.CMP_GE, target))
            sum_parts(here, out_ptr, first, stop, hidden, positions_ptr, positions_ptr, y_ptr,
                      recv_layout_ptr + world + me, positions_ptr, max_tokens, 1, WORLD, False, BLOCK_R, BLOCK_W)
        claim = dl.atomic_add(claims_ptr + epoch % 2, 1, scope="gpu", semantic="relaxed")
    finish_call(calls_ptr)
