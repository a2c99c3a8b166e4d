"""Stress cases of expert parallelism (`tridist.ops.moe`): the all-to-all-v in its three layouts,
and EPBuffer's dispatch followed by its combine.

- all_to_all_v, method = the layout: "rank" (`all_to_all_v`), "expert" (`all_to_all_v_2d`, with
  major_align 1 or 4, in `config`) and "expert_offset" (`all_to_all_v_2d_offset`: chunks at given
  offsets of an expert-major x, with padding between them, in expert order or shuffled); every
  dtype of `alltoall.DTYPES`, rows of no, one or two dimensions, 1 to 4 experts per rank, out
  from just big enough for the call's worst case down to a few rows (the splits are then drawn to
  fit it). Every rank draws every rank's splits from the call's seed, with empty chunks, all rows
  to one chunk, none at all. Exact: the rows the op defines (gathered from out where the
  reference says they land, poisoned before the call), the row just past out (which it must not
  touch), and the returned int64 splits and offsets, compared as bytes.
- ep_dispatch_combine: one `EPBuffer` dispatch, identity experts, then the combine, as
  tests/test_expert_parallel.py does. method "normal" (the expert output is recv_x times the sum
  of its local weights) or "low_latency" (the output is recv_x itself; with or without
  `return_recv_hook`, in `config`; dtype float8_e4m3fn: `use_fp8`, dequantized before the
  combine). Tokens per rank from 0 to the buffer's max, top-k distinct experts with -1 entries,
  1 to 4 experts per rank; routing drawn per call (and per graph replay) alike on every rank.
  The combined tokens must be x times the sum of their valid weights within `ep_tolerance`; what
  the dispatch returns must be exact (with identity experts, a token sent to the wrong local expert
  comes back right from the combine): the received pairs per local expert (recv_tokens_per_expert,
  recv_count), and the received rows, in normal mode with their local expert ids (all of recv_idx:
  -1 past the rows received) and weights, in low-latency mode each expert's packed rows (fp8:
  dequantised, within e4m3's rounding of the token's values). The rows expected come from
  `tridist.bench.ep`'s `normal_receipt` and `low_latency_receipt`, on every rank's inputs.

Shapes (`Call.shape`): all_to_all_v (rows of x, rows of out, experts per rank, *row shape);
ep_dispatch_combine (hidden, experts per rank, topk, max tokens per rank, tokens of rank 0, 1, ...),
fixed for a call so that graph replays keep them: only the data, splits and routing change.

Both ops are of family "moe", their module in tridist.ops (`--ops moe` selects them, with ag_moe
and moe_rs of `moe_tp.py`). An fp8 dispatch is drawn only where every rank has tokens: `use_fp8`
on an empty x raises in `EPBuffer._payload` (the plan lists such draws as invalid).
"""
import math
import random

import torch

from tridist import ops
from tridist.bench.ep import low_latency_receipt, normal_receipt
from tridist.ops.moe.all_to_all import op as alltoall
from tridist.ops.moe.expert_parallel import low_latency

from .cases import (Expected, Invalid, OpCases, Trial, _UNIT_ROUNDOFF, composition, count_with_edges, log_uniform,
                    random_tensor, register, seed_of)

ALIGNS = (1, 4)          # major_align of the "expert" layout
MAX_EXPERTS_PER_RANK = 4
MAX_WIDTH = 8192         # elements of an all-to-all row at most (several tiles of the all-to-all's TILE // BLOCK_R)
MAX_TOPK = 8
# In the emulator these ops cost far more a call than a collective does (about 0.2 s for an
# all_to_all_v, 0.3 s for a dispatch and combine, at 2 ranks on 2 cores, against 0.04 s: their
# co-resident launches run long kernels on a thread a program), and more with rows (a low-latency
# dispatch and combine of 32 tokens x top-4: 1.6 s): there they take fewer rows than `Limits` allow,
# all_to_all_v's rows of x, EPBuffer's tokens per rank and hidden.
EMULATOR_ROWS, EMULATOR_TOKENS, EMULATOR_HIDDEN = 16, 8, 256


