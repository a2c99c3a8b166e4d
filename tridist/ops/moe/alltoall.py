"""All-to-all-v with the splits on the device: each rank sends a variable number of rows to every
rank, the counts coming from routing computed on the GPU, so no call reads them on the host.

Three layouts, with the meanings of PyTorch's `all_to_all_vdev`, `all_to_all_vdev_2d` and
`all_to_all_vdev_2d_offset` (G = experts per rank; "chunk (p, e)" = rows for local expert e of
rank p):
- `all_to_all_v`: x holds the rows for rank 0, then rank 1, ...; out receives from rank 0, then
  rank 1, ..., packed. Splits and offsets are indexed by rank.
- `all_to_all_v_2d`: x holds chunks rank-major (in_splits[p * G + e]); out receives expert-major:
  for each local expert e, the chunks from rank 0, 1, ...; each expert's first chunk starts at a
  multiple of `major_align`, and takes at least `major_align` rows (an empty expert too, as in
  PyTorch). The result is indexed expert-major, [e * world + s].
- `all_to_all_v_2d_offset`, the way back: x holds expert-major chunks at the given offsets
  (in_splits_offsets[:, e * world + p]; padding between them is not sent); out receives rank-major,
  packed: from rank 0 its experts' chunks for this rank in expert order, then rank 1's... The
  result is indexed rank-major, [s * G + e]. Fed the result of `all_to_all_v_2d`, it returns every
  row to where it came from.

Protocol (`all_to_all_v_kernel`, the family's in `exchange.py`). Program (p, s):
1. sends its share s of the rows for rank p (the chunks for p, concatenated in expert order, cut in
   `splits` parts) into region `rank` of p's staging, which holds as many rows as x; writes its
   count per chunk into row `rank` of p's counts, and raises flag (rank, s) on p to the epoch;
2. waits for flag (q, s) from every rank q: every count is then here, and q's part s too;
3. lays out the output from every source's counts and copies part s of rank p's region into it.
A receiver's part s is the sender's part s (both cut the same total in the same way), so one flag
covers it. The layout is computed alike by every program from the counts, in rank order.
"""
import torch
import triton
import triton.language as tl

import tridist
import tridist.language as dl
from tridist.runtime.jit import jit
from tridist.runtime.tensors import check_tensor

from .. import checks, instances, protocol, sizing
from ..protocol import after_flags, finish_call
from . import exchange
from .exchange import chunk_of, exchange_program, gather, send_rows, send_values, split_rows

# What the rows may hold: an all-to-all only moves them (fp8 as its bytes).
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8,
          torch.int8, torch.int16, torch.int32, torch.int64)
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
LAYOUTS = ("rank", "expert", "expert_offset")
BLOCK_R = 8       # rows a step moves
TILE = 4096       # elements a step moves at most: BLOCK_R rows of up to TILE // BLOCK_R


def as_words(t: torch.Tensor) -> torch.Tensor:
    """`t` viewed as integers of its element size: the kernels move bits, whatever they mean."""
    return t.view(_WORDS[t.element_size()])


