"""Expert parallelism, normal mode (prefill, training): `EPBuffer.dispatch` and `EPBuffer.combine`,
their kernels, staging and launches. A token goes once to every rank that holds one of its experts.

Both kernels overlap the local pass over what arrives (the dispatch's copy out of the staging, the
combine's sums) with the sends: the senders set a progress word per part as rows land, and the
work on arrived rows goes in blocks that every program claims from a counter of this rank
(`claim`) in the order the rows arrive. This rank's own programs, which send nothing, start on
them at once, the others when they have sent (what this gains: benchmarks/NOTES.md, "Moved from
the code's docstrings (issue 41)", "tridist/ops/moe/expert_parallel/normal.py").

Routing (`_routing.tokens_to_ranks`, before the dispatch) gives each token its place among the
tokens for each rank, and each rank's tokens in place order. `dispatch_kernel` then runs the
family's protocol (`moe/_exchange.py`):
1. Counts. Program (p, s) writes the count and the pairs per expert of p into row `rank` of p's
   counts, and adds 1 to p's arrival counter for this rank (`_exchange.arrive`).
2. Rows. For p != rank it puts part s of the places of the tokens for p (`split_rows` of their
   count) into region `rank` of p's staging, in place order (rows of x, and a meta row: the
   token's expert ids, weights and index), and after every CHUNK steps sets its progress word
   (rank, s) on p to epoch x PROGRESS_EPOCH + the places sent. Program (rank, s) instead copies
   part s of this rank's own tokens from x into recv_x, once the counts of the ranks before it
   are in.
3. Copy-out. Once every source's counts are here, every program claims blocks of places of the
   peers' parts and copies each, when its part's progress word covers it, into recv_x after the
   rows of the ranks before its source.

`combine_kernel` runs the way back: each received token's output goes to row (rank, token) of its
source's combine staging, and each token sums what every rank that got it sent, in rank order
(`_staging.sum_parts`; its own experts' outputs read where they are, in y). A rank's token indices
are cut in `splits` parts; program (p, s) sends the outputs of p's tokens of part s, in token
order (it finds them by counting recv_src), sets its progress word (rank, s) on p to epoch x
PROGRESS_EPOCH + the next token index after every CHUNK steps and to the part's end at the end,
then waits for p's word of part s here (so that every call hears from every peer, which keeps two
staging slots enough). The claimed blocks are blocks of tokens, each waiting for its part's word
of every peer.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

import tridist.language as dl
from tridist.runtime.jit import jit

from ... import checks
from ...protocol import finish_call, in_slot
from ...gemm.grouped import pick
from .._exchange import (arrive, await_counts, copy_rows, exchange_program, raise_flag, send_rows, send_values,
                         split_rows)
from ._routing import tokens_to_ranks
from ._staging import BLOCK_R, Exchange, Layer, block_w, combine_blocks, nonempty, sum_parts, token_words

# A progress word holds epoch x PROGRESS_EPOCH + a row's index (a token's, or a place's among the
# tokens sent to a rank): it only grows, from call to call too, so a receiver waits for at least a
# value, never for equality (max_tokens_per_rank is below).
PROGRESS_EPOCH = tl.constexpr(1 << 24)
CHUNK = 4         # steps of the sends between two progress words


class DispatchStaging(NamedTuple):
    """The dispatch's symmetric buffers and counters, one tuple argument of `dispatch_kernel`
    (unpacked by position there: a kernel compiled from the compile log sees a plain tuple)."""
    rows: torch.Tensor       # int32 [2, slot_numel]: per slot, [world, max_tokens] rows of x's words
    meta: torch.Tensor       # int32 [2, meta_slot]: per slot, [world, max_tokens] rows of 2 * topk + 1
    counts: torch.Tensor     # int32 [2, W_PAD * 2 * E_PAD]: per slot, a row of 2 * E_PAD per source
    arrivals: torch.Tensor   # an arrival counter per source (`_exchange.arrive`)
    progress: torch.Tensor   # a progress word per (source, part)
    claims: torch.Tensor     # int32 [2]: this rank's counters of claimed blocks, one per slot (`claim`)
    calls: torch.Tensor      # the calls counter (`protocol.call_epoch`)
    slot_numel: int
    meta_slot: int


class Received(NamedTuple):
    """What a dispatch receives (room for world x max_tokens tokens), one tuple argument of
    `dispatch_kernel` (unpacked by position there)."""
    x: torch.Tensor          # [R, hidden] (the kernel takes its words)
    idx: torch.Tensor        # int64 [R, topk]: expert ids made local, -1 for other ranks' experts
    weights: torch.Tensor    # float32 [R, topk]
    src: torch.Tensor        # int32 [R]: source_rank * max_tokens + token
    layout: torch.Tensor     # int32 [2, world]: tokens received from each rank, and their first row
    per_expert: torch.Tensor  # int64 [E_local]: received (token, local expert) pairs per expert


@triton.jit
def claim(claims_ptr, epoch):
    """The index of the next block of this call's shared work, for the calling program: blocks go to
    whichever program asks first (relaxed: each index is handed out once, which is all it takes).
    claims: this rank's two counters, one per slot (`reset_claims`)."""
    return dl.atomic_add(in_slot(claims_ptr, epoch, 1), 1, scope="gpu", semantic="relaxed")


