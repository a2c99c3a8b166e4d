"""Stress cases of the grouped GEMM (`tridist.ops.gemm`, family "gemm") and of the tensor-parallel
MoE ops built on it (`tridist.ops.moe`, family "moe"): grouped_gemm, ag_moe and moe_rs.

- grouped_gemm: bf16, fp16 and fp8 (a scale per row of x and per column of each expert, w
  column-major per expert), 1 to 8 groups whose sizes are drawn per call: empty groups, all rows
  in one group, none in any, rows past the last group. Every group's product within
  `gemm_tolerance`; the rows past the last group, which the op must leave alone, exact (they hold a
  random pattern, the others NaN, before the call).
- ag_moe (every comm) and moe_rs, each in every tile order (`method`: "comm/order" for ag_moe, the
  order for moe_rs), bf16 and fp16, 1 to 8 experts, topk from 1 to every expert, the
  tokens of every rank routed per call (and per graph replay): to all experts, to a random few (the
  others get no rows), or every token to the same topk (with topk 1, all to one expert). ag_moe:
  h within `gemm_tolerance` (poisoned with NaN first) and its handle (the rows' pairs, the gathered
  routing, the counts, bases and offs) exact. moe_rs: y within `moe_rs_tolerance` (poisoned with
  NaN first), for a random h of every rank and the handle of the call's routing, made by the
  routing step of ag_moe (`routing.Router`) so that moe_rs is checked apart from ag_moe's GEMM.

Experts that get no rows have NaN weights: a tile that read past the end of its expert's weights
into the next expert's turns NaN. Every rank makes every rank's inputs and the routing from the
call's seed and builds the layout of h (pairs sorted stably by expert, `Layout`) and the float32
products (`grouped_products`) itself.

Shapes (`Call.shape`): grouped_gemm (rows of x, K, N, groups); ag_moe and moe_rs (tokens per rank,
K, N per rank, experts, topk), K the tokens' features, N the experts' inner columns on each rank.
"""
import bisect
import itertools
import random

import torch

from tridist import ops
from tridist.ops import gemm
from tridist.ops.gemm import allgather_gemm, grouped
from tridist.ops.moe import policy
from tridist.ops.moe.tensor_parallel import routing
from tridist.ops.ranks import ranks_of

from .cases import (Expected, OpCases, Trial, _UNIT_ROUNDOFF, composition, count_with_edges, draw_method,
                    gemm_tolerance, log_uniform, poison, random_tensor, register, round_up, seed_of)
from .gemm import CONFIG_SHARE

MAX_GROUPS = 8   # groups of grouped_gemm, experts of ag_moe and moe_rs
MAX_TOPK = 8
# In the emulator a call of ag_moe or moe_rs costs 0.3 s at the least (2 ranks on 2 cores: a
# routing kernel, then GEMM tiles in programs that run as threads) and seconds at 64 pairs of 48
# columns: there the pairs of all ranks (rows of h) and the widths (K, N) stay small.
EMULATOR_PAIRS, EMULATOR_WIDTH = 16, 32


def grouped_products(x: torch.Tensor, w: torch.Tensor, ends: list[int], scale_a=None, scale_b=None) -> torch.Tensor:
    """float32 x[rows of group e] @ w[e] for each group e (rows ends[e-1] to ends[e]), times the fp8
    scales of its rows and of the expert's columns if given; the rows past the last group zero."""
    out = torch.zeros(x.shape[0], w.shape[2], device=x.device)
    for group, (start, end) in enumerate(zip([0] + ends[:-1], ends)):
        out[start:end] = x[start:end].float() @ w[group].float()
        if scale_a is not None:
            out[start:end] *= scale_a[start:end, None] * scale_b[group]
    return out


def expert_weights(shape: tuple, dtype: torch.dtype, seed: int, device: torch.device, rows: list[int]) -> torch.Tensor:
    """Random weights of shape experts x ..., NaN for the experts that get no rows (`rows` per expert)."""
    w = random_tensor(shape, dtype, seed, device)
    for expert, count in enumerate(rows):
        if count == 0:
            w[expert] = float("nan")
    return w