@jit
def all_to_all_v_kernel(x_ptr, splits_ptr, offsets_ptr, out_ptr, result_ptr, staging_ptr, counts_ptr, flags_ptr,
                        calls_ptr, width, region, out_rows, experts, major_align, slot_numel, local_world_size, splits,
                        LAYOUT: tl.constexpr, W_PAD: tl.constexpr, G_PAD: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_W: tl.constexpr):
    """Grid (world, splits). x, out: rows of `width` elements; staging: per slot `world` regions of
    `region` rows; counts: per slot a row of G_PAD int32 per source; flags: per slot (source, split).
    LAYOUT 0: rank-major in and out; 1: rank-major in, expert-major out (aligned to `major_align`);
    2: expert-major in at offsets_ptr, rank-major out."""
    epoch, me, world, peer, split, stage = exchange_program(calls_ptr, staging_ptr, slot_numel)
    counts = counts_ptr + (epoch % 2) * W_PAD * G_PAD
    flags = flags_ptr + (epoch % 2) * world * splits
    experts_ = tl.arange(0, G_PAD)
    real = experts_ < experts

    # 1. Send: the chunks for `peer`, where they are in x, packed in its region in expert order.
    if LAYOUT == 2:
        chunk = tl.load(splits_ptr + experts_ * world + peer, mask=real, other=0).to(tl.int32)
        start = tl.load(offsets_ptr + experts_ * world + peer, mask=real, other=0).to(tl.int32)
    else:
        every = tl.arange(0, W_PAD * G_PAD)
        sent_before = tl.sum(tl.load(splits_ptr + every, mask=every < peer * experts, other=0), 0).to(tl.int32)
        chunk = tl.load(splits_ptr + peer * experts + experts_, mask=real, other=0).to(tl.int32)
        start = sent_before + tl.cumsum(chunk, 0) - chunk
    reach = tl.max(tl.where(real, start + chunk, 0), 0)
    dl.check(reach <= region, "all_to_all_v: in_splits (and offsets) reach past the rows of x", reach, region)
    ends = tl.cumsum(chunk, 0)
    total = tl.minimum(tl.sum(chunk, 0), region)
    first, stop = split_rows(total, split, splits)
    for row in range(first, stop, BLOCK_R):
        rows = row + tl.arange(0, BLOCK_R)
        which = chunk_of(rows, ends)
        source_rows = gather(start, which) + rows - gather(ends - chunk, which)
        send_rows(x_ptr, source_rows, stage + me * region * width, rows, (rows < stop) & (source_rows < region),
                  width, peer, local_world_size, BLOCK_R, BLOCK_W)
    send_values(counts, me * G_PAD + experts_, chunk, real, peer, local_world_size, G_PAD)
    exchange.raise_flag(flags + me * splits + split, epoch, peer, local_world_size)

    # 2. Every source's counts (and part `split` of each source's rows) are here once its flag is.
    for step in range(world):
        counts = after_flags(counts, flags + ((me + step) % world) * splits + split, 1, epoch)
    sources = tl.arange(0, W_PAD)
    matrix = tl.load(counts + sources[:, None] * G_PAD + experts_[None, :],
                     mask=(sources < world)[:, None] & real[None, :], other=0)

    # 3. Where chunk (q, e) goes: rank-major packs each source's chunks in expert order; expert-major
    #    starts each expert at a multiple of major_align, its chunks in source order.
    if LAYOUT == 1:
        # As PyTorch's: every expert's rows take a whole number of major_align rows, at least one
        # (an empty expert too: grouped GEMMs that cannot take an empty group get a padding row).
        per_expert = tl.sum(matrix, 0)
        taken = tl.where(real, tl.maximum(tl.cdiv(per_expert, major_align), 1) * major_align, 0)
        placed = (tl.cumsum(taken, 0) - taken)[None, :] + tl.cumsum(matrix, 0) - matrix
        arriving = tl.sum(taken, 0)
    else:
        per_source = tl.sum(matrix, 1)
        placed = (tl.cumsum(per_source, 0) - per_source)[:, None] + tl.cumsum(matrix, 1) - matrix
        arriving = tl.sum(per_source, 0)
    dl.check(arriving <= out_rows, "all_to_all_v: rows arriving > rows of out", arriving, out_rows)

    mine = tl.sum(tl.where(sources[:, None] == peer, matrix, 0), 0)
    mine_at = tl.sum(tl.where(sources[:, None] == peer, placed, 0), 0)
    mine_ends = tl.cumsum(mine, 0)
    first, stop = split_rows(tl.minimum(tl.sum(mine, 0), region), split, splits)
    for row in range(first, stop, BLOCK_R):
        rows = row + tl.arange(0, BLOCK_R)
        which = chunk_of(rows, mine_ends)
        target = gather(mine_at, which) + rows - gather(mine_ends - mine, which)
        exchange.copy_rows(stage + peer * region * width, rows, out_ptr, target, (rows < stop) & (target < out_rows),
                           width, BLOCK_W)

    if (peer == 0) & (split == 0):
        if LAYOUT == 1:
            at = experts_[None, :] * world + sources[:, None]
        else:
            at = sources[:, None] * experts + experts_[None, :]
        inside = (sources < world)[:, None] & real[None, :]
        tl.store(result_ptr + at, matrix.to(tl.int64), mask=inside)
        tl.store(result_ptr + world * experts + at, placed.to(tl.int64), mask=inside)
    dl.shmem.quiet()
    finish_call(calls_ptr)


