"""`flash_decode`: decode attention over a KV cache split by sequence across the ranks (of the
world, or of a process group: `group=`).

Each rank holds a slice of every sequence's cached positions (any slice: the order of positions does
not matter to softmax) and the same queries; every rank returns the attention of the queries over
the union of the slices. Two kernels, queued on the current stream:
1. `split_kv.flash_decode_split_kernel`: attention over this rank's slice, each sequence's positions
   cut in chunks so that every SM has work, a record of each chunk's result left in `partials`.
2. `combine.flash_decode_combine_kernel`: many programs merge each (sequence, KV head)'s records,
   a block of output columns each; with one rank into `out`, with several into a piece that goes to
   every rank, whose pieces are then merged in rank order (so every rank gets the same bits) into
   `out` (the protocol: `combine`'s docstring). A programmatic dependent launch: it starts on the
   SMs the first kernel's last programs leave, and waits there for that kernel to end.
No host synchronisation, no allocation but `out`: the op can be captured in a CUDA graph.
The configs, the split count and the combine's shape are chosen in `policy`.
"""
import math

import torch

import tridist
from tridist.runtime.tensors import check_tensor

from .. import checks, instances, sizing
from ..protocol import Workspace
from ..checks import check_input, check_output
from ..ranks import ALONE, ranks_of
from ._records import record_size
from .combine import flash_decode_combine_kernel
from .policy import COMBINE_WARPS, PAGED_EXTRA_STAGES, choose_splits, combine_shape, configs, most_splits
from .split_kv import flash_decode_split_kernel

DTYPES = (torch.bfloat16, torch.float16)
HEAD_DIMS = (64, 128)
MAX_GROUP = 32  # query heads per KV head: a program holds all of them, in registers, as dot rows

CONFIG_KEYS = {"BLOCK_N", "num_warps", "num_stages", "programs_per_sm", "splits"}


def check_config(config: dict) -> None:
    """Raises ValueError unless `config` is a flash_decode config (`policy`'s module docstring)."""
    if not isinstance(config, dict) or not {"BLOCK_N", "num_warps", "num_stages"} <= set(config) \
            or not set(config) <= CONFIG_KEYS or ("splits" in config) == ("programs_per_sm" in config):
        raise ValueError(f"a flash_decode config is a dict of BLOCK_N, num_warps, num_stages and one of "
                         f"programs_per_sm or splits (see tridist.ops.attention.configs(device)); got {config!r}")
    for key, value in config.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"flash_decode config {key} must be a positive int, got {value!r}")
    if config["BLOCK_N"] & (config["BLOCK_N"] - 1) or config["BLOCK_N"] < 16:
        raise ValueError(f"flash_decode config BLOCK_N must be a power of two of at least 16, got {config['BLOCK_N']}")