@triton.jit
def reset_claims(claims_ptr, epoch):
    """Zero the next call's counter (one program of the launch): every program of the last call to
    use it, the one before this, has ended."""
    tl.store(in_slot(claims_ptr, epoch + 1, 1), 0)


@triton.jit
def _receive_tokens(x_ptr, meta_ptr, rows, out_rows, inside, source, recv, width, max_tokens, experts_local, topk,
                    K_PAD: tl.constexpr, BLOCK_W: tl.constexpr, group=None):
    """Normal mode's receive of `source`'s tokens: x and meta rows `rows` (in its staging region, or
    the source's own x and meta where the source is this rank) to rows `out_rows` of `recv` (a
    `Received`), with the expert ids made local (-1 for other ranks' experts), the weights and the
    token's origin (ranks of `group`, if given)."""
    recv_x_ptr, recv_idx_ptr, recv_weights_ptr, recv_src_ptr, _, _ = recv
    me = dl.rank(group)
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
def dispatch_kernel(x_ptr, meta_ptr, positions_ptr, order_ptr, routed_ptr, staging, recv, tokens, width, max_tokens,
                    experts_local, topk, local_world_size, splits, W_PAD: tl.constexpr, E_PAD: tl.constexpr,
                    K_PAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, CHUNK: tl.constexpr,
                    group=None):
    """Normal mode. Grid (world, splits), ranks of `group` if given. x: T rows of `width` words; meta: T rows of 2 * topk + 1
    int32 (expert ids, weight bits, token index); positions: [T, world] from routing (-1: not for
    that rank), order its inverse ([world, T]: the tokens for each rank in place order); routed:
    tokens per rank [world], then pairs per expert [world * E_local]. staging: a `DispatchStaging`,
    whose counts hold per source word 0 the tokens it sent here and word E_PAD + e its pairs for
    local expert e; recv: a `Received`."""
    (staging_ptr, meta_staging_ptr, counts_ptr, arrivals_ptr, progress_ptr, claims_ptr, calls_ptr, slot_numel,
     meta_slot) = staging
    epoch, me, world, peer, split, stage = exchange_program(calls_ptr, staging_ptr, slot_numel, group)
    meta_width = 2 * topk + 1
    meta_stage = in_slot(meta_staging_ptr, epoch, meta_slot)
    counts = in_slot(counts_ptr, epoch, W_PAD * 2 * E_PAD)
    sources = tl.arange(0, W_PAD)
    experts = tl.arange(0, E_PAD)
    local = experts < experts_local
    first_program = (peer == 0) & (split == 0)  # resets the claims, writes the layout
    if first_program:
        reset_claims(claims_ptr, epoch)

    words = tl.arange(0, 2 * E_PAD)
    pair_words = (words >= E_PAD) & (words - E_PAD < experts_local)
    routed = tl.load(routed_ptr + tl.where(words == 0, peer, world + peer * experts_local + words - E_PAD),
                     mask=(words == 0) | pair_words, other=0)
    send_values(counts, me * 2 * E_PAD + words, routed, (words == 0) | pair_words, peer, local_world_size, 2 * E_PAD,
                group)
    arrive(arrivals_ptr + me, peer, local_world_size, group)

    if peer != me:
        first, stop = split_rows(tl.load(routed_ptr + peer), split, splits)
        progress = progress_ptr + me * splits + split
        for chunk in range(first, stop, CHUNK * BLOCK_R):
            chunk_end = tl.minimum(chunk + CHUNK * BLOCK_R, stop)
            for at in range(chunk, chunk_end, BLOCK_R):
                places = at + tl.arange(0, BLOCK_R)
                going = places < chunk_end
                rows = tl.load(order_ptr + peer.to(tl.int64) * tokens + places, mask=going, other=0)
                send_rows(x_ptr, rows, stage + me * max_tokens * width, places, going, width, peer, local_world_size,
                          BLOCK_R, BLOCK_W, group)
                send_rows(meta_ptr, rows, meta_stage + me * max_tokens * meta_width, places, going, meta_width, peer,
                          local_world_size, BLOCK_R, K_PAD, group)
            raise_flag(progress, epoch * PROGRESS_EPOCH + chunk_end, peer, local_world_size, group)
    else:
        counts = await_counts(arrivals_ptr, counts, me, epoch, splits)
        received = tl.load(counts + sources * 2 * E_PAD, mask=sources < me, other=0)
        start = tl.sum(received, 0)
        first, stop = split_rows(tokens, split, splits)
        for token in range(first, stop, BLOCK_R):
            rows = token + tl.arange(0, BLOCK_R)
            place = tl.load(positions_ptr + rows.to(tl.int64) * world + me, mask=rows < stop, other=-1)
            _receive_tokens(x_ptr, meta_ptr, rows, start + place, place >= 0, me, recv, width, max_tokens,
                            experts_local, topk, K_PAD, BLOCK_W, group)

    # The peers' rows, by blocks of BLOCK_R places that every program claims in the order they
    # arrive: block c is block c // ((world - 1) x splits) of part (c // (world - 1)) % splits of the
    # (c % (world - 1) + 1)-th rank after this one.
    counts = await_counts(arrivals_ptr, counts, world, epoch, splits)
    received = tl.load(counts + sources * 2 * E_PAD, mask=sources < world, other=0)
    before = tl.cumsum(received, 0) - received
    others = tl.maximum(world - 1, 1)
    per_part = tl.cdiv(tl.max(tl.where(sources == me, 0, received), 0), splits)
    blocks = (world - 1) * splits * tl.cdiv(per_part, BLOCK_R)
    block = claim(claims_ptr, epoch)
    while block < blocks:
        source = (me + 1 + block % others) % world
        part = (block // others) % splits
        part_first, part_stop = split_rows(pick(received, source), part, splits)
        first = part_first + (block // (others * splits)) * BLOCK_R
        stop = tl.minimum(first + BLOCK_R, part_stop)
        if first < stop:
            here = dl.shmem.signal_wait_until(progress_ptr + source * splits + part, dl.shmem.CMP_GE,
                                              epoch * PROGRESS_EPOCH + stop)
            rows = first + tl.arange(0, BLOCK_R)
            _receive_tokens(dl.consume_token(stage + source * max_tokens * width, here),
                            dl.consume_token(meta_stage + source * max_tokens * meta_width, here), rows,
                            pick(before, source) + rows, rows < stop, source, recv, width, max_tokens, experts_local,
                            topk, K_PAD, BLOCK_W, group)
        block = claim(claims_ptr, epoch)
    if first_program:
        _, _, _, _, recv_layout_ptr, recv_per_expert_ptr = recv
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
                   WORLD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, CHUNK: tl.constexpr,
                   group=None):
    """Normal mode, the way back. Grid (world, splits), ranks of `group` if given. y: the received tokens' outputs (rows of
    `hidden`); per slot, staging is [world, max_tokens] rows: row (q, t) holds rank q's output for
    this rank's token t; progress: a word per (source, part); claims: this rank's two counters of
    blocks claimed (one per slot). WORLD: the world size, the parts of each sum."""
    epoch, me, world, peer, split, stage = exchange_program(calls_ptr, staging_ptr, slot_numel, group)
    per_part = tl.cdiv(max_tokens, splits)
    if (peer == 0) & (split == 0):
        reset_claims(claims_ptr, epoch)
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
                          local_world_size, BLOCK_R, BLOCK_W, group)
            last = tl.load(rows_from + chunk_end - 1) - peer * max_tokens
            raise_flag(progress, epoch * PROGRESS_EPOCH + last + 1, peer, local_world_size, group)
        raise_flag(progress, epoch * PROGRESS_EPOCH + stop, peer, local_world_size, group)
        # Every call hears from every peer (what makes two staging slots enough, `protocol.py`).
        dl.shmem.signal_wait_until(progress_ptr + peer * splits + split, dl.shmem.CMP_GE,
                                   epoch * PROGRESS_EPOCH + stop)

    # The sums, a block of BLOCK_R tokens at a time, claimed from this rank's counter by whichever
    # program is free: this rank's own row at once, the others once they have sent. Block c lies in
    # part c % splits, whose rows the peers' programs of that part send in token order, so that
    # the blocks claimed first are those that arrive first.
    blocks = splits * tl.cdiv(per_part, BLOCK_R)
    block = claim(claims_ptr, epoch)
    while block < blocks:
        part = block % splits
        first = part * per_part + (block // splits) * BLOCK_R
        stop = tl.minimum(tl.minimum(first + BLOCK_R, (part + 1) * per_part), tokens)
        if first < stop:
            here = stage
            for source in range(world):
                target = tl.where(source == me, 0, epoch * PROGRESS_EPOCH + stop)
                here = dl.consume_token(here, dl.shmem.signal_wait_until(progress_ptr + source * splits + part,
                                                                         dl.shmem.CMP_GE, target))
            sum_parts(here, out_ptr, first, stop, hidden, positions_ptr, positions_ptr, y_ptr,
                      recv_layout_ptr + world + me, positions_ptr, max_tokens, 1, WORLD, False, BLOCK_R, BLOCK_W, group)
        block = claim(claims_ptr, epoch)
    finish_call(calls_ptr)


class NormalDispatch(Exchange):
    """`EPBuffer.dispatch` for tokens of `topk` experts: per slot, staging for world x max_tokens
    rows of tokens (as words) and of their meta rows, and a row of counts per source."""

    name = "normal_dispatch"

    def __init__(self, layer: Layer, topk: int):
        super().__init__(layer, "dispatch")
        w = self.ranks
        rows, width, meta_width = w.world_size * layer.max_tokens, layer.hidden // 2, 2 * topk + 1
        checks.check_offsets("EPBuffer", 2 * rows * max(width, meta_width))
        self.staging = DispatchStaging(
            rows=self.symmetric("staging", (2, rows * width), torch.int32),
            meta=self.symmetric("meta", (2, rows * meta_width), torch.int32),
            counts=self.symmetric("counts", (2, layer.w_pad * 2 * layer.e_pad), torch.int32),
            arrivals=self.signals("arrivals", w.world_size),
            progress=self.signals("progress", w.world_size * self.splits),  # `fit` only lowers the splits
            claims=torch.zeros(2, dtype=torch.int32, device=w.device),
            calls=torch.zeros(1, dtype=torch.int64, device=w.device),
            slot_numel=rows * width, meta_slot=rows * meta_width)
        self.send_x = self.send_buffer(w, layer.max_tokens * width, torch.int32, "EPBuffer dispatch")
        self.send_meta = self.send_buffer(w, layer.max_tokens * meta_width, torch.int32, "EPBuffer dispatch meta")

    def launch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor):
        """Send each token of x ([T, hidden]) once to every rank holding one of its experts
        (`topk_idx`, ids out of range already made -1). Returns (a `Received`, with room for
        world x max_tokens tokens; positions, int32 [T, world]: each token's row among those sent to
        each rank, -1 where not sent, which the combine takes)."""
        layer, w = self.layer, self.ranks
        tokens, topk = topk_idx.shape
        order = torch.empty((w.world_size, max(tokens, 1)), dtype=torch.int32, device=w.device)
        positions, routed = tokens_to_ranks(topk_idx, layer.num_experts, w, order=order)
        capacity = w.world_size * layer.max_tokens
        token_index = torch.arange(tokens, dtype=torch.int32, device=w.device)[:, None]
        meta = torch.cat([topk_idx.to(torch.int32), topk_weights.view(torch.int32), token_index], 1)
        recv = Received(x=torch.empty((capacity, layer.hidden), dtype=layer.dtype, device=w.device),
                        idx=torch.full((capacity, topk), -1, dtype=torch.int64, device=w.device),
                        weights=torch.zeros((capacity, topk), dtype=torch.float32, device=w.device),
                        src=torch.empty(capacity, dtype=torch.int32, device=w.device),
                        layout=torch.empty((2, w.world_size), dtype=torch.int32, device=w.device),
                        per_expert=torch.empty(layer.experts_local, dtype=torch.int64, device=w.device))
        width = layer.hidden // 2
        self.start(dispatch_kernel, x_ptr=nonempty(self.sendable(token_words(x), self.send_x)),
                   meta_ptr=nonempty(self.sendable(meta, self.send_meta)),
                   positions_ptr=nonempty(positions), order_ptr=order, routed_ptr=routed, staging=self.staging,
                   recv=recv._replace(x=token_words(recv.x)), tokens=tokens, width=width, max_tokens=layer.max_tokens,
                   experts_local=layer.experts_local, topk=topk, local_world_size=w.local_world_size,
                   W_PAD=layer.w_pad, E_PAD=layer.e_pad, K_PAD=triton.next_power_of_2(2 * topk + 1), BLOCK_R=BLOCK_R,
                   BLOCK_W=block_w(width), CHUNK=CHUNK, num_warps=8)
        return recv, positions


