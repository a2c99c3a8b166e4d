"""Expert parallelism: dispatch tokens to the ranks that hold their experts, and combine the experts'
outputs back, with top-k routing computed on the device (`EPBuffer`, DeepEP's shape of API). The
front: the checks, the routing's ids, and the methods each kind of call builds at its first use.

Experts are spread evenly: rank r holds experts r * E_local ... (r + 1) * E_local - 1 (with a
process group, rank r of the group). A token t with `topk_idx[t]` = its experts (-1: none) takes
two ways, one per mode:

- **normal mode** (prefill, training): a token goes once to every rank that holds one of its
  experts (`dispatch`, `combine`; kernels and protocol in `normal.py`);
- **low-latency mode** (decode): one copy per (token, expert) pair, grouped by expert
  (`low_latency_dispatch`, `low_latency_combine`; kernels and protocol in `low_latency.py`).

Both run the family's all-to-all protocol (`moe/_exchange.py`) and route on the device
(`_routing`).

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

from tridist.runtime.tensors import check_tensor

from ... import checks, sizing
from ...ranks import ranks_of
from .. import _sort
from .._exchange import matrix_pad
from ._routing import tokens_to_ranks
from ._staging import Layer
from .low_latency import FP8_GROUP, LowLatencyCombine, LowLatencyDispatch
from .normal import PROGRESS_EPOCH, NormalCombine, NormalDispatch

DTYPES = (torch.bfloat16, torch.float16)


@dataclasses.dataclass
class EPHandle:
    """What a dispatch returns for its combine: where every received row came from.

    Attributes:
        mode: "normal" or "low_latency".
        tokens: the tokens this rank dispatched (T).
        topk: experts per token.
        recv_src: for every row of recv_x, its source (ranks of the buffer's group, if it has one):
            normal mode source_rank * max_tokens + token;
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


class EPBuffer:
    """Dispatch and combine of tokens for expert parallelism, in a normal mode (throughput) and a
    low-latency mode (decode); the symmetric buffers of one layer shape. DeepEP's `Buffer`, as far
    as its single-node and multi-node calls go.

    Build it on every rank at once (every rank of its group); its calls are collectives (every rank
    calls the same method in the same order). With a group, the group's ranks are its world: the
    experts spread over them, rank numbers and world_size in its arguments and results are the
    group's, and other groups may run their own buffers meanwhile. Each mode allocates its symmetric staging at its first call (a collective,
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
        group: the ranks it runs among: a `torch.distributed` process group (`dist.new_group`, a
            DeviceMesh's `get_group`), a `tridist.Group`, or None for the world.

    Attributes:
        dropped_expert_ids: int64 [1] on this rank's device: the expert ids out of range that
            this rank's dispatches treated as -1 since the buffer was built (see above; zero
            where the host checks them).

    Raises:
        ValueError: sizes that are not positive ints, experts that do not split evenly across
            ranks, an odd `hidden`, another dtype, a rank that is not a member of `group`.
    """

    def __init__(self, num_experts: int, hidden: int, max_tokens_per_rank: int, dtype: torch.dtype = torch.bfloat16,
                 group=None):
        self.ranks = w = ranks_of(group)
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
        experts_local = num_experts // w.world_size
        self.layer = Layer(num_experts=num_experts, experts_local=experts_local, hidden=hidden,
                           max_tokens=max_tokens_per_rank, dtype=dtype, w_pad=matrix_pad(w.world_size),
                           e_pad=matrix_pad(experts_local),
                           splits=max(1, sizing.programs_for(w.device) // w.world_size), ranks=w)
        self._methods: dict = {}
        self._hook_pending = False
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
        return _sort.drop_ids(topk_idx, -1, self.num_experts, self.dropped_expert_ids)

    def _agree(self, call: str, topk_idx, check) -> None:
        """`check()` (this rank's checks of its arguments) with the outcome shared by every rank of the
        buffer's, which must make the same call with the same topk (`checks.agree`)."""
        topk = topk_idx.shape[-1] if isinstance(topk_idx, torch.Tensor) and topk_idx.dim() else -1
        checks.agree("EPBuffer", check, {"call": call, "experts per token (topk)": topk}, group=self.ranks.group)

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

    def _method(self, kind, *args):
        """The method `kind` (a class of `normal` or `low_latency`) built with these arguments, at
        its first use: a collective allocation, in call order, the same on every rank."""
        key = (kind, *args)
        if key not in self._methods:
            self._methods[key] = kind(self.layer, *args)
        return self._methods[key]

    def get_dispatch_layout(self, topk_idx: torch.Tensor):
        """How this rank's tokens spread, computed on the device (no host synchronisation).

        Args:
            topk_idx: int64 [T, topk], expert ids (-1: none).

        Returns:
            (tokens_per_rank int64 [world_size]: tokens with at least one expert on each rank;
            tokens_per_expert int64 [num_experts]; is_token_in_rank bool [T, world_size]).
        """
        self._check_routing(topk_idx)
        w = self.ranks
        positions, routed = tokens_to_ranks(topk_idx, self.num_experts, w)
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
        recv, positions = self._method(NormalDispatch, topk).launch(x, topk_idx, topk_weights)
        handle = EPHandle("normal", tokens, topk, recv.src, recv.layout, positions, topk_idx)
        if sync:
            received = int(recv.layout[0].sum())
            return recv.x[:received], recv.idx[:received], recv.weights[:received], recv.per_expert, handle
        return recv.x, recv.idx, recv.weights, recv.per_expert, handle

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
        w = self.ranks

        def check() -> None:
            self._check_handle(handle, "normal")
            check_tensor(y, "y")
            capacity = w.world_size * self.max_tokens
            if y.dtype != self.dtype or y.dim() != 2 or y.shape[1] != self.hidden or y.shape[0] > capacity:
                raise ValueError(f"y must be {self.dtype} of shape (received tokens, {self.hidden}); got {y.dtype} "
                                 f"of shape {tuple(y.shape)}")
            self._no_hook_pending()

        self._agree("combine", getattr(handle, "topk_idx", None), check)
        return self._method(NormalCombine).launch(y, handle.tokens, handle.recv_src, handle.recv_layout,
                                                  handle.positions)

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
        method = self._method(LowLatencyDispatch, topk, use_fp8)
        recv, positions, receive = method.launch(x, topk_idx, hook=return_recv_hook)
        if receive is None:
            def hook() -> None:
                pass
        else:
            self._hook_pending = True

            def hook() -> None:
                if not self._hook_pending:
                    raise ValueError("this hook has run already")
                self._hook_pending = False
                receive()
        handle = EPHandle("low_latency", tokens, topk, recv.src, recv.layout, positions, topk_idx)
        return recv.x, recv.count, handle, hook

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
        w = self.ranks

        def check() -> None:
            self._check_handle(handle, "low_latency")
            tokens, topk = self._check_routing(topk_idx)
            if (tokens, topk) != (handle.tokens, handle.topk):
                raise ValueError(f"topk_idx has shape {(tokens, topk)}; the handle's dispatch had "
                                 f"{(handle.tokens, handle.topk)}")
            self._check_weights(topk_weights, (tokens, topk))
            check_tensor(y, "y")
            shape = (self.layer.experts_local, w.world_size * self.max_tokens, self.hidden)
            if y.dtype != self.dtype or tuple(y.shape) != shape:
                raise ValueError(f"y must be {self.dtype} of shape {shape} (recv_x's); got {y.dtype} of shape "
                                 f"{tuple(y.shape)}")
            self._no_hook_pending()

        self._agree("low_latency_combine", topk_idx, check)
        topk = topk_idx.shape[1]
        return self._method(LowLatencyCombine, topk).launch(y, handle.topk_idx, topk_weights, handle.recv_src,
                                                            handle.recv_layout, handle.positions)

    # ---- helpers ----
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
        for method in self._methods.values():  # built in call order, the same on every rank
            method.free()
        self._methods.clear()