class FlashDecode:
    """Decode attention for `batch` sequences of `q_heads` query heads over `kv_heads` KV heads of
    `head_dim` (64 or 128) in `dtype` (bf16 or fp16), the KV cache split by position across the
    ranks (see the module docstring and `__call__`). Owns its buffers: `partials` (this rank's
    chunks' records, fp32), and with several ranks a symmetric workspace; `free()` gives them back.

    Every rank builds it with the same sizes (a collective with several ranks: the workspace is
    symmetric); each rank's cache may hold a different number of positions, in either layout. Use
    one instance per stream (`flash_decode` keeps one per shape and stream). `config`: a dict
    (`configs(device)`), None for the default. `group`: a `torch.distributed.ProcessGroup` or
    `tridist.Group` whose members split the cache among themselves (the other ranks take no part
    and may run their own), None for the world; its members build the instance together.

    Raises ValueError for a dtype, head dim or head counts it does not take, a bad config, or a
    `group` this rank is not a member of.
    """

    def __init__(self, batch: int, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 config: dict | None = None, group=None):
        check_sizes(batch, q_heads, kv_heads, head_dim, dtype)
        self.ranks = r = ranks_of(group)
        self.batch, self.q_heads, self.kv_heads, self.head_dim, self.dtype = batch, q_heads, kv_heads, head_dim, dtype
        self.heads_per_kv = q_heads // kv_heads
        self.units = batch * kv_heads
        self.config = configs(r.device)[0] if config is None else dict(config)
        check_config(self.config)
        self.sms = sizing.programs_for(r.device)
        self.record = record_size(self.heads_per_kv, head_dim)
        self.max_splits = most_splits(self.config, self.units, self.sms)
        self.resident = {}  # block size (0: contiguous) -> programs of the split-KV kernel resident at once
        # The combine's shape, fixed for the instance (its grid counts its calls), from the most splits.
        self.columns, self.rows, self.rank_rows = combine_shape(self.heads_per_kv, head_dim, self.max_splits,
                                                                r.world_size)
        self.items = self.units * (head_dim // self.columns)
        checks.check_offsets("flash_decode", self.units * self.max_splits * self.record)
        self.partials = torch.empty(self.units * self.max_splits * self.record, dtype=torch.float32, device=r.device)
        self.workspace = None
        self.combine_programs = self.items  # several ranks: fewer if they cannot all be resident (first call)
        self.fitted = r.world_size == 1
        if r.world_size > 1:
            piece = record_size(self.heads_per_kv, self.columns)
            checks.check_offsets("flash_decode", r.world_size * self.items * piece)
            self.workspace = Workspace(r.world_size * self.items * piece, torch.int64, 1, name="flash_decode",
                                       group=r.group)  # LL packets

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqlens: torch.Tensor,
                 block_table: torch.Tensor | None = None, sm_scale: float | None = None,
                 out: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """out [B, Hq, D] = softmax(q k^T * sm_scale) v over the positions every rank (of the
        instance's group) holds.

        Args:
            q: [B, Hq, D], the same on every rank.
            k_cache: this rank's slice of the keys, [B, L, Hkv, D] (block_table None) or paged
                [num_blocks, block_size, Hkv, D] (vLLM's layout), q's dtype; any strides but the
                last dimension's, which must be 1: transformers' caches ([B, Hkv, L, D]) are read in
                place as `k.transpose(1, 2)`.
            v_cache: this rank's slice of the values, of k_cache's shape and strides.
            seqlens: int32 [B], the positions of each sequence this rank holds (0 allowed): the
                first seqlens[b] rows of sequence b (contiguous), or of its blocks block_table[b, :].
            block_table: int32 [B, max_blocks], block ids of each sequence's positions in order.
            sm_scale: the scale of the scores, default 1 / sqrt(D); the same on every rank.
            out: where to write (a new tensor by default).
            mask: bool [B, n] with n at least the positions a sequence can hold (L, or max_blocks
                x block_size), rows any stride apart, its last stride 1: position p of sequence b
                is attended only where mask[b, p] is True (left padding, say). transformers' 4-D
                boolean mask `m` ([B, 1, 1, n] for one query) is `m[:, 0, 0]`. None: every
                position below seqlens.

        Scores and softmax in fp32; the probabilities meet V rounded to q's dtype (as in FlashAttention),
        and out is rounded to it. A sequence that no rank holds a position of gets zeros (softmax
        over nothing; SDPA would give NaN).

        Raises ValueError (before any launch) for shapes, dtypes or devices that do not match; and
        for seqlens past the cache or used block-table entries outside it, where that can be seen
        without a device synchronisation (tensors on the CPU: the emulator) or with TRIDIST_DEBUG=1
        outside a CUDA-graph capture. Otherwise such values are not checked: the kernel would read
        whatever memory they point at.
        """
        out, page, scale = checks.agree(
            "flash_decode", lambda: (self._checked_out(q, out), self._layout(q, k_cache, v_cache, seqlens, block_table,
                                                                             mask), _scale(sm_scale, self.head_dim)),
            {"shape and dtype of q": checks.shape_of(q)}, group=self.ranks.group)
        splits = self._split_kv(q, k_cache, v_cache, seqlens, block_table, mask, page, scale)
        ws = self.workspace
        # Where the exchange does not use them (one rank), any tensor stands in for its buffers.
        staging, calls = (ws.staging, ws.calls) if ws else (self.partials, seqlens)
        arguments = dict(partials_ptr=self.partials, out_ptr=out, staging_ptr=staging, calls_ptr=calls,
                         units=self.units, splits=splits, slot_numel=ws.slot_numel if ws else 0,
                         local_world_size=self.ranks.local_world_size, GROUP=self.heads_per_kv, D=self.head_dim,
                         COLUMNS=self.columns, ROWS=self.rows, RANK_ROWS=self.rank_rows, EXCHANGE=ws is not None,
                         group=self.ranks.group, num_warps=COMBINE_WARPS, launch_pdl=True)
        if not self.fitted:
            self.combine_programs = sizing.fit_coresident(flash_decode_combine_kernel, self.items, 1, **arguments)
            self.fitted = True
        flash_decode_combine_kernel[(self.combine_programs,)](coresident=ws is not None, **arguments)
        return out

    def split_kv(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqlens: torch.Tensor,
                 block_table: torch.Tensor | None = None, sm_scale: float | None = None,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
        """Only the split-KV kernel over this rank's slice (arguments as `__call__`): each chunk's
        record left in `partials`, nothing merged or sent. The benchmark times it as "the kernel
        alone". Returns `partials` viewed as [B * Hkv, splits, record words]."""
        self._checked_out(q, None)
        page = self._layout(q, k_cache, v_cache, seqlens, block_table, mask)
        splits = self._split_kv(q, k_cache, v_cache, seqlens, block_table, mask, page, _scale(sm_scale, self.head_dim))
        return self.partials[:self.units * splits * self.record].view(self.units, splits, self.record)

    def splits_for(self, k_cache: torch.Tensor, block_table: torch.Tensor | None = None) -> int:
        """Chunks per sequence of a call on this cache (`choose_splits`), once a call on a cache of
        this layout (contiguous, or paged with this block size) has found how many of the kernel's
        programs fit at once; before that, as if all of them did."""
        page = 0 if block_table is None else k_cache.shape[1]
        return choose_splits(self.config, self.units, _capacity(k_cache, block_table), self.sms,
                             self.resident.get(page))

    def _split_kv(self, q, k_cache, v_cache, seqlens, block_table, mask, page, scale) -> int:
        """Queues the split-KV kernel; returns its chunks per sequence."""
        table = seqlens if block_table is None else block_table  # (unused without a table: any tensor)
        # Bytes, as the kernel reads them (a bool pointer would be read as 1-bit values); unused without a mask.
        mask_bytes = seqlens if mask is None else mask.view(torch.uint8)
        seq_stride, row_stride, head_stride, _ = k_cache.stride()
        c = self.config
        arguments = dict(q_ptr=q, k_ptr=k_cache, v_ptr=v_cache, seqlens_ptr=seqlens, table_ptr=table,
                         mask_ptr=mask_bytes, partials_ptr=self.partials, sm_scale=scale, seq_stride=seq_stride,
                         row_stride=row_stride, head_stride=head_stride, table_stride=table.shape[-1],
                         mask_stride=mask_bytes.stride(0), kv_heads=self.kv_heads, GROUP=self.heads_per_kv,
                         D=self.head_dim, BLOCK_N=c["BLOCK_N"], PAGE=page, MASKED=mask is not None,
                         num_warps=c["num_warps"], num_stages=c["num_stages"] + (PAGED_EXTRA_STAGES if page else 0))
        if page not in self.resident:  # compiles the kernel (it would be, to launch) and asks its occupancy
            self.resident[page] = tridist.coresident_programs(flash_decode_split_kernel, splits=self.max_splits,
                                                              **arguments)
        splits = self.splits_for(k_cache, block_table)
        flash_decode_split_kernel[(self.units, splits)](splits=splits, **arguments)
        return splits

    def _checked_out(self, q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        check_input(q, "q", DTYPES)
        shape = (self.batch, self.q_heads, self.head_dim)
        if tuple(q.shape) != shape or q.dtype != self.dtype:
            raise ValueError(f"this FlashDecode was built for q of shape {shape} in {self.dtype}; q is {q.dtype} of "
                             f"shape {tuple(q.shape)}: build another, or call tridist.ops.flash_decode, which keeps "
                             "one per shape")
        if out is None:
            return torch.empty_like(q)
        check_output(out, shape, self.dtype)
        return out

    def _layout(self, q, k_cache, v_cache, seqlens, block_table, mask) -> int:
        """The block size (0 for a cache without a block table), once the cache, seqlens, table and
        mask are checked."""
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            check_strided(cache, name)
            if cache.dtype != q.dtype:
                raise ValueError(f"{name} is {cache.dtype} but q is {q.dtype}: the cache and q take one dtype")
            if cache.dim() != 4 or tuple(cache.shape[2:]) != (self.kv_heads, self.head_dim):
                raise ValueError(f"{name} must be [B, L, {self.kv_heads}, {self.head_dim}] (contiguous) or "
                                 f"[num_blocks, block_size, {self.kv_heads}, {self.head_dim}] (paged), got "
                                 f"{tuple(cache.shape)}")
        if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
            raise ValueError(f"k_cache ({tuple(k_cache.shape)}, strides {k_cache.stride()}) and v_cache "
                             f"({tuple(v_cache.shape)}, strides {v_cache.stride()}) must have one shape and one layout")
        check_tensor(seqlens, "seqlens")
        if seqlens.dtype != torch.int32 or tuple(seqlens.shape) != (self.batch,):
            raise ValueError(f"seqlens must be int32 of shape ({self.batch},), got {seqlens.dtype} of shape "
                             f"{tuple(seqlens.shape)}")
        if block_table is None:
            if k_cache.shape[0] != self.batch:
                raise ValueError(f"a contiguous cache holds one row per sequence: [{self.batch}, L, ...], got "
                                 f"{tuple(k_cache.shape)} (pass block_table for a paged cache)")
            page = 0
        else:
            check_tensor(block_table, "block_table")
            if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != self.batch:
                raise ValueError(f"block_table must be int32 of shape ({self.batch}, max_blocks), got "
                                 f"{block_table.dtype} of shape {tuple(block_table.shape)}")
            page = k_cache.shape[1]
            if page == 0:
                raise ValueError("a paged cache needs blocks of at least one position, got block_size 0")
        capacity = _capacity(k_cache, block_table)
        if mask is not None:
            check_strided(mask, "mask")
            if mask.dtype != torch.bool or mask.dim() != 2 or mask.shape[0] != self.batch or mask.shape[1] < capacity:
                raise ValueError(f"mask must be bool of shape ({self.batch}, n), n >= {capacity} (the positions a "
                                 f"sequence's cache holds), got {mask.dtype} of shape {tuple(mask.shape)}")
        check_positions(seqlens, capacity, block_table, k_cache.shape[0], page)
        return page

    def free(self) -> None:
        """Give the exchange's symmetric buffers back (on every rank, in the same order)."""
        if self.workspace is not None:
            self.workspace.free()


def check_sizes(batch, q_heads, kv_heads, head_dim, dtype) -> None:
    """What a FlashDecode for these sizes needs, checked before anything is allocated."""
    if dtype not in DTYPES:
        raise ValueError(f"flash_decode takes {' or '.join(map(str, DTYPES))}; got {dtype}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"flash_decode takes head dims {' or '.join(map(str, HEAD_DIMS))}; got {head_dim}")
    for name, value in (("batch", batch), ("q_heads", q_heads), ("kv_heads", kv_heads)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"flash_decode needs a positive int {name}, got {value!r}")
    if q_heads % kv_heads or q_heads // kv_heads > MAX_GROUP:
        raise ValueError(f"flash_decode needs q_heads a multiple of kv_heads, at most {MAX_GROUP} query heads per KV "
                         f"head; got {q_heads} query heads over {kv_heads} KV heads")


def check_strided(t: torch.Tensor, name: str) -> None:
    """`t` on this rank's device with unit stride in its last dimension (the kernel's rows are
    contiguous; the other dimensions may be any views)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != tridist.world().device:
        raise ValueError(f"{name} is on {t.device} but this rank's device is {tridist.world().device}")
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}'s last dimension must be contiguous (stride 1), got strides {t.stride()}")


def check_positions(seqlens: torch.Tensor, capacity: int, block_table: torch.Tensor | None, num_blocks: int,
                    page: int) -> None:
    """seqlens within [0, capacity] and the block-table entries they use within [0, num_blocks), where
    reading them costs no device synchronisation (CPU tensors) or TRIDIST_DEBUG=1 allows one (not
    while a CUDA graph is captured, which a synchronisation would end)."""
    if not checks.host_reads(seqlens):
        return
    lengths = seqlens.cpu()
    bad = ((lengths < 0) | (lengths > capacity)).nonzero()
    if len(bad):
        b = int(bad[0, 0])
        raise ValueError(f"seqlens[{b}] = {int(lengths[b])}: this rank's cache holds 0 to {capacity} positions of "
                         "each sequence")
    if block_table is None:
        return
    entries = block_table.cpu()
    used = torch.arange(entries.shape[1]) < ((lengths + page - 1) // page)[:, None]
    bad = (used & ((entries < 0) | (entries >= num_blocks))).nonzero()
    if len(bad):
        b, j = (int(i) for i in bad[0])
        raise ValueError(f"block_table[{b}, {j}] = {int(entries[b, j])} is outside the cache's {num_blocks} blocks "
                         f"(sequence {b} holds {int(lengths[b])} positions here, so it uses its first "
                         f"{-(-int(lengths[b]) // page)} entries)")


def _capacity(k_cache: torch.Tensor, block_table: torch.Tensor | None) -> int:
    """Positions of a sequence the cache can hold: L, or max_blocks * block_size."""
    return k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]


def _scale(sm_scale, head_dim: int) -> float:
    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)) or not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale must be a finite Python number (or None for 1/sqrt(D)), got {sm_scale!r}")
    return float(sm_scale)


def flash_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqlens: torch.Tensor,
                 block_table: torch.Tensor | None = None, sm_scale: float | None = None,
                 mask: torch.Tensor | None = None, group=None) -> torch.Tensor:
    """Decode attention of q ([B, Hq, D], the same on every rank) over a KV cache split by position
    across the ranks: every rank returns out [B, Hq, D], the attention over every rank's positions,
    the same bits on every rank. A collective. Arguments, limits and errors: `FlashDecode.__call__`;
    keeps one `FlashDecode` per shape, dtype, group and stream.

    `group`: a `torch.distributed.ProcessGroup` or `tridist.Group`, None for the world: the cache
    is split across its members, who call together and get the attention over their positions
    only, while the other ranks may run their own (another group's, on other data). A rank that is
    not a member gets a ValueError before any launch."""
    def check() -> None:
        check_input(q, "q", DTYPES)
        if q.dim() != 3:
            raise ValueError(f"q must be [B, Hq, D], got shape {tuple(q.shape)}")
        check_strided(k_cache, "k_cache")
        if k_cache.dim() != 4:
            raise ValueError(f"k_cache must be [B, L, Hkv, D] or [num_blocks, block_size, Hkv, D], got shape "
                             f"{tuple(k_cache.shape)}")
        check_sizes(*q.shape[:2], k_cache.shape[2], q.shape[2], q.dtype)

    heads = tuple(k_cache.shape[2:]) if isinstance(k_cache, torch.Tensor) else None
    checks.agree("flash_decode", check, {"shape and dtype of q": checks.shape_of(q), "heads of k_cache": heads},
                 group=group)
    batch, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    ranks = ranks_of(group)
    op = instances.instance(lambda: FlashDecode(batch, q_heads, kv_heads, head_dim, q.dtype, group=group), FlashDecode,
                            batch, q_heads, kv_heads, head_dim, q.dtype, ranks.key, device=q.device)
    return op(q, k_cache, v_cache, seqlens, block_table, sm_scale, mask=mask)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqlens: torch.Tensor,
                     block_table: torch.Tensor | None = None, sm_scale: float | None = None,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention of q ([B, Hq, D]) over this rank's cache alone: `flash_decode` with no
    peer (`group=ranks.ALONE`), not a collective, whatever the world. What each rank of a
    tensor-parallel attention layer runs over the heads it holds, and what one GPU runs: the
    split-KV kernel spreads each sequence's positions over the SMs, and the combine merges them.
    Arguments, limits and errors: `FlashDecode.__call__` (transformers' [B, Hkv, L, D] cache is
    read in place as `cache.transpose(1, 2)`, its boolean mask as `mask[:, 0, 0]`); keeps one
    instance per shape, dtype and stream."""
    return flash_decode(q, k_cache, v_cache, seqlens, block_table, sm_scale, mask, group=ALONE)