class NormalCombine(Exchange):
    """`EPBuffer.combine`: per slot, staging for world x max_tokens rows of outputs (row (q, t):
    rank q's output for this rank's token t)."""

    name = "normal_combine"

    def __init__(self, layer: Layer):
        super().__init__(layer, "combine")
        w = self.ranks
        rows = w.world_size * layer.max_tokens
        checks.check_offsets("EPBuffer", 2 * rows * layer.hidden)
        self.slot_numel = rows * layer.hidden
        self.staging = self.symmetric("staging", (2, self.slot_numel), layer.dtype)
        self.progress = self.signals("progress", w.world_size * self.splits)  # `fit` only lowers the splits
        self.claims = torch.zeros(2, dtype=torch.int32, device=w.device)
        self.calls = torch.zeros(1, dtype=torch.int64, device=w.device)
        self.send = self.send_buffer(w, self.slot_numel, layer.dtype, "EPBuffer combine")

    def launch(self, y: torch.Tensor, tokens: int, recv_src: torch.Tensor, recv_layout: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        """Send each received token's output (y, rows as the dispatch's `Received`) back to its rank;
        returns [tokens, hidden]: per token of this rank, the sum of what every rank that got it sent,
        in rank order (fp32). recv_src, recv_layout, positions: the dispatch's."""
        layer, w = self.layer, self.ranks
        out = torch.empty((max(tokens, 1), layer.hidden), dtype=layer.dtype, device=w.device)
        self.start(combine_kernel, y_ptr=self.sendable(y, self.send), recv_src_ptr=recv_src,
                   recv_layout_ptr=recv_layout, positions_ptr=nonempty(positions), staging_ptr=self.staging,
                   progress_ptr=self.progress, claims_ptr=self.claims, calls_ptr=self.calls, out_ptr=out, tokens=tokens,
                   hidden=layer.hidden, max_tokens=layer.max_tokens, slot_numel=self.slot_numel,
                   local_world_size=w.local_world_size, WORLD=w.world_size, CHUNK=CHUNK, **combine_blocks(layer))
        return out[:tokens]
