"""The local MoE's experts (`moe_local`): every routed (token, expert) pair through its expert's
gated MLP, weighted and summed per token, on one rank, in two kernels and no host read.

x is [T, hidden]; w_gate_up [E, hidden, 2I] (each expert's W_gate columns, then its W_up columns),
w_down [E, I, hidden]; topk_idx int64 [T, topk], ids outside [0, E) naming no expert (-1: none);
topk_weights float32 [T, topk]. The unfused reference: for every pair (t, j) whose id e is an
expert, h = silu(x[t] @ W_gate[e]) * (x[t] @ W_up[e]) rounded to x's dtype, and
y[t] = the sum over j, in j order and in fp32, of topk_weights[t, j] * (h @ W_down[e]) rounded to
x's dtype (a part, as transformers rounds each expert's output), the sum rounded to x's dtype; a
token with no expert gets zeros.

Rows. Each kernel's tile is a block of rows of one expert by a tile of columns; its rows are the
expert's pairs, laid out one of two ways (`policy.dense`):
- dense (decode batches): a program per (used-expert slot u, column tile). Slot u is the u-th
  smallest expert id among the call's pairs, found by each program from the ids (a bit per expert,
  `used_expert`); the slots past the used experts, of the min(E, T * topk) launched, exit at once.
  The rows are all T tokens, those not routed to the expert masked: the tile needs no sort, and its
  x rows are x itself. A token's row of h is h[t * topk + j], j its first pair of the expert (a
  token that names an expert twice gets it once, with the weights added).
- sorted (prefill): the pairs sorted by expert on the device (the family's counting sort,
  `_sort`, then `moe_order_kernel`: `order` lists the pairs expert by expert, `offs` holds the
  experts' cumulative ends), the row tiles laid out as `grouped_gemm` lays them out (one expert a
  row tile) and a program per (row tile, column tile); programs past the real tiles exit at once.
  A row's x is gathered from its token's row, and its row of h is its sorted place.
Either way each program reads its expert's weight tile once, whatever the number of its rows: the
weights read are those of the experts that got pairs, each once.

Kernel 1, `moe_gate_up_kernel`: h = silu(gate) * up for its rows and I-columns, from two fp32
accumulators over the gate's columns (c ...) and the up's (I + c ...) of w_gate_up, both read
from the layer's own layout. Its programs also zero the counters of kernel 2 and write zeros to y
for the tokens that no pair reaches (tokens spread over the programs, `ZB` each): nothing is left
from an earlier call, and no launch of its own does it.

Kernel 2, `moe_down_kernel`: for its rows, weight * (h @ W_down[e]) over its hidden-columns in fp32, the
pair's part, rounded to x's dtype (as transformers' experts round each expert's output) and stored
to parts[t * topk + j] ([T * topk, hidden]). Then, after a barrier of the
program (every thread's stores issued first), one acquire-release add per row to counts[t, column
tile] at GPU scope. The add that brings a token's count to its number of arriving pairs (ids
within [0, E); dense: the first of equal ids) is the last: that program (its threads past a
barrier) reads the token's parts past L1 and writes y[t, columns] = their sum, j = 0, 1, ... in
turn. Whichever program finishes a token last, the sum is taken in the same order: the same bits
every run. No atomics on values, no separate weighting, scatter or sum kernel; what it costs is the
parts written once and read back once (2 bytes a pair per hidden column each way) and an atomic
add per row.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

import tridist.language as dl
from tridist.runtime.jit import jit

from ...gemm import grouped, persistent
from ...gemm.grouped import expert_weights, locate, pick
from .. import _sort
from ..tensor_parallel.ag_moe import gathered_product
from . import policy

ORDER_BLOCK = 1024  # pairs a program of `moe_order_kernel` places
CLEAR_COLUMNS = tl.constexpr(256)  # columns a step of `clear` writes
SUM_COLUMNS = tl.constexpr(32)  # columns of a token's sum the down kernel's epilogue takes at a time


class Routing(NamedTuple):
    """What both kernels read of the call's routing, one tuple argument (unpacked by position: a
    kernel compiled from the compile log sees a plain tuple)."""
    idx: torch.Tensor      # int64 [T, topk]
    weights: torch.Tensor  # float32 [T, topk]
    order: torch.Tensor    # int32 [T * topk]: sorted rows, the pairs expert by expert (dense: unread)
    offs: torch.Tensor     # int32 [E]: the experts' cumulative ends in `order` (dense: unread)
    experts: int           # E


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def used_expert(idx_ptr, pairs, slot, E, P_PAD: tl.constexpr, E_PAD: tl.constexpr):
    """(the `slot`-th smallest expert among the `pairs` ids at idx_ptr (int64), whether there is
    one). The ids become a bit per expert (E_PAD // 32 words, E_PAD at least 32), then a count."""
    p = tl.arange(0, P_PAD)
    ids = tl.load(idx_ptr + p, mask=p < pairs, other=-1)
    ids = tl.where((ids >= 0) & (ids < E), ids, -1).to(tl.int32)
    words = tl.arange(0, E_PAD // 32)
    bits = tl.where((ids >> 5)[:, None] == words[None, :], 1 << (ids & 31)[:, None], 0)
    word = tl.reduce(bits, 0, _or)
    experts = tl.arange(0, E_PAD)
    mine = tl.sum(tl.where((experts >> 5)[:, None] == words[None, :], word[None, :], 0), 1)
    present = (mine >> (experts & 31)) & 1
    place = tl.cumsum(present, 0)
    return tl.sum(tl.where((present == 1) & (place == slot + 1), experts, 0), 0), slot < tl.sum(present, 0)


@triton.jit
def arriving(ids, E, DENSE: tl.constexpr):
    """[rows, K_PAD] of the ids `ids` ([rows, K_PAD] int64, -1 past topk): the pairs whose parts
    reach their token's sum. Sorted rows: every id in [0, E); dense rows: the first of equal ones."""
    real = (ids >= 0) & (ids < E)
    if DENSE:
        later = tl.arange(0, ids.shape[1])
        earlier = (ids[:, :, None] == ids[:, None, :]) & (later[None, None, :] < later[None, :, None])
        real = real & (tl.max(earlier.to(tl.int32), 2) == 0)
    return real


@triton.jit
def token_ids(idx_ptr, token, inside, TOPK: tl.constexpr, K_PAD: tl.constexpr):
    """[rows, K_PAD] int64: the ids of each row's token, -1 past TOPK and outside `inside`."""
    j = tl.arange(0, K_PAD)
    return tl.load(idx_ptr + token.to(tl.int64)[:, None] * TOPK + j[None, :],
                   mask=inside[:, None] & (j < TOPK)[None, :], other=-1)


@triton.jit
def clear(idx_ptr, counts_ptr, y_ptr, tokens, E, hidden, down_tiles, TOPK: tl.constexpr, DENSE: tl.constexpr,
          K_PAD: tl.constexpr, ZB: tl.constexpr):
    """This program's ZB tokens: their counters zeroed, zeros in y for those no pair reaches."""
    token = tl.program_id(0) * ZB + tl.arange(0, ZB)
    inside = token < tokens
    arrive = tl.sum(arriving(token_ids(idx_ptr, token, inside, TOPK, K_PAD), E, DENSE).to(tl.int32), 1)
    columns = tl.arange(0, CLEAR_COLUMNS)
    for start in range(0, down_tiles, CLEAR_COLUMNS):
        tl.store(counts_ptr + token[:, None] * down_tiles + start + columns[None, :],
                 tl.zeros([ZB, CLEAR_COLUMNS], dtype=tl.int32),
                 mask=inside[:, None] & (start + columns < down_tiles)[None, :])
    nowhere = inside & (arrive == 0)
    if tl.max(nowhere.to(tl.int32), 0) > 0:
        for start in range(0, hidden, CLEAR_COLUMNS):
            tl.store(y_ptr + token.to(tl.int64)[:, None] * hidden + start + columns[None, :],
                     tl.zeros([ZB, CLEAR_COLUMNS], dtype=y_ptr.dtype.element_ty),
                     mask=nowhere[:, None] & (start + columns < hidden)[None, :])


@triton.jit
def dense_rows(idx_ptr, weights_ptr, tokens, expert, TOPK: tl.constexpr, K_PAD: tl.constexpr,
               BLOCK_M: tl.constexpr):
    """Dense rows of `expert`: (token, row of h, pair, weight, valid), each [BLOCK_M]."""
    token = tl.arange(0, BLOCK_M)
    j = tl.arange(0, K_PAD)
    ids = token_ids(idx_ptr, token, token < tokens, TOPK, K_PAD)
    hit = ids == expert
    pair = token * TOPK + tl.min(tl.where(hit, j[None, :], K_PAD), 1)
    weights = tl.load(weights_ptr + token[:, None] * TOPK + j[None, :], mask=hit, other=0.0)
    return token, pair, pair, tl.sum(weights, 1), tl.max(hit.to(tl.int32), 1) > 0


@triton.jit
def sorted_tiles(offs_ptr, E, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """(starts, ends, row tiles) of every expert's sorted rows, vectors of E_PAD."""
    groups = tl.arange(0, E_PAD)
    ends = tl.load(offs_ptr + groups, mask=groups < E, other=0)
    starts = tl.load(offs_ptr + groups - 1, mask=(groups > 0) & (groups < E), other=0)
    return starts, ends, tl.cdiv(ends - starts, BLOCK_M)


@triton.jit
def sorted_rows(tile, live, starts, ends, tiles, order_ptr, weights_ptr, tiles_n, TOPK: tl.constexpr,
                BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr):
    """Sorted rows of tile `tile`: (expert, column tile, token, row of h, pair, weight, valid), the
    last five [BLOCK_M]; no valid row unless `live` (a real tile)."""
    tiles_m = tl.maximum(tl.sum(tiles, 0), 1)  # a tile within [0, tiles_m x tiles_n) even where none is real
    tm, tn = persistent.tile_coords(tl.minimum(tile, tiles_m * tiles_n - 1), tiles_m, tiles_n, GROUP_M)
    expert, first = locate(tm, tiles)
    row = pick(starts, expert) + (tm - first) * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = live & (row < pick(ends, expert))
    pair = tl.load(order_ptr + row, mask=valid, other=0)
    return expert, tn, pair // TOPK, row, pair, tl.load(weights_ptr + pair, mask=valid, other=0.0), valid


@triton.jit
def tile_rows(routing, tokens, n, TOPK: tl.constexpr, DENSE: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr,
              P_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's tile of a product with n columns: (live (a real tile; else the program has
    nothing to do), expert, column tile, token, row of h, pair, weight, valid), the last five
    [BLOCK_M], no valid row unless live."""
    idx_ptr, weights_ptr, order_ptr, offs_ptr, E = routing
    tiles_n = tl.cdiv(n, BLOCK_N)
    tile = tl.program_id(0)
    if DENSE:
        expert, live = used_expert(idx_ptr, tokens * TOPK, tile // tiles_n, E, P_PAD, E_PAD)
        token, h_row, pair, weight, valid = dense_rows(idx_ptr, weights_ptr, tokens, expert, TOPK, K_PAD, BLOCK_M)
        return live, expert, tile % tiles_n, token, h_row, pair, weight, valid & live
    else:
        starts, ends, tiles = sorted_tiles(offs_ptr, E, E_PAD, BLOCK_M)
        live = tile < tl.sum(tiles, 0) * tiles_n
        expert, tn, token, h_row, pair, weight, valid = sorted_rows(tile, live, starts, ends, tiles, order_ptr,
                                                                    weights_ptr, tiles_n, TOPK, BLOCK_M, GROUP_M)
        return live, expert, tn, token, h_row, pair, weight, valid


@triton.jit
def gated_product(x_rows, row_mask, w_desc, expert, col, inner, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """(A @ W_gate[expert][:, col:col+BLOCK_N], A @ W_up[expert][:, col:col+BLOCK_N]) in fp32, row i of
    A at x_rows[i] (K elements; rows outside `row_mask` read as zeros), each step's rows of A loaded
    once for both. A gate tile that passes I reads up columns, which the caller does not store; an
    up tile that passes 2I reads zeros (TMA)."""
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    starts = x_rows[:, None]
    rows = row_mask[:, None]
    columns = tl.arange(0, BLOCK_K)
    for k in tl.range(0, tl.cdiv(K, BLOCK_K)):
        inner_k = k * BLOCK_K + columns
        a = tl.load(starts + inner_k[None, :], mask=rows & (inner_k < K)[None, :], other=0.0)
        gate = dl.dot(a, expert_weights(w_desc, expert, k * BLOCK_K, col, BLOCK_N, BLOCK_K), gate)
        up = dl.dot(a, expert_weights(w_desc, expert, k * BLOCK_K, inner + col, BLOCK_N, BLOCK_K), up)
    return gate, up


@jit
def moe_gate_up_kernel(x_ptr, w_desc, h_ptr, routing, counts_ptr, y_ptr, tokens, hidden, inner, down_tiles,
                   TOPK: tl.constexpr, DENSE: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr,
                   P_PAD: tl.constexpr, ZB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """h (x's dtype: [T * topk, I]; dense rows at their pairs, sorted at their places) = silu(gate) *
    up; counts_ptr (int32 [T, down_tiles]) zeroed, y's rows of tokens no pair reaches zeroed."""
    idx_ptr, weights_ptr, order_ptr, offs_ptr, E = routing
    clear(idx_ptr, counts_ptr, y_ptr, tokens, E, hidden, down_tiles, TOPK, DENSE, K_PAD, ZB)
    live, expert, tn, token, h_row, pair, weight, valid = tile_rows(routing, tokens, inner, TOPK, DENSE, E_PAD, K_PAD,
                                                                    P_PAD, BLOCK_M, BLOCK_N, GROUP_M)
    if live:
        gate, up = gated_product(x_ptr + token.to(tl.int64) * hidden, valid, w_desc, expert, tn * BLOCK_N, inner,
                                 hidden, BLOCK_M, BLOCK_N, BLOCK_K)
        h = gate * tl.sigmoid(gate) * up
        cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(h_ptr + h_row.to(tl.int64)[:, None] * inner + cols[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=valid[:, None] & (cols < inner)[None, :])


@jit
def moe_down_kernel(h_ptr, w_desc, parts_ptr, routing, counts_ptr, y_ptr, tokens, hidden, inner, TOPK: tl.constexpr,
                DENSE: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr, P_PAD: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """parts (x's dtype, [T * topk, hidden]) = weight * (h @ W_down) by pair, and each token's sum into y
    by the program that brings its count (counts_ptr: [T, column tiles]) to its arriving pairs."""
    idx_ptr, weights_ptr, order_ptr, offs_ptr, E = routing
    tiles_n = tl.cdiv(hidden, BLOCK_N)
    live, expert, tn, token, h_row, pair, weight, valid = tile_rows(routing, tokens, hidden, TOPK, DENSE, E_PAD, K_PAD,
                                                                    P_PAD, BLOCK_M, BLOCK_N, GROUP_M)
    if live:
        acc = gathered_product(h_ptr + h_row.to(tl.int64) * inner, valid, w_desc, expert, tn * BLOCK_N, inner,
                               BLOCK_M, BLOCK_N, BLOCK_K)
        cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
        in_cols = (cols < hidden)[None, :]
        tl.store(parts_ptr + pair.to(tl.int64)[:, None] * hidden + cols[None, :],
                 (acc * weight[:, None]).to(parts_ptr.dtype.element_ty),
                 mask=valid[:, None] & in_cols)
        tl.debug_barrier()  # every thread's parts issued before any of the program's counts goes up
        count = tl.atomic_add(counts_ptr + token * tiles_n + tn, 1, mask=valid, sem="acq_rel", scope="gpu")
        arrive = arriving(token_ids(idx_ptr, token, valid, TOPK, K_PAD), E, DENSE)
        last = valid & (count == tl.sum(arrive.to(tl.int32), 1) - 1)
        if tl.max(last.to(tl.int32), 0) > 0:
            tl.debug_barrier()  # the threads that read the parts come after those that acquired them
            j = tl.arange(0, K_PAD)
            # A slice of the columns at a time: a whole tile's sum and its pointers beside the
            # accumulator's registers spilled at the prefill's tile (benchmarks/NOTES.md, "The local
            # MoE's down kernel: registers").
            SUM_N: tl.constexpr = min(BLOCK_N, SUM_COLUMNS)
            for start in tl.static_range(0, BLOCK_N, SUM_N):
                sum_cols = tn * BLOCK_N + start + tl.arange(0, SUM_N)
                in_sum = (sum_cols < hidden)[None, :]
                total = tl.zeros((BLOCK_M, SUM_N), dtype=tl.float32)
                for k in tl.static_range(TOPK):
                    mine = last & (tl.max(tl.where(j[None, :] == k, arrive.to(tl.int32), 0), 1) > 0)
                    total += tl.load(parts_ptr + (token.to(tl.int64) * TOPK + k)[:, None] * hidden
                                     + sum_cols[None, :], mask=mine[:, None] & in_sum, other=0.0,
                                     cache_modifier=".cg").to(tl.float32)
                tl.store(y_ptr + token.to(tl.int64)[:, None] * hidden + sum_cols[None, :],
                         total.to(y_ptr.dtype.element_ty), mask=last[:, None] & in_sum)


@jit
def moe_order_kernel(idx_ptr, positions_ptr, offs_ptr, order_ptr, pairs, E, BLOCK: tl.constexpr):
    """order[start of its expert + its place among the expert's pairs] = pair, for the pairs whose id
    is an expert (`positions`: `_sort.sort`'s places; offs: the experts' cumulative ends)."""
    pair = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(idx_ptr + pair, mask=pair < pairs, other=-1)
    real = (ids >= 0) & (ids < E)
    expert = tl.where(real, ids, 0).to(tl.int32)
    start = tl.load(offs_ptr + expert - 1, mask=real & (expert > 0), other=0)
    place = tl.load(positions_ptr + pair, mask=real, other=0)
    tl.store(order_ptr + start + place, pair, mask=real)


def sorted_routing(idx: torch.Tensor, weights: torch.Tensor, experts: int) -> Routing:
    """The pairs sorted by expert on the device (three launches: the counting sort, its cumulative
    sum, `moe_order_kernel`)."""
    pairs = idx.numel()
    positions = torch.empty(pairs, dtype=torch.int32, device=idx.device)
    counts = torch.empty(experts, dtype=torch.int32, device=idx.device)
    _sort.sort(idx.view(-1), positions, counts, experts, 1, one_group=True)
    offs = counts.cumsum(0, dtype=torch.int32)
    order = torch.empty(pairs, dtype=torch.int32, device=idx.device)
    moe_order_kernel[(triton.cdiv(pairs, ORDER_BLOCK),)](idx_ptr=idx, positions_ptr=positions, offs_ptr=offs,
                                                     order_ptr=order, pairs=pairs, E=experts, BLOCK=ORDER_BLOCK)
    return Routing(idx, weights, order, offs, experts)


def launch(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
           out: torch.Tensor, configs: tuple[dict, dict]) -> None:
    """Queue both kernels (and, for sorted rows, the sort) for checked, non-empty arguments; y into
    `out`. `configs`: (gate/up, down), as `policy.configs` gives them."""
    tokens, hidden = x.shape
    experts, inner = w_down.shape[:2]
    topk = idx.shape[1]
    dense = policy.dense(tokens)
    routing = Routing(idx, weights, idx, idx, experts) if dense else sorted_routing(idx, weights, experts)
    up_config, down_config = (dict(c) for c in configs)
    options = [{name: c.pop(name) for name in ("num_warps", "num_stages")} for c in (up_config, down_config)]
    used = min(experts, tokens * topk)  # experts with pairs, at most
    grids = [(used if dense else triton.cdiv(tokens * topk, c["BLOCK_M"]) + used) * triton.cdiv(n, c["BLOCK_N"])
             for c, n in ((up_config, inner), (down_config, hidden))]
    down_tiles = triton.cdiv(hidden, down_config["BLOCK_N"])
    counts = torch.empty((tokens, down_tiles), dtype=torch.int32, device=x.device)
    h = torch.empty((tokens * topk, inner), dtype=x.dtype, device=x.device)
    parts = torch.empty((tokens * topk, hidden), dtype=x.dtype, device=x.device)
    # P_PAD only for the dense rows, so that prefill calls of any T share one compiled kernel
    pads = dict(TOPK=topk, DENSE=dense, E_PAD=max(32, triton.next_power_of_2(experts)),
                K_PAD=triton.next_power_of_2(topk), P_PAD=triton.next_power_of_2(tokens * topk) if dense else 1)
    sizes = dict(tokens=tokens, hidden=hidden, inner=inner)
    moe_gate_up_kernel[(grids[0],)](
        x_ptr=x, w_desc=grouped.weight_descriptor(w_gate_up, up_config), h_ptr=h, routing=routing,
        counts_ptr=counts, y_ptr=out, down_tiles=down_tiles, ZB=triton.next_power_of_2(triton.cdiv(tokens, grids[0])),
        **sizes, **pads, **up_config, **options[0])
    moe_down_kernel[(grids[1],)](
        h_ptr=h, w_desc=grouped.weight_descriptor(w_down, down_config), parts_ptr=parts, routing=routing,
        counts_ptr=counts, y_ptr=out, **sizes, **pads, **down_config, **options[1])