class AllToAllV:
    """All-to-all-v of rows whose counts are on the device, in the three layouts of
    `all_to_all_v`, `all_to_all_v_2d` and `all_to_all_v_2d_offset`; the buffers of one shape.

    Build it on every rank at once (it allocates symmetric memory); call it back to back on one
    stream, also in CUDA graphs; `free()` it on every rank. The functions keep one per shape,
    dtype, layout and stream.

    The staging holds, per source rank, as many rows as x: 2 x world_size x `rows` rows of
    `row_shape` in all. One network round a call: each rank pushes its rows for every peer into
    that peer's staging, with the counts, and the peer packs them into `out` (module docstring).

    Args:
        rows: rows of x (every rank passes the same number).
        out_rows: rows of out: room for what may arrive.
        row_shape: the shape of one row (`x.shape[1:]`).
        dtype: any dtype of `DTYPES` (the rows are moved as bits).
        experts_per_rank: G, the chunks per rank of the 2-D layouts (1 for `all_to_all_v`).
        layout: "rank" (`all_to_all_v`), "expert" (`all_to_all_v_2d`) or "expert_offset"
            (`all_to_all_v_2d_offset`).
        programs: the most programs (blocks, so SMs) a call runs (default one per SM).

    Raises:
        ValueError: a dtype it does not take, sizes that are not positive ints, an unknown layout,
            or staging that would pass 2^31 elements.
    """

    def __init__(self, rows: int, out_rows: int, row_shape: tuple, dtype: torch.dtype, experts_per_rank: int = 1,
                 layout: str = "rank", programs: int | None = None):
        if layout not in LAYOUTS:
            raise ValueError(f"all_to_all_v: unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
        if dtype not in DTYPES:
            raise ValueError(f"all_to_all_v moves {', '.join(str(d) for d in DTYPES)}; got {dtype}")
        for name, value, least in (("rows", rows, 0), ("out_rows", out_rows, 0),
                                   ("experts_per_rank", experts_per_rank, 1)):
            if not isinstance(value, int) or value < least:
                raise ValueError(f"all_to_all_v: {name} must be an int of at least {least}, got {value!r}")
        self.world = w = tridist.world()
        self.rows, self.out_rows, self.row_shape, self.dtype = rows, out_rows, tuple(row_shape), dtype
        self.width = max(1, int(torch.Size(self.row_shape).numel()))
        self.experts, self.layout = experts_per_rank, layout
        self.w_pad = exchange.matrix_pad(w.world_size)
        self.g_pad = exchange.matrix_pad(experts_per_rank)
        checks.check_offsets("all_to_all_v", w.world_size * rows * self.width)
        limit = sizing.programs_limit(programs, w)
        self.splits = max(1, limit // w.world_size)  # programs per destination; fitted at the first call
        self.fitted = False
        self.block_w = triton.next_power_of_2(min(self.width, TILE // BLOCK_R))
        # At least a row per source: the kernel takes a staging pointer even when nothing is sent.
        self.workspace = protocol.Workspace(w.world_size * max(rows, 1) * self.width, _WORDS[dtype.itemsize],
                                             w.world_size * self.splits, "all_to_all_v")
        self.counts = tridist.symm_zeros((2, self.w_pad * self.g_pad), torch.int32)

    def _check(self, x: torch.Tensor, splits: torch.Tensor, out: torch.Tensor, splits_name: str,
               splits_shape: tuple, major_align: int) -> None:
        checks.check_input(x, "x", DTYPES)
        if not isinstance(major_align, int) or major_align < 1:
            raise ValueError(f"major_align must be a positive int, got {major_align!r}")
        expected = (self.rows, *self.row_shape)
        if tuple(x.shape) != expected or x.dtype != self.dtype:
            raise ValueError(f"this all-to-all was built for x of shape {expected} and dtype {self.dtype}; got "
                             f"{tuple(x.shape)} {x.dtype}: build another, or call the function, which keeps one "
                             "per shape")
        check_tensor(splits, splits_name)
        if splits.dtype != torch.int64 or tuple(splits.shape) != splits_shape or splits.device != x.device:
            raise ValueError(f"{splits_name} must be an int64 tensor of shape {splits_shape} on {x.device}; got "
                             f"{splits.dtype} of shape {tuple(splits.shape)} on {splits.device}")
        checks.check_output(out, (self.out_rows, *self.row_shape), self.dtype)

    def _launch(self, x, splits, offsets, out, major_align: int, layout: int) -> torch.Tensor:
        w = self.world
        result = torch.empty((2, w.world_size * self.experts), dtype=torch.int64, device=x.device)
        ws = self.workspace
        args = (as_words(x), splits, offsets, as_words(out), result, ws.staging, self.counts, ws.flags, ws.calls,
                self.width, self.rows, self.out_rows, self.experts, major_align, ws.slot_numel, w.local_world_size)
        meta = {"LAYOUT": layout, "W_PAD": self.w_pad, "G_PAD": self.g_pad, "BLOCK_R": BLOCK_R,
                "BLOCK_W": self.block_w}
        if not self.fitted:  # a program waits for a flag another program of its launch raises
            self.splits = sizing.fit_coresident(all_to_all_v_kernel, self.splits, w.world_size, *args,
                                                   splits=self.splits, **meta)
            self.fitted = True
        all_to_all_v_kernel[(w.world_size, self.splits)](*args, splits=self.splits, coresident=True, **meta)
        return result

    def __call__(self, x: torch.Tensor, in_splits: torch.Tensor, out: torch.Tensor,
                 major_align: int = 1) -> torch.Tensor:
        """One call in the layout the instance was built for ("expert_offset": `in_splits` is the
        (2, world_size * experts_per_rank) splits and offsets); see the module's functions."""
        chunks = self.world.world_size * self.experts
        offsets = self.layout == "expert_offset"
        name, shape = ("in_splits_offsets", (2, chunks)) if offsets else ("in_splits", (chunks,))
        checks.agree("all_to_all_v", lambda: self._check(x, in_splits, out, name, shape, major_align),
                        {"layout": self.layout, "shape of x": checks.shape_of(x),
                         "shape of out": checks.shape_of(out)})
        if offsets:
            return self._launch(x, in_splits[0], in_splits[1], out, 1, 2)
        return self._launch(x, in_splits, in_splits, out, major_align, 0 if self.layout == "rank" else 1)

    def free(self) -> None:
        """Give the symmetric buffers back (collective)."""
        self.workspace.free()
        tridist.symm_free(self.counts)


def _call(x: torch.Tensor, splits: torch.Tensor, out: torch.Tensor, splits_name: str, layout: str,
          major_align: int = 1) -> torch.Tensor:
    def check() -> None:
        checks.check_input(x, "x", DTYPES)
        if x.dim() < 1:
            raise ValueError("x must have a dimension of rows")
        check_tensor(out, "out")
        check_tensor(splits, splits_name)
        if splits.dim() < 1 or splits.shape[-1] % world_size or not splits.shape[-1]:
            raise ValueError(f"{splits_name} has shape {tuple(splits.shape)}: its rows must hold world_size * "
                             f"experts_per_rank entries (world size {world_size})")

    world_size = tridist.world().world_size
    checks.agree(f"all_to_all_v ({layout} layout)", check,
                    {"shape of x": checks.shape_of(x), "shape of out": checks.shape_of(out),
                     splits_name: checks.shape_of(splits)})
    experts = splits.shape[-1] // world_size
    op = instances.instance(lambda: AllToAllV(x.shape[0], out.shape[0], x.shape[1:], x.dtype, experts, layout),
                            AllToAllV, x.shape[0], out.shape[0], tuple(x.shape[1:]), x.dtype, experts, layout,
                            device=x.device)
    return op(x, splits, out, major_align)


def all_to_all_v(x: torch.Tensor, in_splits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Send in_splits[p] rows of x to rank p, for every p; receive into `out`, in rank order,
    packed. Same meaning as PyTorch's `all_to_all_vdev`; the splits never leave the device.

    A collective: every rank calls it with x and out of the same shapes and dtype.

    Args:
        x: the rows for rank 0, then rank 1, ... (any row shape; bf16, fp16, fp32, fp8, integers).
        in_splits: int64 device tensor of `world_size` row counts (summing to at most x's rows).
        out: room for the rows that may arrive, x's row shape and dtype. More rows arriving than
            it holds is an error raised on the device in the emulator and with TRIDIST_DEBUG=1
            (`tridist.DeviceCheckError`, naming the rank and the counts); on GPUs without debug
            the rows past its end are dropped, and the returned splits still say how many came.

    Returns:
        int64 device tensor (2, world_size): rows received from each rank, and where they start
        in `out`.

    Raises:
        ValueError: before any launch, for a dtype, shape, device or layout it does not take.
    """
    return _call(x, in_splits, out, "in_splits", "rank")


def all_to_all_v_2d(x: torch.Tensor, in_splits: torch.Tensor, out: torch.Tensor, major_align: int = 1) -> torch.Tensor:
    """The dispatch of expert parallelism: rank-major chunks in, expert-major out. Same meaning as
    PyTorch's `all_to_all_vdev_2d`.

    Args:
        x: chunks rank-major: for each destination rank p, its experts' chunks in order.
        in_splits: int64 device tensor of world_size * experts_per_rank row counts,
            in_splits[p * experts_per_rank + e] for local expert e of rank p.
        out: room for what may arrive; receives, for each of this rank's experts, the chunks from
            rank 0, 1, ...; the first chunk of each expert at a multiple of `major_align`, each
            expert taking at least `major_align` rows, an empty one too (as PyTorch's; rows between
            experts are left as they were). Overflow as in `all_to_all_v`.
        major_align: alignment of each expert's first row (e.g. a GEMM's tile height).

    Returns:
        int64 (2, world_size * experts_per_rank), expert-major ([e * world_size + s]): the rows
        from rank s for local expert e, and where they start in `out`.
    """
    return _call(x, in_splits, out, "in_splits", "expert", major_align)


def all_to_all_v_2d_offset(x: torch.Tensor, in_splits_offsets: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The combine of expert parallelism, the inverse of `all_to_all_v_2d`: expert-major chunks at
    given offsets in, rank-major packed out. Same meaning as PyTorch's `all_to_all_vdev_2d_offset`.

    Args:
        x: this rank's expert outputs: chunk (e, p), for local expert e and destination rank p,
            at row in_splits_offsets[1, e * world_size + p] (padding between chunks is not sent).
        in_splits_offsets: int64 (2, world_size * experts_per_rank): rows and offsets of each
            chunk, expert-major (what `all_to_all_v_2d` returned).
        out: receives from rank 0 its experts' chunks for this rank in expert order, then from
            rank 1, ..., packed. Overflow as in `all_to_all_v`.

    Returns:
        int64 (2, world_size * experts_per_rank), rank-major ([s * experts_per_rank + e]): rows
        received from expert e of rank s, and where they start in `out`.
    """
    return _call(x, in_splits_offsets, out, "in_splits_offsets", "expert_offset")


def _new_out(x: torch.Tensor, out_rows: int) -> torch.Tensor:
    return x.new_empty((out_rows, *x.shape[1:]))


@torch.library.custom_op("tridist::all_to_all_v", mutates_args=())
def all_to_all_v_op(x: torch.Tensor, in_splits: torch.Tensor, out_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`all_to_all_v` as a PyTorch custom op (`torch.ops.tridist.all_to_all_v`), for torch.compile:
    `out` is a new tensor of `out_rows` rows; returns (out, out_splits_offsets)."""
    out = _new_out(x, out_rows)
    return out, all_to_all_v(x, in_splits, out)


@all_to_all_v_op.register_fake
def _all_to_all_v_shape(x: torch.Tensor, in_splits: torch.Tensor, out_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _new_out(x, out_rows), in_splits.new_empty((2, tridist.world().world_size))


@torch.library.custom_op("tridist::all_to_all_v_2d", mutates_args=())
def all_to_all_v_2d_op(x: torch.Tensor, in_splits: torch.Tensor, out_rows: int,
                       major_align: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """`all_to_all_v_2d` as a custom op (`torch.ops.tridist.all_to_all_v_2d`): returns (out,
    out_splits_offsets)."""
    out = _new_out(x, out_rows)
    return out, all_to_all_v_2d(x, in_splits, out, major_align)


@all_to_all_v_2d_op.register_fake
def _all_to_all_v_2d_shape(x: torch.Tensor, in_splits: torch.Tensor, out_rows: int,
                           major_align: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return _new_out(x, out_rows), in_splits.new_empty((2, in_splits.shape[0]))


@torch.library.custom_op("tridist::all_to_all_v_2d_offset", mutates_args=())
def all_to_all_v_2d_offset_op(x: torch.Tensor, in_splits_offsets: torch.Tensor,
                              out_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`all_to_all_v_2d_offset` as a custom op (`torch.ops.tridist.all_to_all_v_2d_offset`): returns
    (out, out_splits_offsets)."""
    out = _new_out(x, out_rows)
    return out, all_to_all_v_2d_offset(x, in_splits_offsets, out)


@all_to_all_v_2d_offset_op.register_fake
def _all_to_all_v_2d_offset_shape(x: torch.Tensor, in_splits_offsets: torch.Tensor,
                                  out_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _new_out(x, out_rows), in_splits_offsets.new_empty(tuple(in_splits_offsets.shape))