# ---- all_to_all_v --------------------------------------------------------------------------------
class AllToAllVCases(OpCases):
    name, family = "all_to_all_v", "moe"

    def draw(self, rng, world, limits):
        layout = rng.choice(alltoall.LAYOUTS)
        dtype = rng.choice(alltoall.DTYPES)
        experts = 1 if layout == "rank" else rng.randint(1, MAX_EXPERTS_PER_RANK)
        align = rng.choice(ALIGNS) if layout == "expert" else 1
        width = log_uniform(rng, 1, max(1, min(MAX_WIDTH, limits.nbytes // dtype.itemsize)))
        dims = rng.choice((0, 1, 1, 2)) if width == 1 else rng.choice((1, 1, 2))
        if dims == 0:
            row_shape = ()
        elif dims == 1:
            row_shape = (width,)
        else:
            first = rng.choice([d for d in range(1, width + 1) if width % d == 0])
            row_shape = (first, width // first)
        most_rows = limits.rows if world.device.type == "cuda" else min(limits.rows, EMULATOR_ROWS)
        rows = log_uniform(rng, 1, max(1, min(most_rows, limits.nbytes // (width * dtype.itemsize))))
        # Room for the worst case (every rank sends all its rows here; each expert padded to
        # major_align), or, half the time, less: the splits are then drawn to fit it.
        most = world.world_size * rows + experts * align
        least = experts * align if layout == "expert" else 1
        out_rows = most if rng.random() < 0.5 else log_uniform(rng, least, most)
        return dict(method=layout, dtype=dtype, shape=(rows, out_rows, experts, *row_shape),
                    config={"major_align": f"major_align={align}"} if layout == "expert" else None)

    def trial(self, call, world):
        return AllToAllVTrial(call, world)


class AllToAllVTrial(Trial):
    """x, the splits (and offsets) on the device, and out with one row more: the op gets out[:out_rows];
    the last row holds a pattern it must leave alone. `call` returns the bytes of out's rows that
    the op defines, gathered (`self.index`, a fixed number of rows, the rest pointing at the
    guard row) in the reference's order, then the bytes of the returned int64 splits and offsets."""

    def __init__(self, call, world):
        self.spec, self.world = call, world
        rows, out_rows, experts, *row_shape = call.shape
        self.rows, self.out_rows, self.experts, self.row_shape = rows, out_rows, experts, tuple(row_shape)
        self.layout = call.method
        self.align = int(call.config["major_align"].split("=")[1]) if call.config else 1
        device = world.device
        self.chunks = world.world_size * experts
        self.x = torch.empty((rows, *row_shape), dtype=call.dtype, device=device)
        self.full = torch.empty((out_rows + 1, *row_shape), dtype=call.dtype, device=device)
        self.out = self.full[:out_rows]
        self.row_bytes = max(1, math.prod(row_shape)) * call.dtype.itemsize
        self.splits = torch.zeros((2, self.chunks) if self.layout == "expert_offset" else (self.chunks,),
                                  dtype=torch.int64, device=device)
        self.index = torch.full((out_rows,), out_rows, dtype=torch.int64, device=device)

    def _bytes(self, t: torch.Tensor) -> torch.Tensor:
        """`t` (rows of this call's row shape) as rows of bytes."""
        return t.reshape(t.shape[0], -1).view(torch.uint8).reshape(t.shape[0], self.row_bytes)

    def _draw_splits(self, rng: random.Random) -> tuple[list, list]:
        """Every rank's (counts, offsets in its x) per chunk, in the layout's indexing, such that each
        rank's chunks fit its x and what arrives at each rank fits out."""
        W, G, rows = self.world.world_size, self.experts, self.rows
        counts = [composition(rng, count_with_edges(rng, rows), W * G) for _ in range(W)]

        def chunk(source, dest, expert):  # index of chunk (dest, expert) in source's splits
            return expert * W + dest if self.layout == "expert_offset" else dest * G + expert

        def arriving(dest):
            per_expert = [sum(counts[s][chunk(s, dest, e)] for s in range(W)) for e in range(G)]
            if self.layout == "expert":
                return sum(max(-(-n // self.align), 1) * self.align for n in per_expert)
            return sum(per_expert)

        for dest in range(W):  # out too small for what was drawn: take rows off random chunks until it fits
            while arriving(dest) > self.out_rows:
                full = [(s, e) for s in range(W) for e in range(G) if counts[s][chunk(s, dest, e)]]
                s, e = rng.choice(full)
                counts[s][chunk(s, dest, e)] -= rng.randint(1, counts[s][chunk(s, dest, e)])
        offsets = []
        for source in range(W):
            sizes = counts[source]
            if self.layout != "expert_offset":  # packed, rank-major
                offsets.append([sum(sizes[:i]) for i in range(W * G)])
                continue
            # Expert-major chunks (or, half the time, in a shuffled order) with random padding between.
            order = list(range(W * G))
            if rng.random() < 0.5:
                rng.shuffle(order)
            slack = rows - sum(sizes)
            cuts = sorted(rng.randint(0, slack) for _ in range(W * G))
            at, place, previous = 0, [0] * (W * G), 0
            for i, cut in zip(order, cuts):
                at += cut - previous
                previous = cut
                place[i] = at
                at += sizes[i]
            offsets.append(place)
        return counts, offsets

    def _reference(self, counts, offsets):
        """(the rows that arrive here, in out's order: (out row, source, row of the source's x,
        expert, row within the chunk); the returned [splits, offsets])."""
        W, G, me = self.world.world_size, self.experts, self.world.rank
        arrived, result = [], [[0] * (W * G), [0] * (W * G)]
        if self.layout == "expert":
            base = 0
            for e in range(G):
                at = base
                for s in range(W):
                    n, start = counts[s][me * G + e], offsets[s][me * G + e]
                    result[0][e * W + s], result[1][e * W + s] = n, at
                    arrived += [(at + i, s, start + i, e, i) for i in range(n)]
                    at += n
                base += max(-(-(at - base) // self.align), 1) * self.align
        else:
            at = 0
            for s in range(W):
                for e in range(G):
                    i = e * W + me if self.layout == "expert_offset" else me * G + e
                    n, start = counts[s][i], offsets[s][i]
                    result[0][s * G + e], result[1][s * G + e] = n, at
                    arrived += [(at + r, s, start + r, e, r) for r in range(n)]
                    at += n
        return arrived, result

    def fill(self, seed):
        W, device = self.world.world_size, self.world.device
        counts, offsets = self._draw_splits(random.Random(seed_of(seed, "splits")))
        xs = [random_tensor(tuple(self.x.shape), self.spec.dtype, seed_of(seed, rank), device) for rank in range(W)]
        arrived, result = self._reference(counts, offsets)
        me = self.world.rank
        self.x.copy_(xs[me])
        if self.layout == "expert_offset":
            self.splits.copy_(torch.tensor([counts[me], offsets[me]], dtype=torch.int64))
        else:
            self.splits.copy_(torch.tensor(counts[me], dtype=torch.int64))

        # Gather list: the rows that arrive, then the guard row (index out_rows) for the rest.
        targets = [row for row, *_ in arrived]
        self.index.copy_(torch.tensor(targets + [self.out_rows] * (self.out_rows - len(arrived)), dtype=torch.int64))
        guard = torch.randint(0, 256, (1, self.row_bytes), dtype=torch.uint8, device=device,
                              generator=torch.Generator(device).manual_seed(seed_of(seed, "guard")))
        everyone = torch.cat([self._bytes(x) for x in xs])  # every rank's x, as rows of bytes
        sent = everyone[torch.tensor([s * self.rows + r for _, s, r, _, _ in arrived], dtype=torch.int64,
                                     device=device)]
        rows = torch.cat([sent, guard.expand(self.out_rows - len(arrived), -1)])
        returned = torch.tensor(result, dtype=torch.int64, device=device).view(torch.uint8).reshape(-1)
        reference = torch.cat([rows.reshape(-1), returned])

        # Poison: the rows that must be written hold the complement of what must arrive; the others
        # (unspecified) an arbitrary pattern; the guard row its pattern.
        full = self._bytes(self.full)
        full.fill_(0xA5)
        full[torch.tensor(targets, dtype=torch.int64, device=device)] = ~sent
        full[self.out_rows] = guard[0]

        def where(i: int) -> str:
            row, byte = divmod(i, self.row_bytes)
            if row < len(arrived):
                target, source, _, expert, within = arrived[row]
                chunk = f" for local expert {expert}" if self.layout == "expert" else \
                    f" of its expert {expert}" if self.experts > 1 else ""
                return f"out row {target}, byte {byte}: rank {source}'s row {within}{chunk}"
            if row < self.out_rows:
                return f"byte {byte} of the row past out, which the call must not write"
            word, byte = divmod(i - self.out_rows * self.row_bytes, 8)
            kind, entry = divmod(word, W * self.experts)
            name = ("splits", "offsets")[kind]
            return f"byte {byte} of the returned {name}[{entry}]"

        return Expected(reference, where=where)

    def build(self):
        c = self.spec
        return ops.AllToAllV(self.rows, self.out_rows, self.row_shape, c.dtype, self.experts, self.layout)

    def call(self, op):
        if op is not None:
            result = op(self.x, self.splits, self.out, self.align) if self.layout == "expert" else \
                op(self.x, self.splits, self.out)
        elif self.layout == "rank":
            result = ops.all_to_all_v(self.x, self.splits, self.out)
        elif self.layout == "expert":
            result = ops.all_to_all_v_2d(self.x, self.splits, self.out, major_align=self.align)
        else:
            result = ops.all_to_all_v_2d_offset(self.x, self.splits, self.out)
        rows = self._bytes(self.full).index_select(0, self.index)
        return torch.cat([rows.reshape(-1), result.reshape(-1).view(torch.uint8)])


# ---- EPBuffer ------------------------------------------------------------------------------------
def ep_tolerance(reference: torch.Tensor, magnitude: torch.Tensor, terms: int, quantised: torch.Tensor | float = 0.0
                 ) -> torch.Tensor:
    """Per-element bound for combined tokens: `reference` = x * the sum of each token's valid
    weights, `magnitude` = |x| * the sum of their |weights|, `terms` = topk + world size,
    `quantised` = what fp8 may have moved the dispatched values, times the weights.

    Normal mode: each rank that got the token returns bf16(x * the sum of its local weights): a
    bf16 rounding of each part, u |part|, the parts' |.| summing to at most `magnitude`; the
    combine adds the parts in fp32 (with the weights' fp32 sums, fewer than `terms` roundings of
    2^-24 of the magnitude) and rounds once to bf16: u |reference|. Low-latency mode: one fp32 sum
    of w_k x, rounded once, within the same bound. Twice that is allowed (second-order terms),
    plus bf16's smallest subnormal (results near zero). With weights in [0.5, 1.5) `magnitude` is
    |reference|, so bf16 gets 4u = 1.6% of the value, while a pair that went missing or twice moves
    a token by a weight of at least 0.5 in a sum of at most 1.5 MAX_TOPK: over 4% of it, in every
    column. (fp8's bound, about 16%, finds misrouted tokens, not always a lost pair: the exact
    counts of pairs received do.)"""
    u = _UNIT_ROUNDOFF[torch.bfloat16]
    bound = (u * reference.abs() + (u + terms * 2.0 ** -24) * magnitude + quantised
             + torch.finfo(torch.bfloat16).tiny * torch.finfo(torch.bfloat16).eps)
    return 2 * bound


def e4m3_error(x: torch.Tensor) -> torch.Tensor:
    """Per-element bound of what `use_fp8` moves the values of tokens `x` [..., hidden] by: e4m3
    keeps 3 bits, 2^-4 of |x|; the token's scale per 128 columns maps the group's largest |x| to 448,
    and below e4m3's normals (2^-6) values land on multiples of 2^-9: half a step, 2^-10 scale =
    2^-10 / 448 of the group's largest."""
    magnitude = x.double().abs()
    groups = magnitude.unflatten(-1, (-1, low_latency.FP8_GROUP))
    floor = (groups.amax(-1, keepdim=True) * 2.0 ** -10 / low_latency.FP8_MAX).expand_as(groups)
    return 2.0 ** -4 * magnitude + floor.flatten(-2)


class EPCases(OpCases):
    name, family = "ep_dispatch_combine", "moe"
    forms = ("class",)  # EPBuffer has no function

    def draw(self, rng, world, limits):
        method = rng.choice(("normal", "low_latency"))
        fp8 = method == "low_latency" and rng.random() < 0.25
        experts = rng.randint(1, MAX_EXPERTS_PER_RANK)
        topk = rng.randint(1, min(MAX_TOPK, world.world_size * experts))
        itemsize = torch.bfloat16.itemsize
        gpu = world.device.type == "cuda"
        widest = min(8192 if gpu else EMULATOR_HIDDEN, limits.nbytes // itemsize)
        if fp8:
            group = low_latency.FP8_GROUP
            if widest < group:
                raise Invalid("ep_dispatch_combine fp8: a token of 128 columns passes the size limit")
            hidden = group * log_uniform(rng, 1, widest // group)
        else:
            hidden = 2 * log_uniform(rng, 1, max(1, widest // 2))
        most = log_uniform(rng, 1, max(1, min(limits.rows if gpu else EMULATOR_TOKENS,
                                              limits.nbytes // (hidden * itemsize))))
        tokens = [0 if rng.random() < 0.15 else most if rng.random() < 0.3 else rng.randint(0, most)
                  for _ in range(world.world_size)]
        hook = method == "low_latency" and rng.random() < 0.5
        return dict(method=method, dtype=low_latency.FP8 if fp8 else torch.bfloat16,
                    shape=(hidden, experts, topk, most, *tokens),
                    config={"return_recv_hook": "return_recv_hook"} if hook else None)

    def trial(self, call, world):
        return EPTrial(call, world)


class EPTrial(Trial):
    """`call` returns, as float64: the combined tokens, the pairs received per local expert, then
    the received rows (zeros past those received: which rows those are, `self.received`, is set by
    `fill`, so that graph replays with new routing check theirs), and in normal mode the received
    expert ids and weights."""

    def __init__(self, call, world):
        self.spec, self.world = call, world
        self.hidden, self.experts, self.topk, self.most, *self.tokens = call.shape
        self.fp8 = call.dtype == low_latency.FP8
        self.hook = call.config is not None
        device, mine = world.device, self.tokens[world.rank]
        self.x = torch.empty((mine, self.hidden), dtype=torch.bfloat16, device=device)
        self.idx = torch.empty((mine, self.topk), dtype=torch.int64, device=device)
        self.weights = torch.empty((mine, self.topk), dtype=torch.float32, device=device)
        capacity = world.world_size * self.most  # the rows the dispatch returns (per local expert: low latency)
        rows = (capacity,) if call.method == "normal" else (self.experts, capacity)
        self.received = torch.zeros(rows, dtype=torch.bool, device=device)

    def _routing(self, rng: random.Random, tokens: int) -> list[list[int]]:
        """topk distinct experts a token, some -1; now and then every token to one rank's experts."""
        W, G, k = self.world.world_size, self.experts, self.topk
        pool = list(range(W * G))
        if k <= G and rng.random() < 0.2:
            rank = rng.randrange(W)
            pool = pool[rank * G:(rank + 1) * G]
        empty = rng.choice((0.0, 0.2, 0.5))
        return [[-1 if rng.random() < empty else e for e in rng.sample(pool, k)] for _ in range(tokens)]

    def fill(self, seed):
        W, me, device = self.world.world_size, self.world.rank, self.world.device
        rng = random.Random(seed_of(seed, "routing"))
        routing = [self._routing(rng, n) for n in self.tokens]
        xs = [random_tensor((n, self.hidden), torch.bfloat16, seed_of(seed, r), device)
              for r, n in enumerate(self.tokens)]
        every_weights = [0.5 + torch.rand((n, self.topk), device=device,
                                          generator=torch.Generator(device).manual_seed(seed_of(seed, r, "weights")))
                         for r, n in enumerate(self.tokens)]
        idx_all = torch.tensor([e for tokens in routing for token in tokens for e in token], dtype=torch.int64,
                               device=device).reshape(-1, self.topk)
        x, weights = xs[me], every_weights[me]
        idx = idx_all[sum(self.tokens[:me]):sum(self.tokens[:me + 1])]
        self.x.copy_(x)
        self.idx.copy_(idx)
        self.weights.copy_(weights)

        valid = torch.where(idx >= 0, weights, 0).double()
        reference = x.double() * valid.sum(1, keepdim=True)
        magnitude = x.double().abs() * valid.abs().sum(1, keepdim=True)
        quantised = 0.0
        if self.fp8:  # then bf16 rounds the dequantised value (u of it, in `magnitude`'s term, to first order)
            quantised = e4m3_error(x) * valid.abs().sum(1, keepdim=True)
        tolerance = ep_tolerance(reference, magnitude, self.topk + W, quantised)
        parts = {"combined token": (reference, tolerance),
                 **self._received(torch.cat(xs), idx_all, torch.cat(every_weights))}
        starts = [0]
        for value, _ in parts.values():
            starts.append(starts[-1] + value.numel())

        def where(i: int) -> str:
            part = max(p for p in range(len(parts)) if starts[p] <= i)
            name, (value, _) = list(parts.items())[part]
            index = tuple(int(v) for v in torch.unravel_index(torch.tensor(i - starts[part]), value.shape))
            return f"{name} {index[0]}, column {index[1]}" if name == "combined token" else f"{name} {index}"

        return Expected(torch.cat([value.reshape(-1).double() for value, _ in parts.values()]),
                        torch.cat([(torch.zeros(value.shape, dtype=torch.float64, device=device) if bound is None
                                    else bound).reshape(-1) for value, bound in parts.values()]), where)

    def _received(self, x_all, idx_all, weights_all) -> dict:
        """name -> (what the dispatch must return, its bound per element or None for exact), in the
        order `call` returns them; sets `self.received`, the rows received."""
        me, G = self.world.rank, self.experts
        if self.spec.method == "normal":
            rows, local_ids, weights = normal_receipt(x_all, idx_all, weights_all, me, G)
            n = rows.shape[0]
            self.received.zero_()[:n] = True
            recv_x = torch.zeros((self.received.shape[0], self.hidden), dtype=rows.dtype, device=rows.device)
            recv_idx = torch.full((self.received.shape[0], self.topk), -1, dtype=torch.int64, device=rows.device)
            recv_weights = torch.zeros((self.received.shape[0], self.topk), device=rows.device)
            recv_x[:n], recv_idx[:n], recv_weights[:n] = rows, local_ids, weights
            return {"pairs received by local expert": (torch.bincount(local_ids[local_ids >= 0], minlength=G), None),
                    "received row": (recv_x, None), "received expert ids of row": (recv_idx, None),
                    "received weights of row": (recv_weights, None)}
        token, expert = low_latency_receipt(idx_all, me, G)
        counts = torch.bincount(expert, minlength=G)
        place = torch.arange(token.numel(), device=token.device) - (counts.cumsum(0) - counts)[expert]
        self.received.zero_()[expert, place] = True
        recv_x = torch.zeros((*self.received.shape, self.hidden), dtype=x_all.dtype, device=x_all.device)
        recv_x[expert, place] = x_all[token]
        if not self.fp8:
            return {"pairs received by local expert": (counts, None), "received (expert, row)": (recv_x, None)}
        # Dequantised: e4m3's rounding of each value, then bf16's of the product; twice that allowed.
        bound = 2 * (e4m3_error(recv_x) + _UNIT_ROUNDOFF[torch.bfloat16] * recv_x.double().abs())
        return {"pairs received by local expert": (counts, None), "received (expert, row), dequantised": (recv_x, bound)}

    def build(self):
        return ops.EPBuffer(self.world.world_size * self.experts, self.hidden, self.most, torch.bfloat16)

    def call(self, buffer):
        if self.spec.method == "normal":
            recv_x, recv_idx, recv_weights, per_expert, handle = buffer.dispatch(self.x, self.idx, self.weights)
            y = (recv_x.float() * torch.where(recv_idx >= 0, recv_weights, 0).sum(1, keepdim=True)).to(torch.bfloat16)
            out = buffer.combine(y, handle)
            rows = self.received[:, None]
            return torch.cat([t.double().reshape(-1) for t in (
                out, per_expert, torch.where(rows, recv_x, 0), recv_idx, torch.where(rows, recv_weights, 0))])
        recv_x, per_expert, handle, hook = buffer.low_latency_dispatch(self.x, self.idx, return_recv_hook=self.hook,
                                                                       use_fp8=self.fp8)
        hook()  # does nothing without return_recv_hook
        if self.fp8:
            values, scales = recv_x
            group = low_latency.FP8_GROUP
            y = (values.float().unflatten(-1, (-1, group)) * scales[..., None]).flatten(-2).to(torch.bfloat16)
        else:
            y = recv_x
        out = buffer.low_latency_combine(y, self.idx, self.weights, handle)
        return torch.cat([t.double().reshape(-1) for t in (out, per_expert, torch.where(self.received[..., None], y, 0))])


for _cases in (AllToAllVCases(), EPCases()):
    register(_cases)
