"""`tridist bench ep|alltoall`: expert-parallel dispatch and combine (`EPBuffer`) and the all-to-all-v
with splits on the device (`all_to_all_v`, `all_to_all_v_2d`), each checked first, then timed next to
NCCL and PyTorch in the same run.

ep. Layers (`--layers`, LAYERS): tokens per rank, hidden, top-k, experts, and the mode:
- deepseek-ll: 128 tokens, hidden 7168, top-8 of 256 experts, low-latency mode (decode);
- deepseek: 4096 tokens, the same model, normal mode (prefill);
- mixtral: 4096 tokens, hidden 4096, top-2 of 8 experts, normal mode.
Routing is random (seeded; each token's experts distinct), tokens bf16 and weights float32, all drawn
alike on every rank, so that each rank knows what every peer sends. Checks, on every rank: the
received rows, counts and (normal mode) expert ids and weights exactly; then combine(dispatch(x)) with
identity experts (normal mode: y = recv_x weighted by the token's local weights; low-latency mode:
y = recv_x, the combine weighting) against x * the sum of the token's weights, within TOLERANCE
(fp8 dispatch: FP8_TOLERANCE). Timed, CUDA-graph captured (`op_us`): dispatch alone, combine alone
(of one dispatch's handle), dispatch then combine with y = recv_x (no compute between), and in
low-latency mode the same with `use_fp8=True` (the combine still takes bf16). Columns:
- us: the slowest rank's median microseconds per call;
- MB: the payload of one way per rank (mean over ranks): the received rows, tokens x hidden x 2 bytes
  in normal mode, (token, expert) pairs x hidden x 2 in low-latency mode (fp8: pairs x (hidden + 4
  bytes of scale per 128 columns)); dispatch then combine moves both ways;
- GB/s: bytes read and written per second, 2 x payload / time, the convention of the copy's rate
  (DESIGN.md's 3021 GB/s); `of copy`: that over the rate of a device-to-device copy of 1 GiB, far
  more than L2 holds, timed in the same run;
- torch us, vs torch: the plain PyTorch steps on this rank's tokens (dispatch: argsort the pairs by
  expert, index_select the rows; combine: index_add_ of the weighted rows in fp32), CUDA-graph timed,
  over tridist's time. At world 1 that is the whole job; with several ranks only its local part. The
  fp8 rows are compared with the same bf16 steps: the same job;
- NCCL us, vs NCCL: what most frameworks run today: the pairs sorted as above, their counts per rank
  exchanged with `all_to_all_single` and read on the host (`.tolist()`), then `all_to_all_single` of
  the rows (and back, then the weighted index_add_). The host read cannot be captured in a CUDA graph,
  so these are timed eagerly with CUDA events (`time_us`, no graph), combine included. NCCL leaves
  the received rows grouped by source, not by expert as tridist does: it does less work.
Targets at world 1 (`targets met`, bf16 rows): of copy >= 0.6 and vs torch >= 5.

alltoall. Sizes (`--sizes`): rows per rank of `--hidden` bf16 elements, every rank's splits random
(seeded) and summing to its rows; `all_to_all_v` (1d: one chunk per rank) and `all_to_all_v_2d` (2d:
`--experts-per-rank` chunks per rank, received expert-major, major_align 1). Checked exactly against
the rows cut on the host's copy of every rank's splits, the output poisoned with NaN first (rows past
those received must stay so), and the returned splits and offsets. Timed with `op_us`; NCCL
`all_to_all_single` with the splits exchanged and read on the host, eagerly (as above; it does not
regroup the 2d rows by expert); PyTorch's `torch.ops.symm_mem.all_to_all_vdev(_2d)` on symmetric
copies, checked the same way first (in both, as in PyTorch's 2d layout, an expert that receives
nothing takes a row), where this PyTorch has it and it runs, else the reason is printed. GB/s: the bytes a
rank sends per second. Each size's staging takes 2 x world x rows x hidden
x 2 bytes of the symmetric heap: raise TRIDIST_HEAP_SIZE for the largest sizes at 4 ranks and more.

Ranks sharing a GPU (TRIDIST_RANKS_PER_GPU > 1) and the emulator: the checks of tridist's ops and of
the plain PyTorch steps only; no NCCL, nothing timed, nothing saved.
"""
import argparse