# ---- grouped_gemm --------------------------------------------------------------------------------
class GroupedGemmCases(OpCases):
    """shape: (rows of x, K, N, groups)."""
    name, family = "grouped_gemm", "gemm"
    forms = ("function",)

    def draw(self, rng, world, limits):
        dtype = rng.choice(grouped.DTYPES)
        k = round_up(log_uniform(rng, 1, limits.k), 16 // dtype.itemsize)
        n = round_up(log_uniform(rng, 1, limits.n), 8)
        rows, groups = log_uniform(rng, 1, limits.rows), rng.randint(1, MAX_GROUPS)
        config = rng.choice(grouped.configs(world.device, dtype)) if rng.random() < CONFIG_SHARE else None
        return dict(method=None, dtype=dtype, shape=(rows, k, n, groups), config=config)

    def trial(self, call, world):
        return GroupedGemmTrial(call, world)


class GroupedGemmTrial(Trial):
    """x (rows x K), w (groups x K x N; fp8: the transpose per group of a contiguous groups x N x K),
    offs, and for fp8 float32 scales of x's rows and of each group's columns."""

    def __init__(self, call, world):
        self.spec, self.world = call, world
        rows, k, n, groups = call.shape
        device = world.device
        self.fp8 = call.dtype == grouped.FP8
        self.x = torch.empty(rows, k, dtype=call.dtype, device=device)
        self.w_storage = torch.empty((groups, n, k) if self.fp8 else (groups, k, n), dtype=call.dtype, device=device)
        self.w = self.w_storage.transpose(1, 2) if self.fp8 else self.w_storage
        self.offs = torch.empty(groups, dtype=torch.int32, device=device)
        self.scales = ((torch.empty(rows, device=device), torch.empty(groups, n, device=device)) if self.fp8
                       else (None, None))
        self.out = torch.empty(rows, n, dtype=gemm.out_dtype(call.dtype), device=device)

    def fill(self, seed):
        rows, _, n, groups = self.spec.shape
        device, dtype = self.world.device, self.spec.dtype
        seed = seed_of(seed, self.world.rank)  # a local op: each rank its own inputs
        rng = random.Random(seed)
        ends = list(itertools.accumulate(composition(rng, count_with_edges(rng, rows), groups)))
        sizes = [end - start for start, end in zip([0] + ends[:-1], ends)]
        x = random_tensor(tuple(self.x.shape), dtype, seed_of(seed, "x"), device)
        w_storage = expert_weights(tuple(self.w_storage.shape), dtype, seed_of(seed, "w"), device, sizes)
        w = w_storage.transpose(1, 2) if self.fp8 else w_storage
        scales = (None, None)
        if self.fp8:
            g = torch.Generator(device).manual_seed(seed_of(seed, "scales"))
            scales = tuple(0.25 + 1.75 * torch.rand(s.shape, generator=g, device=device) for s in self.scales)
        written = ends[-1]
        reference = grouped_products(x, w, ends, *scales).double()
        guard = random_tensor((rows - written, n), self.out.dtype, seed_of(seed, "guard"), device)
        reference[written:] = guard.double()
        tolerance = torch.zeros_like(reference)
        if written:
            tolerance[:written] = gemm_tolerance(reference[:written], self.out.dtype, 0)

        def where(i: int) -> str:
            row, column = divmod(i, n)
            if row >= written:
                return f"row {row}, column {column}: past the last group, which the call must leave alone"
            return f"row {row} (group {bisect.bisect_right(ends, row)}), column {column}"

        expected = Expected(reference, tolerance, where)
        poison(self.out, expected)
        self.out[written:] = guard
        self.x.copy_(x)
        self.w_storage.copy_(w_storage)
        self.offs.copy_(torch.tensor(ends, dtype=torch.int32))
        for buffer, scale in zip(self.scales, scales):
            if buffer is not None:
                buffer.copy_(scale)
        return expected

    def call(self, op):
        scale_a, scale_b = self.scales
        return ops.grouped_gemm(self.x, self.w, self.offs, self.out, config=self.spec.config, scale_a=scale_a,
                                scale_b=scale_b)


# ---- the routing of ag_moe and moe_rs ------------------------------------------------------------
def draw_routing(rng: random.Random, tokens: int, topk: int, experts: int) -> list[list[int]]:
    """topk distinct experts for each of `tokens` tokens, from a pool: every expert, a random few
    (the others get no rows), or, a fifth of the time, just topk of them (every token to the same
    experts; with topk 1, all to one expert)."""
    style = rng.random()
    pool = rng.sample(range(experts), topk if style < 0.2 else rng.randint(topk, experts) if style < 0.5 else experts)
    return [rng.sample(pool, topk) for _ in range(tokens)]


class Layout:
    """The layout of h that every rank's routing gives (see `tensor_parallel.routing`), built for the reference:
    pair p = global token * topk + k; rows sorted stably by expert. Attributes as `MoEHandle`'s,
    int64, and `ends` (offs on the host) and `sizes` (rows per expert)."""

    def __init__(self, routing: list[list[int]], world_size: int, tokens: int, topk: int, experts: int, device):
        self.topk_idx = torch.tensor(routing, dtype=torch.int64, device=device)
        self.pair_of_row = torch.sort(self.topk_idx.reshape(-1), stable=True).indices
        self.row_of_pair = torch.empty_like(self.pair_of_row)
        self.row_of_pair[self.pair_of_row] = torch.arange(self.pair_of_row.numel(), device=device)
        self.counts = torch.stack([torch.bincount(rank_pairs, minlength=experts)
                                   for rank_pairs in self.topk_idx.view(world_size, tokens * topk)])
        totals = self.counts.sum(0)
        self.offs = totals.cumsum(0)
        self.base = self.offs - totals + self.counts.cumsum(0) - self.counts
        self.ends, self.sizes = self.offs.tolist(), totals.tolist()

    @classmethod
    def draw(cls, seed: int, world, shape: tuple) -> "Layout":
        """The layout of every rank's routing for a call of `shape`, drawn from its seed (`draw_routing`)."""
        tokens, _, _, experts, topk = shape
        routing = draw_routing(random.Random(seed_of(seed, "routing")), world.world_size * tokens, topk, experts)
        return cls(routing, world.world_size, tokens, topk, experts, world.device)


HANDLE_PARTS = ("pair_of_row", "row_of_pair", "topk_idx", "counts", "base", "offs")  # as `MoEHandle` documents them


def handle_parts(handle) -> torch.Tensor:
    """The parts of a `MoEHandle` (or of a `Layout`) one after the other, as float64."""
    return torch.cat([getattr(handle, name).double().reshape(-1) for name in HANDLE_PARTS])


class _MoECases(OpCases):
    """shape: (tokens per rank, K, N per rank, experts, topk): K the tokens' features (ag_moe's
    input, moe_rs's output), N the columns of the experts' inner layer that this rank holds."""
    family = "moe"

    def draw(self, rng, world, limits):
        dtype = rng.choice(routing.DTYPES)
        experts = rng.randint(1, MAX_GROUPS)
        most_topk = min(experts, MAX_TOPK)
        topk = rng.choice((1, rng.randint(1, most_topk), most_topk))
        gpu = world.device.type == "cuda"
        tokens = log_uniform(rng, 1, max(1, (limits.rows if gpu else EMULATOR_PAIRS) // (world.world_size * topk)))
        k = round_up(log_uniform(rng, 1, limits.k if gpu else EMULATOR_WIDTH), 8)
        n = round_up(log_uniform(rng, 1, limits.n if gpu else EMULATOR_WIDTH), 8)
        config = rng.choice(grouped.configs(world.device, dtype)) if rng.random() < CONFIG_SHARE else None
        return dict(method=self.method(rng, world), dtype=dtype, shape=(tokens, k, n, experts, topk), config=config)

    def method(self, rng, world):
        return None


class AgMoeCases(_MoECases):
    """method: the comm and the tile order, "comm/order"."""
    name = "ag_moe"

    def method(self, rng, world):
        comm = draw_method(rng, self.name, allgather_gemm.COMMS, world, ("ce",), "comm")
        return f"{comm}/{rng.choice(policy.TILE_ORDERS)}"

    def trial(self, call, world):
        return AgMoeTrial(call, world)


class MoeRsCases(_MoECases):
    """method: the tile order."""
    name = "moe_rs"

    def method(self, rng, world):
        return rng.choice(policy.TILE_ORDERS)

    def draw(self, rng, world, limits):
        fields = super().draw(rng, world, limits)
        if fields["config"] and world.world_size > 1:  # with peers it refuses FLATTEN: the same tiles without
            fields["config"] = {**fields["config"], "FLATTEN": False}
        return fields

    def trial(self, call, world):
        return MoeRsTrial(call, world)


class AgMoeTrial(Trial):
    """`call` returns h then the handle's parts, as float64."""

    def __init__(self, call, world):
        self.spec, self.world = call, world
        tokens, k, n, experts, topk = call.shape
        device = world.device
        self.x = torch.empty(tokens, k, dtype=call.dtype, device=device)
        self.topk_idx = torch.empty(tokens, topk, dtype=torch.int64, device=device)
        self.w = torch.empty(experts, k, n, dtype=call.dtype, device=device)
        self.out = torch.empty(world.world_size * tokens * topk, n, dtype=call.dtype, device=device)

    def fill(self, seed):
        W, me, device = self.world.world_size, self.world.rank, self.world.device
        tokens, k, n, experts, topk = self.spec.shape
        layout = Layout.draw(seed, self.world, self.spec.shape)
        xs = [random_tensor((tokens, k), self.spec.dtype, seed_of(seed, rank), device) for rank in range(W)]
        w = expert_weights((experts, k, n), self.spec.dtype, seed_of(seed, me, "w"), device, layout.sizes)
        h = grouped_products(torch.cat(xs)[layout.pair_of_row // topk], w, layout.ends).double()
        handle = handle_parts(layout)
        expected = Expected(torch.cat([h.reshape(-1), handle]),
                            torch.cat([torch.full((h.numel(),), gemm_tolerance(h, self.spec.dtype, 0), device=device),
                                       torch.zeros_like(handle)]),
                            _handle_where(h.shape, layout, tokens, topk))
        poison(self.out, expected)
        self.x.copy_(xs[me])
        self.topk_idx.copy_(layout.topk_idx[me * tokens:(me + 1) * tokens])
        self.w.copy_(w)
        return expected

    def build(self):
        c = self.spec
        comm, order = c.method.split("/")
        return ops.AllGatherMoE(*c.shape, c.dtype, comm, config=c.config, tile_order=order)

    def call(self, op):
        c = self.spec
        if op is None:
            comm, order = c.method.split("/")
            h, handle = ops.ag_moe(self.x, self.topk_idx, self.w, self.out, comm=comm, config=c.config,
                                   tile_order=order)
        else:
            h, handle = op(self.x, self.topk_idx, self.w, self.out)
        return torch.cat([h.double().reshape(-1), handle_parts(handle)])


def _handle_where(h_shape, layout: Layout, tokens: int, topk: int):
    """Names element i of what `AgMoeTrial.call` returns: a row of h and the pair it holds, or a handle part's entry."""
    rows, columns = h_shape

    def where(i: int) -> str:
        if i < rows * columns:
            row, column = divmod(i, columns)
            pair = int(layout.pair_of_row[row])
            token = pair // topk
            return (f"h row {row}, column {column}: rank {token // tokens}'s token {token % tokens}, its expert "
                    f"{int(layout.topk_idx.reshape(-1)[pair])}")
        i -= rows * columns
        for name in HANDLE_PARTS:
            size = getattr(layout, name).numel()
            if i < size:
                break
            i -= size
        return f"the handle's {name}, entry {i} (flattened)"

    return where


def moe_rs_tolerance(reference: torch.Tensor, rounded: torch.Tensor, accumulated: torch.Tensor, dtype: torch.dtype,
                     terms: int) -> torch.Tensor:
    """Per-element bound for moe_rs's y = the sum over ranks s and the token's pairs k of w_k (h_s[row
    of the pair] @ w_s[its expert]): `rounded` = the sum of |w_k| |product|, `accumulated` = the sum
    of |w_k| (|h_s[row]| @ |w_s[expert]|), `terms` = N + topk + world size.

    Each product is rounded to `dtype` (u |product|), each rank's weighted sum too before it is
    sent to the token's owner (u of its part of `rounded`), the total once (u |y|); the fp32 sums
    (a dot of N terms, then topk products and world size partial sums) err by at most terms 2^-24
    `accumulated`. Twice that is allowed (the emulator casts to bf16 by truncation, which errs by up
    to 2u), plus the smallest subnormal of `dtype` (results near zero). A pair that went missing or
    twice moves y by |w_k product|, of the size of `rounded`'s terms: found in some column of the
    token."""
    u = _UNIT_ROUNDOFF[dtype]
    bound = (u * reference.abs() + 2 * u * rounded + terms * 2.0 ** -24 * accumulated
             + torch.finfo(dtype).tiny * torch.finfo(dtype).eps)
    return 2 * bound


class MoeRsTrial(Trial):
    """h, w, the topk weights, out, and a handle whose layout the routing step writes in `fill` (a
    buffer of its own, so that a captured call reads the layout of each replay's routing)."""

    def __init__(self, call, world):
        self.spec, self.world = call, world
        tokens, k, n, experts, topk = call.shape
        device, W = world.device, world.world_size
        self.h = torch.empty(W * tokens * topk, n, dtype=call.dtype, device=device)
        self.w = torch.empty(experts, n, k, dtype=call.dtype, device=device)
        self.weights = torch.empty(tokens, topk, device=device)
        self.out = torch.empty(tokens, k, dtype=call.dtype, device=device)
        self.router = routing.Router(tokens, topk, experts, ranks_of())
        layout = torch.empty(routing.MoEHandle.numel(W, tokens, topk, experts), dtype=torch.int32, device=device)
        self.handle = routing.MoEHandle(layout, W, tokens, topk, experts)

    def fill(self, seed):
        W, me, device, dtype = self.world.world_size, self.world.rank, self.world.device, self.spec.dtype
        tokens, k, n, experts, topk = self.spec.shape
        layout = Layout.draw(seed, self.world, self.spec.shape)
        self.handle.layout.copy_(self.router(layout.topk_idx[me * tokens:(me + 1) * tokens].contiguous()).layout)
        hs = [random_tensor(tuple(self.h.shape), dtype, seed_of(seed, rank, "h"), device) for rank in range(W)]
        ws = [expert_weights((experts, n, k), dtype, seed_of(seed, rank, "w"), device, layout.sizes)
              for rank in range(W)]
        g = torch.Generator(device).manual_seed(seed_of(seed, me, "weights"))
        weights = torch.rand(tokens, topk, generator=g, device=device)
        rows = layout.row_of_pair.view(W, tokens, topk)[me]  # of this rank's pairs
        factor = weights.double()[..., None]
        reference = rounded = accumulated = torch.zeros(tokens, k, dtype=torch.float64, device=device)
        for h, w in zip(hs, ws):  # every rank's part
            products = grouped_products(h, w, layout.ends)[rows].double()
            reference = reference + (factor * products).sum(1)
            rounded = rounded + (factor * products.abs()).sum(1)
            accumulated = accumulated + (factor * grouped_products(h.abs(), w.abs(), layout.ends)[rows]).sum(1)
        expected = Expected(reference, moe_rs_tolerance(reference, rounded, accumulated, dtype, n + topk + W),
                            where=lambda i: f"token {i // k}, column {i % k}")
        poison(self.out, expected)
        self.h.copy_(hs[me])
        self.w.copy_(ws[me])
        self.weights.copy_(weights)
        return expected

    def build(self):
        tokens, k, n, experts, topk = self.spec.shape
        return ops.MoEReduceScatter(tokens, n, k, experts, topk, self.spec.dtype, config=self.spec.config,
                                    tile_order=self.spec.method)

    def call(self, op):
        if op is None:
            return ops.moe_rs(self.h, self.w, self.handle, self.weights, self.out, config=self.spec.config,
                              tile_order=self.spec.method)
        return op(self.h, self.w, self.handle, self.weights, self.out)

    def free(self):
        self.router.free()


for _cases in (GroupedGemmCases(), AgMoeCases(), MoeRsCases()):
    register(_cases)
