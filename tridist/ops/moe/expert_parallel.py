"""Expert parallelism: dispatch tokens to the ranks that hold their experts, and combine the experts'
outputs back, with top-k routing computed on the device (`EPBuffer`, DeepEP's shape of API).

Experts are spread evenly: rank r holds experts r * E_local ... (r + 1) * E_local - 1. A token t
with `topk_idx[t]` = its experts (-1: none) takes two ways, one per mode:

- **normal mode** (prefill, training): a token goes once to every rank that holds one of its
  experts (`dispatch`, `combine`; kernels and protocol in `ep_normal.py`);
- **low-latency mode** (decode): one copy per (token, expert) pair, grouped by expert
  (`low_latency_dispatch`, `low_latency_combine`; kernels and protocol in `ep_low_latency.py`).

Both run the all-to-all family's protocol (`exchange.py`) and route on the device (`sort`).

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

import tridist
from tridist.runtime.tensors import check_tensor

from .. import checks, sizing
from . import exchange, sort
from .ep_low_latency import ll_combine_kernel, ll_dispatch_kernel
from .ep_normal import PROGRESS_EPOCH, combine_kernel, dispatch_kernel

DTYPES = (torch.bfloat16, torch.float16)
FP8 = torch.float8_e4m3fn
FP8_GROUP = 128   # columns that share one fp8 scale
FP8_MAX = 448.0   # the largest e4m3 value
BLOCK_R = 8       # rows a step moves
CHUNK = 4         # steps of the normal mode's sends between two progress words (`ep_normal`)
TILE = 8192       # elements a step moves at most


def _words(t: torch.Tensor) -> torch.Tensor:
    """Tokens as 4-byte words, as the kernels move them."""
    return t.view(torch.int32)


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
        topk_idx: the expert ids the dispatch routed by ([T, topk]; ids out of range as -1).
    """
    mode: str
    tokens: int
    topk: int
    recv_src: torch.Tensor
    recv_layout: torch.Tensor
    positions: torch.Tensor
    topk_idx: torch.Tensor