import torch
import torch.distributed as dist

import tridist
from tridist import ops
from tridist.ops.moe.expert_parallel.low_latency import FP8_GROUP

from . import shared_gpu
from .results import error_line, relative_error, save, table
from .timing import GRAPH_LIMIT_US, all_ranks, copy_rate, op_us, print_kernels, slowest, time_us

LAYERS = {"deepseek-ll": ("ll", 128, 7168, 8, 256), "deepseek": ("normal", 4096, 7168, 8, 256),
          "mixtral": ("normal", 4096, 4096, 2, 8)}
MODES = ("ll", "normal")
TOLERANCE = 2e-2       # bf16 out, of sums taken in fp32
FP8_TOLERANCE = 7e-2   # e4m3 rounds a value by up to 2^-4 of itself, and the bf16 out by 2^-8 more
TARGETS = {"of copy": 0.6, "vs torch": 5.0}
SIZES = (128, 1024, 8192, 32768)
HIDDEN = 7168
EXPERTS_PER_RANK = 8
EAGER = "timed eagerly: its splits are read on the host, which a CUDA graph cannot capture"
# EPBuffer's calls are CUDA-graph capturable by contract: graph-timed up to 20 ms, since a round trip
# whose host work took about 1 ms a call was timed eagerly at that (not its GPU time) past 1 ms.
CAPTURABLE_LIMIT_US = 20000.0


def parse_layers(text: str) -> list[tuple]:
    """'deepseek-ll,ll:TxHxKxE' -> [(name, mode, tokens, hidden, topk, experts), ...]; an argparse `type`."""
    layers = []
    for spec in text.split(","):
        spec = spec.strip().lower()
        if spec in LAYERS:
            layers.append((spec, *LAYERS[spec]))
            continue
        mode, _, sizes = spec.partition(":")
        parts = sizes.split("x")
        if mode not in MODES or len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"layer {spec!r}: one of {', '.join(LAYERS)}, or MODE:TxHxKxE (mode ll "
                                             "or normal; tokens per rank, hidden, top-k, experts as four positive "
                                             "integers), e.g. ll:128x7168x8x256")
        tokens, hidden, topk, experts = (int(p) for p in parts)
        if topk > experts:
            raise argparse.ArgumentTypeError(f"layer {spec!r}: top-{topk} of {experts} experts")
        layers.append((spec, mode, tokens, hidden, topk, experts))
    return layers


def parse_sizes(text: str) -> list[int]:
    """'128,1024' -> [128, 1024]; an argparse `type`."""
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"sizes {text!r}: rows per rank as positive integers, e.g. 128,1024")
    return [int(p) for p in parts]


def _random(shape, seed: int, device) -> torch.Tensor:
    """bf16 values near 1, the same on every rank for the same seed."""
    return torch.randn(shape, generator=torch.Generator(device).manual_seed(seed), device=device).to(torch.bfloat16)


def _check(what: str, error: float, tolerance: float) -> None:
    """Raises on every rank when any rank's relative error passes `tolerance`."""
    error = slowest(error)
    if error > tolerance:
        raise AssertionError(f"{what}: relative error {error:.2e} (tolerance {tolerance:.0e})")


def _check_exact(what: str, ok: bool) -> None:
    """Raises on every rank when any rank's data movement went wrong."""
    if not all_ranks(ok):
        raise AssertionError(f"{what}: wrong rows, counts or layout on some rank")


def _eager_us(fn) -> float:
    """The slowest rank's median microseconds of `fn()` without a CUDA graph (it reads the host)."""
    return slowest(time_us(fn, inner=10, repetitions=15, warmup=3))