class _Exchange:
    """The symmetric buffers of one kind of launch of an `EPBuffer`: per slot, staging of `rows` rows
    of `width` elements of `dtype` (and `meta_width` int32 per row, if any) and `count_words` int32
    of counts; an arrival counter per source (`exchange.arrive`); with `progress` a progress word per
    (source, part) and this rank's two counters of claimed blocks (`ep_normal`); the calls counter.
    `kind` names the allocations in the report of a wait that expires on them."""

    def __init__(self, kind: str, rows: int, width: int, dtype: torch.dtype, meta_width: int, count_words: int,
                 splits: int, progress: bool = False):
        w = tridist.world()
        checks.check_offsets("EPBuffer", 2 * rows * max(width, meta_width))
        self.splits = splits
        self.fitted = False
        self.slot_numel = rows * width
        name = f"EPBuffer {kind}"
        self.staging = tridist.symm_zeros((2, self.slot_numel), dtype, name=f"{name} staging")
        self.meta = tridist.symm_zeros((2, rows * meta_width), torch.int32, name=f"{name} meta") if meta_width else None
        self.counts = tridist.symm_zeros((2, count_words), torch.int32, name=f"{name} counts") if count_words else None
        self.arrivals = tridist.signals(w.world_size, name=f"{name} arrivals")
        # Sized for the splits asked for: `fit` only lowers them.
        self.progress = tridist.signals(w.world_size * splits, name=f"{name} progress") if progress else None
        self.claims = torch.zeros(2, dtype=torch.int32, device=w.device) if progress else None
        self.calls = torch.zeros(1, dtype=torch.int64, device=w.device)

    def fit(self, kernel, grid_world: int, args: tuple, meta: dict) -> None:
        """At the first call, shrink the splits to what a co-resident launch of `kernel` (the launch
        whose receiving programs wait for counters its own sending programs raise) can hold. Every
        launch of these buffers then has the same grid, which their call epochs count on."""
        if not self.fitted:
            self.splits = sizing.fit_coresident(kernel, self.splits, grid_world, *args, splits=self.splits,
                                                   **meta)
            self.fitted = True

    def launch(self, kernel, grid_world: int, args: tuple, meta: dict, coresident: bool = True) -> None:
        """Launch `kernel` over (world, splits); co-resident unless it only sends or only receives."""
        self.fit(kernel, grid_world, args, meta)
        kernel[(grid_world, self.splits)](*args, splits=self.splits, coresident=coresident, **meta)

    def free(self) -> None:
        for buffer in (self.staging, self.meta, self.counts, self.arrivals, self.progress):
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

    Expert ids: -1 (none) or 0 ... num_experts - 1. Others are refused with a ValueError where the
    ids can be read on the host without a synchronisation (CPU tensors, the emulator) or one is
    allowed (TRIDIST_DEBUG=1, not while a CUDA graph is captured); elsewhere (GPUs) each is treated
    as -1, the token not sent to that expert, and counted in `dropped_expert_ids`, a device tensor
    the caller can read when it likes.

    Memory per rank, per slot (two slots): normal mode world_size x max_tokens_per_rank rows of
    `hidden` for each way; low-latency mode num_experts x max_tokens_per_rank rows for the
    dispatch and max_tokens_per_rank x topk rows for the combine.

    Args:
        num_experts: experts in all; a multiple of the world size (num_experts // world_size per
            rank: rank r holds experts r * E_local ... (r + 1) * E_local - 1).
        hidden: elements of a token (even; a multiple of 128 for fp8 dispatch).
        max_tokens_per_rank: the most tokens any rank passes to one call.
        dtype: of tokens and expert outputs: bf16 or fp16.

    Attributes:
        dropped_expert_ids: int64 [1] on this rank's device: the expert ids out of range that
            this rank's dispatches treated as -1 since the buffer was built (see above; zero
            where the host checks them).

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
        if max_tokens_per_rank >= PROGRESS_EPOCH.value:
            raise ValueError(f"EPBuffer: max_tokens_per_rank must be below {PROGRESS_EPOCH.value}, got "
                             f"{max_tokens_per_rank}")
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
        self.splits = max(1, sizing.programs_for(w.device) // w.world_size)
        self._exchanges: dict = {}
        self._hook_pending = False
        self._pair_ids = None
        self.dropped_expert_ids = torch.zeros(1, dtype=torch.int64, device=w.device)

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
        if checks.host_reads(topk_idx) and tokens:
            if int(topk_idx.min()) < -1 or int(topk_idx.max()) >= self.num_experts:
                raise ValueError(f"topk_idx holds expert ids from {int(topk_idx.min())} to {int(topk_idx.max())}; "
                                 f"ids are -1 (none) or 0 to {self.num_experts - 1}")
        return tokens, topk

    def _routing(self, topk_idx: torch.Tensor) -> torch.Tensor:
        """The ids a dispatch routes by: `topk_idx` where the host checked it, else a copy with ids
        out of range made -1 and counted in `dropped_expert_ids` (on the device)."""
        if checks.host_reads(topk_idx):
            return topk_idx
        return sort.drop_ids(topk_idx, self.num_experts, self.dropped_expert_ids)

    def _agree(self, call: str, topk_idx, check) -> None:
        """`check()` (this rank's checks of its arguments) with the outcome shared by every rank,
        which must make the same call with the same topk (`checks.agree`)."""
        topk = topk_idx.shape[-1] if isinstance(topk_idx, torch.Tensor) and topk_idx.dim() else -1
        checks.agree("EPBuffer", check, {"call": call, "experts per token (topk)": topk})

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
                made = _Exchange(kind, w.world_size * rows, self.hidden // 2, torch.int32, 2 * topk + 1,
                                 self.w_pad * 2 * self.e_pad, self.splits, progress=True)
            elif kind == "combine":
                made = _Exchange(kind, w.world_size * rows, self.hidden, self.dtype, 0, 0, self.splits, progress=True)
            elif kind == "ll_dispatch":
                made = _Exchange(kind, self.num_experts * rows, self._ll_words(False), torch.int32, 1,
                                 self.w_pad * self.e_pad, self.splits)
            elif kind == "ll_dispatch_fp8":
                made = _Exchange(kind, self.num_experts * rows, self._ll_words(True), torch.int32, 1,
                                 self.w_pad * self.e_pad, self.splits)
            else:  # "ll_combine"
                made = _Exchange(kind, rows * topk, self.hidden, self.dtype, 0, 0, self.splits)
            self._exchanges[key] = made
        return self._exchanges[key]

    def _ll_words(self, fp8: bool) -> int:
        """4-byte words of a low-latency row: the token (bf16/fp16), or fp8 values and a scale per
        FP8_GROUP columns."""
        if fp8:
            return (self.hidden + 4 * (self.hidden // FP8_GROUP)) // 4
        return self.hidden // 2

    # ---- layout ----
    def _route(self, topk_idx: torch.Tensor, per_rank: bool = True, order: torch.Tensor | None = None):
        """Where this rank's tokens go, on the device: (positions [T, world]: each token's row among
        those sent to each rank, -1 where not sent; routed: tokens per rank, then pairs per expert;
        pair positions [T * topk]: each pair's row among this rank's pairs of its expert). With
        `per_rank` (the normal mode, which sends tokens) the pair positions are left unset, and
        `order` ([world, T]), if given, gets each rank's tokens in place order; without (the
        low-latency mode, which sends pairs) the token positions and counts are left unset."""
        w = self.world
        tokens = topk_idx.shape[0]
        positions = torch.empty((tokens, w.world_size), dtype=torch.int32, device=w.device)
        # `count` adds to the pairs per expert; `sort` sets them (the low-latency mode)
        routed = (torch.zeros if per_rank or not tokens else torch.empty)(w.world_size + self.num_experts,
                                                                         dtype=torch.int32, device=w.device)
        pair_positions = torch.empty(topk_idx.numel(), dtype=torch.int32, device=w.device)
        if tokens and per_rank:
            sort.sort(topk_idx, positions, routed, w.world_size, self.experts_local, one_group=False, order=order)
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
        def check() -> None:
            tokens, topk = self._check_routing(topk_idx)
            self._check_tokens(x, tokens)
            self._check_weights(topk_weights, (tokens, topk))
            self._no_hook_pending()

        self._agree("dispatch", topk_idx, check)
        tokens, topk = topk_idx.shape
        topk_idx = self._routing(topk_idx)
        w = self.world
        exchange_ = self._exchange("dispatch", topk)
        order = torch.empty((w.world_size, max(tokens, 1)), dtype=torch.int32, device=w.device)
        positions, routed, _ = self._route(topk_idx, order=order)
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
        args = (_nonempty(_words(x)), _nonempty(meta), _nonempty(positions), order, routed, ex.staging, ex.meta,
                ex.counts, ex.arrivals, ex.progress, ex.claims, ex.calls, _words(recv_x), recv_idx, recv_weights,
                recv_src, recv_layout, recv_per_expert, tokens, self.hidden // 2, self.max_tokens, self.experts_local,
                topk, ex.slot_numel, ex.meta.shape[1], w.local_world_size)
        exchange_.launch(dispatch_kernel, w.world_size, args,
                         {"W_PAD": self.w_pad, "E_PAD": self.e_pad, "K_PAD": triton.next_power_of_2(2 * topk + 1),
                          "BLOCK_R": BLOCK_R, "BLOCK_W": _block_w(self.hidden // 2), "CHUNK": CHUNK, "num_warps": 8})
        handle = EPHandle("normal", tokens, topk, recv_src, recv_layout, positions, topk_idx)
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
        w = self.world

        def check() -> None:
            self._check_handle(handle, "normal")
            check_tensor(y, "y")
            capacity = w.world_size * self.max_tokens
            if y.dtype != self.dtype or y.dim() != 2 or y.shape[1] != self.hidden or y.shape[0] > capacity:
                raise ValueError(f"y must be {self.dtype} of shape (received tokens, {self.hidden}); got {y.dtype} "
                                 f"of shape {tuple(y.shape)}")
            self._no_hook_pending()

        self._agree("combine", getattr(handle, "topk_idx", None), check)
        exchange_ = self._exchange("combine", 1)
        out = torch.empty((max(handle.tokens, 1), self.hidden), dtype=self.dtype, device=w.device)
        ex = exchange_
        args = (y, handle.recv_src, handle.recv_layout, _nonempty(handle.positions), ex.staging, ex.progress,
                ex.claims, ex.calls, out, handle.tokens, self.hidden, self.max_tokens, ex.slot_numel,
                w.local_world_size)
        exchange_.launch(combine_kernel, w.world_size, args,
                         {"WORLD": w.world_size, "CHUNK": CHUNK, **self._combine_blocks()})
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
        def check() -> None:
            tokens, _ = self._check_routing(topk_idx)
            self._check_tokens(x, tokens)
            if use_fp8 and self.hidden % FP8_GROUP:
                raise ValueError(f"use_fp8 scales groups of {FP8_GROUP} columns: hidden must be a multiple, got "
                                 f"{self.hidden}")
            self._no_hook_pending()

        self._agree("low_latency_dispatch fp8" if use_fp8 else "low_latency_dispatch", topk_idx, check)
        tokens, topk = topk_idx.shape
        topk_idx = self._routing(topk_idx)
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
        handle = EPHandle("low_latency", tokens, topk, recv_src, recv_layout, positions, topk_idx)
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
            topk_idx: the dispatch's routing, int64 [T, topk] (the sums follow the ids the
                dispatch routed by, kept in the handle).
            topk_weights: float32 [T, topk].
            handle: the dispatch's.

        Returns:
            out [T, hidden].
        """
        w = self.world

        def check() -> None:
            self._check_handle(handle, "low_latency")
            tokens, topk = self._check_routing(topk_idx)
            if (tokens, topk) != (handle.tokens, handle.topk):
                raise ValueError(f"topk_idx has shape {(tokens, topk)}; the handle's dispatch had "
                                 f"{(handle.tokens, handle.topk)}")
            self._check_weights(topk_weights, (tokens, topk))
            check_tensor(y, "y")
            shape = (self.experts_local, w.world_size * self.max_tokens, self.hidden)
            if y.dtype != self.dtype or tuple(y.shape) != shape:
                raise ValueError(f"y must be {self.dtype} of shape {shape} (recv_x's); got {y.dtype} of shape "
                                 f"{tuple(y.shape)}")
            self._no_hook_pending()

        self._agree("low_latency_combine", topk_idx, check)
        tokens, topk = topk_idx.shape
        topk_idx = handle.topk_idx
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