# ---- ep ----------------------------------------------------------------------------------------------
def normal_receipt(x_all, idx_all, weights_all, rank: int, experts_local: int):
    """What `rank` must receive from `EPBuffer.dispatch`, given every rank's tokens, expert ids (-1:
    none) and weights concatenated in rank order: (rows, their expert ids among `rank`'s (-1: another
    rank's), their weights), every token with an expert on `rank`, rank 0's first, in token order.
    Shared with the stress run (`tridist/stress/alltoall.py`)."""
    here = (idx_all // experts_local == rank).any(1)  # -1 // experts_local is -1: no rank's
    ids = idx_all[here]
    local_ids = torch.where(ids // experts_local == rank, ids - rank * experts_local, -1)
    return x_all[here], local_ids, weights_all[here]


def low_latency_receipt(idx_all, rank: int, experts_local: int):
    """(row of every rank's tokens, local expert) of each (token, expert) pair `rank`'s experts
    receive from `EPBuffer.low_latency_dispatch`, given every rank's expert ids (-1: none)
    concatenated in rank order: expert-major, within an expert in that order (rank 0's first), as
    the dispatch packs them. Shared with the stress run."""
    topk = idx_all.shape[1]
    flat = idx_all.reshape(-1)
    token = torch.arange(flat.numel(), device=flat.device) // topk
    here = flat // experts_local == rank
    token, expert = token[here], flat[here] - rank * experts_local
    order = torch.sort(expert * idx_all.shape[0] + token).indices
    return token[order], expert[order]


class _Layer:
    """Every rank's tokens, routing and weights (drawn alike on every rank), this rank's share, and what
    this rank must receive."""

    def __init__(self, mode, tokens, hidden, topk, experts, world, device):
        if experts % world.world_size:
            raise ValueError(f"{experts} experts do not split evenly over {world.world_size} ranks")
        self.mode, self.tokens, self.hidden, self.topk, self.experts = mode, tokens, hidden, topk, experts
        self.world_size, self.rank = world.world_size, world.rank
        self.local = experts // world.world_size
        everyone = world.world_size * tokens
        self.x_all = _random((everyone, hidden), 1, device)
        g = torch.Generator(device).manual_seed(2)
        self.idx_all = torch.rand(everyone, experts, generator=g, device=device).argsort(1)[:, :topk].contiguous()
        self.weights_all = torch.rand(everyone, topk, generator=g, device=device)
        mine = slice(self.rank * tokens, (self.rank + 1) * tokens)
        self.x, self.idx, self.weights = (t[mine].contiguous() for t in (self.x_all, self.idx_all, self.weights_all))
        self.expected = (self.x.float() * self.weights.sum(1, keepdim=True)).to(torch.bfloat16)

    def per_expert(self) -> torch.Tensor:
        """Pairs each local expert receives."""
        return torch.bincount(low_latency_receipt(self.idx_all, self.rank, self.local)[1], minlength=self.local)

    def payload(self, fp8: bool = False) -> float:
        """Bytes of received rows per rank, the mean over ranks (one way)."""
        if self.mode == "ll":
            row = self.hidden + 4 * (self.hidden // FP8_GROUP) if fp8 else 2 * self.hidden
            return self.tokens * self.topk * row
        ranks_per_token = (self.idx_all // self.local).sort(1).values.diff(1).ne(0).sum(1) + 1
        return int(ranks_per_token.sum()) * 2 * self.hidden / self.world_size


def _check_normal(buffer: ops.EPBuffer, layer: _Layer, name: str):
    """Checks dispatch and combine in normal mode; returns what timing them needs: (y, handle)."""
    recv_x, recv_idx, recv_weights, per_expert, handle = buffer.dispatch(layer.x, layer.idx, layer.weights)
    rows, local_ids, weights = normal_receipt(layer.x_all, layer.idx_all, layer.weights_all, layer.rank, layer.local)
    received = rows.shape[0]
    _check_exact(f"ep {name} dispatch", torch.equal(recv_x[:received], rows)
                 and torch.equal(recv_idx[:received], local_ids)
                 and torch.equal(recv_weights[:received], weights)
                 and bool((recv_idx[received:] == -1).all()) and torch.equal(per_expert, layer.per_expert()))
    y = (recv_x.float() * (recv_weights * (recv_idx >= 0)).sum(1, keepdim=True)).to(torch.bfloat16)
    _check(f"ep {name} combine(dispatch(x))", relative_error(buffer.combine(y, handle), layer.expected), TOLERANCE)
    return y, handle


def _check_ll(buffer: ops.EPBuffer, layer: _Layer, name: str):
    """Checks the low-latency dispatch (bf16 and fp8) and combine; returns (y, handle) of the bf16 one."""
    token, _ = low_latency_receipt(layer.idx_all, layer.rank, layer.local)
    counts = layer.per_expert()
    recv_x, recv_count, handle, _ = buffer.low_latency_dispatch(layer.x, layer.idx)
    packed = torch.arange(recv_x.shape[1], device=recv_x.device)[None, :] < recv_count[:, None]
    _check_exact(f"ep {name} low_latency_dispatch", torch.equal(recv_count.long(), counts)
                 and torch.equal(recv_x[packed], layer.x_all[token]))
    out = buffer.low_latency_combine(recv_x, layer.idx, layer.weights, handle)
    _check(f"ep {name} low_latency_combine(low_latency_dispatch(x))", relative_error(out, layer.expected), TOLERANCE)
    if layer.hidden % FP8_GROUP == 0:
        (values, scales), recv_count, fp8_handle, _ = buffer.low_latency_dispatch(layer.x, layer.idx, use_fp8=True)
        _check_exact(f"ep {name} low_latency_dispatch fp8 counts", torch.equal(recv_count.long(), counts))
        groups = values.float().unflatten(-1, (-1, FP8_GROUP)) * scales[..., None]
        out = buffer.low_latency_combine(groups.flatten(-2).to(torch.bfloat16), layer.idx, layer.weights, fp8_handle)
        _check(f"ep {name} low_latency_combine(low_latency_dispatch(x, use_fp8=True))",
               relative_error(out, layer.expected), FP8_TOLERANCE)
    return recv_x, handle


def torch_dispatch(x: torch.Tensor, topk_idx: torch.Tensor):
    """The plain PyTorch dispatch: (the pairs' rows sorted by expert, the pairs' order)."""
    order = topk_idx.reshape(-1).argsort(stable=True)
    return x.index_select(0, order // topk_idx.shape[1]), order


def torch_combine(y: torch.Tensor, order: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """The plain PyTorch combine: each token's rows (in `order`), weighted, summed in fp32."""
    topk = topk_weights.shape[1]
    weighted = y.float() * topk_weights.reshape(-1)[order, None]
    total = torch.zeros(topk_weights.shape[0], y.shape[1], device=y.device)
    return total.index_add_(0, order // topk, weighted).to(y.dtype)


class _Nccl:
    """Dispatch and combine as frameworks run them on NCCL: pairs sorted by expert (so by rank), the
    counts per rank exchanged and read on the host, then `all_to_all_single` of the rows."""

    def __init__(self, layer: _Layer):
        self.layer = layer
        self.ones = torch.ones(layer.idx.numel(), dtype=torch.int64, device=layer.x.device)

    def dispatch(self):
        layer = self.layer
        rows, order = torch_dispatch(layer.x, layer.idx)
        counts = torch.zeros(layer.world_size, dtype=torch.int64, device=rows.device)
        counts.index_add_(0, layer.idx.reshape(-1) // layer.local, self.ones)
        arriving = torch.empty_like(counts)
        dist.all_to_all_single(arriving, counts)
        sent, received = counts.tolist(), arriving.tolist()
        recv = rows.new_empty((sum(received), layer.hidden))
        dist.all_to_all_single(recv, rows, received, sent)
        return recv, order, sent, received

    def combine(self, y, order, sent, received):
        back = y.new_empty((sum(sent), self.layer.hidden))
        dist.all_to_all_single(back, y, sent, received)
        return torch_combine(back, order, self.layer.weights)


def ep_rows(layers, timed: bool = True, kernels: bool = False) -> list[dict]:
    """Each layer checked; with `timed`, a row per step (module docstring), and with `kernels` each
    step's GPU time by kernel printed. Returns the rows (none when not timed); raises AssertionError
    on every rank when a check fails on any."""
    w = tridist.world()
    rows = []
    for name, mode, tokens, hidden, topk, experts in layers:
        layer = _Layer(mode, tokens, hidden, topk, experts, w, w.device)
        buffer = ops.EPBuffer(experts, hidden, tokens)
        y, handle = (_check_ll if mode == "ll" else _check_normal)(buffer, layer, name)
        out = torch_combine(*torch_dispatch(layer.x, layer.idx), layer.weights)
        _check(f"ep {name} torch dispatch+combine", relative_error(out, layer.expected), TOLERANCE)
        if timed:
            rows += _ep_timings(buffer, layer, name, y, handle, kernels)
        tridist.barrier_all()
        buffer.free()
    return rows


def _ep_steps(buffer: ops.EPBuffer, layer: _Layer, y, handle) -> dict:
    """step -> (call, payload bytes it moves) of tridist's steps on `layer`."""
    x, idx, weights = layer.x, layer.idx, layer.weights
    one_way = layer.payload()
    if layer.mode == "normal":
        def round_trip():
            recv_x, *_, recv_handle = buffer.dispatch(x, idx, weights)
            return buffer.combine(recv_x, recv_handle)
        return {"dispatch": (lambda: buffer.dispatch(x, idx, weights), one_way),
                "combine": (lambda: buffer.combine(y, handle), one_way),
                "dispatch+combine": (round_trip, 2 * one_way)}

    def ll_round_trip(fp8: bool):
        def run():
            recv_x, _, recv_handle, _ = buffer.low_latency_dispatch(x, idx, use_fp8=fp8)
            return buffer.low_latency_combine(y if fp8 else recv_x, idx, weights, recv_handle)
        return run
    steps = {"dispatch": (lambda: buffer.low_latency_dispatch(x, idx), one_way),
             "combine": (lambda: buffer.low_latency_combine(y, idx, weights, handle), one_way),
             "dispatch+combine": (ll_round_trip(False), 2 * one_way)}
    if layer.hidden % FP8_GROUP == 0:
        fp8_way = layer.payload(fp8=True)
        steps["fp8 dispatch"] = (lambda: buffer.low_latency_dispatch(x, idx, use_fp8=True), fp8_way)
        steps["fp8 dispatch+combine"] = (ll_round_trip(True), fp8_way + one_way)
    return steps


def _ep_timings(buffer: ops.EPBuffer, layer: _Layer, name: str, y, handle, kernels: bool) -> list[dict]:
    x, idx, weights = layer.x, layer.idx, layer.weights
    copy = copy_rate(x.device)
    sorted_rows, order = torch_dispatch(x, idx)
    nccl = _Nccl(layer)
    _check(f"ep {name} NCCL dispatch+combine", relative_error(nccl.combine(*nccl.dispatch()), layer.expected),
           TOLERANCE)
    recv, nccl_order, sent, received = nccl.dispatch()
    torch_steps = {"dispatch": lambda: torch_dispatch(x, idx),
                   "combine": lambda: torch_combine(sorted_rows, order, weights),
                   "dispatch+combine": lambda: torch_combine(*torch_dispatch(x, idx), weights)}
    nccl_steps = {"dispatch": nccl.dispatch, "combine": lambda: nccl.combine(recv, nccl_order, sent, received),
                  "dispatch+combine": lambda: nccl.combine(*nccl.dispatch())}
    references = {step: {"torch us": op_us(torch_steps[step]), "NCCL us": _eager_us(nccl_steps[step])}
                  for step in torch_steps}
    rows = []
    for step, (call, nbytes) in _ep_steps(buffer, layer, y, handle).items():
        us = op_us(call, CAPTURABLE_LIMIT_US)
        rate = 2 * nbytes / us
        row = {"layer": name, "mode": layer.mode, "step": step, "us": us, "MB": nbytes / 1e6, "GB/s": rate / 1e3,
               "of copy": rate / copy, "copy GB/s": copy / 1e3}
        same_job = references[step.removeprefix("fp8 ")]
        row.update({"torch us": same_job["torch us"], "vs torch": same_job["torch us"] / us,
                    "NCCL us": same_job["NCCL us"], "vs NCCL": same_job["NCCL us"] / us})
        if layer.world_size == 1 and not step.startswith("fp8"):
            row["targets met"] = row["of copy"] >= TARGETS["of copy"] and row["vs torch"] >= TARGETS["vs torch"]
        rows.append(row)
        if layer.rank == 0:
            print(f"  ep {name} {step}: {us:.1f} us, {row['of copy']:.2f} of copy, {row['vs torch']:.2f}x torch, "
                  f"{row['vs NCCL']:.2f}x NCCL", flush=True)
        if kernels:
            print_kernels(f"ep {name} {step}", call, layer.rank)
    return rows


# ---- alltoall ------------------------------------------------------------------------------------------
def random_splits(rows: int, chunks: int, seed: int) -> torch.Tensor:
    """`chunks` random row counts (int64, on the host) summing to `rows`."""
    cuts = torch.randint(0, rows + 1, (chunks - 1,), generator=torch.Generator().manual_seed(seed)).sort().values
    return torch.cat([cuts, torch.tensor([rows])]) - torch.cat([torch.tensor([0]), cuts])


def _x_of(rank: int, rows: int, hidden: int, device) -> torch.Tensor:
    return _random((rows, hidden), 100 + rank, device)


def _expected(every: list[torch.Tensor], me: int, experts: int, rows: int, hidden: int, device):
    """(the chunks rank `me` receives, expert-major; their splits; their offsets, packed), from every
    rank's splits; with one expert a rank, the rank-major layout of `all_to_all_v`."""
    world_size = len(every)
    sources = [_x_of(s, rows, hidden, device) for s in range(world_size)]
    chunks, offsets, at = [], [], 0
    for e in range(experts):
        first = at
        for s, counts in enumerate(every):
            start = int(counts[:me * experts + e].sum())
            chunks.append(sources[s][start:start + int(counts[me * experts + e])])
            offsets.append(at)
            at += chunks[-1].shape[0]
        if experts > 1 and at == first:  # as PyTorch's 2d layout: an empty expert takes a row
            at += 1
    return chunks, [chunk.shape[0] for chunk in chunks], offsets


def _received_right(out: torch.Tensor, result: torch.Tensor, expected) -> bool:
    """Whether `result` holds the expected splits and offsets, `out` each expected chunk at its offset,
    and `out` (poisoned with NaN) is NaN past the chunks."""
    chunks, splits, offsets = expected
    at = result[1].tolist()
    end = max(o + n for o, n in zip(offsets, splits))
    if result[0].tolist() != splits or at != offsets or not bool(out[end:].isnan().all()):
        return False
    return all(torch.equal(out[start:start + chunk.shape[0]], chunk) for start, chunk in zip(at, chunks))


def _torch_vdev(layout: str, x: torch.Tensor, splits: torch.Tensor, out_rows: int):
    """(call, out, out_splits_offsets) of PyTorch's `all_to_all_vdev` ("rank") or `_2d` ("expert") on
    symmetric copies of x and its splits, out with a row more per chunk for the row `_2d` gives an
    expert that receives nothing; raises where this PyTorch has none or refuses them."""
    import torch.distributed._symmetric_memory as symm_mem

    group = dist.group.WORLD.group_name
    op = torch.ops.symm_mem.all_to_all_vdev if layout == "rank" else torch.ops.symm_mem.all_to_all_vdev_2d
    source = symm_mem.empty(tuple(x.shape), dtype=x.dtype, device=x.device).copy_(x)
    in_splits = symm_mem.empty(splits.numel(), dtype=torch.int64, device=x.device).copy_(splits)
    out = symm_mem.empty((out_rows + splits.numel(), x.shape[1]), dtype=x.dtype, device=x.device)
    result = symm_mem.empty((2, splits.numel()), dtype=torch.int64, device=x.device)
    for t in (source, in_splits, out, result):
        symm_mem.rendezvous(t, group)
    return (lambda: op(source, out, in_splits, result, group)), out, result


def alltoall_rows(sizes, hidden: int = HIDDEN, experts: int = EXPERTS_PER_RANK, timed: bool = True) -> list[dict]:
    """Each size checked; with `timed`, a row per (size, layout) (module docstring). Returns the rows
    (none when not timed); raises AssertionError on every rank when a check fails on any."""
    w = tridist.world()
    rows = []
    skipped = set()
    for size in sizes:
        x = _x_of(w.rank, size, hidden, w.device)
        nccl_us = None
        for layout, label, per_rank in (("rank", "1d", 1), ("expert", "2d", experts)):
            chunks = w.world_size * per_rank
            every = [random_splits(size, chunks, size * 1000 + per_rank * 100 + r) for r in range(w.world_size)]
            splits = every[w.rank].to(w.device)
            expected = _expected(every, w.rank, per_rank, size, hidden, w.device)
            what = f"alltoall {label} {size} rows"
            capacity = w.world_size * size + per_rank  # 2d: an expert that receives nothing takes a row
            op = ops.AllToAllV(size, capacity, (hidden,), torch.bfloat16, per_rank, layout)
            out = torch.full((capacity, hidden), float("nan"), dtype=torch.bfloat16, device=w.device)
            _check_exact(what, _received_right(out, op(x, splits, out), expected))
            if timed:
                us = op_us(lambda: op(x, splits, out))
                row = {"rows/rank": size, "layout": label, "MB/rank": x.numel() * 2 / 1e6, "us": us,
                       "GB/s": x.numel() * 2 / us / 1e3}
                if nccl_us is None:
                    nccl_us = _nccl_alltoall_us(x, splits, expected, what)
                row.update({"NCCL us": nccl_us, "vs NCCL": nccl_us / us})
                torch_us = _torch_vdev_us(layout, x, splits, w.world_size * size, expected, what, skipped)
                if torch_us is not None:
                    row.update({"torch us": torch_us, "vs torch": torch_us / us})
                rows.append(row)
                if w.rank == 0:
                    print(f"  {what}: {us:.1f} us, NCCL {nccl_us:.1f} us"
                          + (f", torch {torch_us:.1f} us" if torch_us is not None else ""), flush=True)
            tridist.barrier_all()
            op.free()
    return rows


def _nccl_alltoall_us(x: torch.Tensor, splits: torch.Tensor, expected, what: str) -> float:
    """NCCL `all_to_all_single` with the splits exchanged and read on the host, checked, then timed eagerly."""
    out = x.new_empty((x.shape[0] * dist.get_world_size(), x.shape[1]))

    def run():
        arriving = torch.empty_like(splits)
        dist.all_to_all_single(arriving, splits)
        sent, received = splits.tolist(), arriving.tolist()
        dist.all_to_all_single(out[:sum(received)], x[:sum(sent)], received, sent)
        return sum(received)

    received = run()
    _check_exact(f"{what} NCCL", torch.equal(out[:received], torch.cat(expected[0])))
    return _eager_us(run)


def _torch_vdev_us(layout: str, x, splits, out_rows: int, expected, what: str, skipped: set) -> float | None:
    """PyTorch's all_to_all_vdev(_2d) checked, then timed; None (the reason printed once) where it cannot run."""
    name = "all_to_all_vdev" if layout == "rank" else "all_to_all_vdev_2d"
    if name in skipped:
        return None
    us = why = None
    try:
        call, out, result = _torch_vdev(layout, x, splits, out_rows)
        out.fill_(float("nan"))
        call()
        if not _received_right(out, result, expected):
            why = "wrong result"
    except Exception as error:  # noqa: BLE001 - not in this PyTorch, or it refuses these tensors: no column
        why = error_line(error)
    if all_ranks(why is None):
        try:
            us = op_us(call)
        except Exception as error:  # noqa: BLE001 - e.g. a CUDA graph cannot capture it
            why = f"timing: {error_line(error)}"
    if us is None:
        skipped.add(name)
        if dist.get_rank() == 0:
            print(f"  {what}: torch.ops.symm_mem.{name} skipped from here on ({why or 'failed on another rank'})",
                  flush=True)
    return us


# ---- main ------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tridist bench <ep|alltoall>")
    parser.add_argument("op", choices=["ep", "alltoall"])
    parser.add_argument("--layers", type=parse_layers, default=parse_layers(",".join(LAYERS)),
                        help=f"ep: comma separated: {', '.join(LAYERS)} (default all) or MODE:TxHxKxE, MODE ll or "
                             "normal, e.g. ll:128x7168x8x256")
    parser.add_argument("--sizes", type=parse_sizes, default=list(SIZES),
                        help="alltoall: rows per rank, comma separated (default " + ",".join(map(str, SIZES)) + ")")
    parser.add_argument("--hidden", type=int, default=HIDDEN,
                        help="alltoall: bf16 elements a row (default %(default)s)")
    parser.add_argument("--experts-per-rank", type=int, default=EXPERTS_PER_RANK,
                        help="alltoall: chunks per rank of all_to_all_v_2d (default %(default)s)")
    parser.add_argument("--kernels", action="store_true",
                        help="ep: also print where each step's GPU time goes, by kernel (PyTorch's profiler)")
    parser.add_argument("--out", default="benchmarks/results", help="folder for JSON results (default %(default)s)")
    args = parser.parse_args(argv)
    if args.hidden < 1 or args.experts_per_rank < 1:
        parser.error("--hidden and --experts-per-rank take positive integers")
    w = tridist.init()
    shared = shared_gpu.announce(f"tridist bench {args.op}", w.rank)
    timed = w.backend == "nvshmem" and not shared
    if args.op == "ep":
        rows = ep_rows(args.layers, timed, args.kernels)
        extra = {"layers": [list(layer) for layer in args.layers], "targets": TARGETS}
    else:
        rows = alltoall_rows(args.sizes, args.hidden, args.experts_per_rank, timed)
        extra = {"hidden": args.hidden, "experts_per_rank": args.experts_per_rank, "dtype": "bfloat16"}
    if w.rank == 0:
        if not timed:
            why = "ranks share a GPU" if shared else "no GPU"
            print(f"{args.op}: every check passed; nothing timed ({why})")
        else:
            columns = []
            for row in rows:
                columns += [c for c in row if c not in columns]
            print(table(rows, columns))
            eager_from = f"eager from {GRAPH_LIMIT_US:.0f} us up" + (
                f", EPBuffer's from {CAPTURABLE_LIMIT_US:.0f}" if args.op == "ep" else "")
            print(f"NCCL us: {EAGER}; the other times are CUDA-graph replays ({eager_from})")
            extra = {"world_size": w.world_size, **extra, "NCCL timing": EAGER}
            print(f"saved {save(args.op, rows, args.out, extra)}")
    tridist.finalize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
