"""All-to-all-v with the splits on the device: each rank sends a variable number of rows to every
rank, the counts coming from routing computed on the GPU, so no call reads them on the host. The
front of the op: the checks, and the instances the functions keep; the work is `staged`'s.

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
"""
import torch

from tridist.runtime.tensors import check_tensor

from ... import checks, instances, sizing
from ...ranks import ranks_of
from .staged import LAYOUTS, Staged

# What the rows may hold: an all-to-all only moves them (fp8 as its bytes).
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8,
          torch.int8, torch.int16, torch.int32, torch.int64)


class AllToAllV:
    """All-to-all-v of rows whose counts are on the device, in the three layouts of
    `all_to_all_v`, `all_to_all_v_2d` and `all_to_all_v_2d_offset`; the buffers of one shape.

    Build it on every rank at once (it allocates symmetric memory); call it back to back on one
    stream, also in CUDA graphs; `free()` it on every rank. The functions keep one per shape,
    dtype, layout and stream.

    The staging holds, per source rank, as many rows as x: 2 x world_size x `rows` rows of
    `row_shape` in all. One network round a call: each rank pushes its rows for every peer into
    that peer's staging, with the counts, and the peer packs them into `out` (`staged`).

    Args:
        rows: rows of x (every rank passes the same number).
        out_rows: rows of out: room for what may arrive.
        row_shape: the shape of one row (`x.shape[1:]`).
        dtype: any dtype of `DTYPES` (the rows are moved as bits).
        experts_per_rank: G, the chunks per rank of the 2-D layouts (1 for `all_to_all_v`).
        layout: "rank" (`all_to_all_v`), "expert" (`all_to_all_v_2d`) or "expert_offset"
            (`all_to_all_v_2d_offset`).
        programs: the most programs (blocks, so SMs) a call runs (default one per SM).
        group: the ranks it runs among: a `torch.distributed` process group, a `tridist.Group`,
            or None for the world. Ranks, splits and chunks are then the group's (rank p is rank
            p of the group); only its members build and call it.

    Raises:
        ValueError: a dtype it does not take, sizes that are not positive ints, an unknown layout,
            staging that would pass 2^31 elements, or a rank outside `group`.
    """

    def __init__(self, rows: int, out_rows: int, row_shape: tuple, dtype: torch.dtype, experts_per_rank: int = 1,
                 layout: str = "rank", programs: int | None = None, group=None):
        if layout not in LAYOUTS:
            raise ValueError(f"all_to_all_v: unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
        if dtype not in DTYPES:
            raise ValueError(f"all_to_all_v moves {', '.join(str(d) for d in DTYPES)}; got {dtype}")
        for name, value, least in (("rows", rows, 0), ("out_rows", out_rows, 0),
                                   ("experts_per_rank", experts_per_rank, 1)):
            if not isinstance(value, int) or value < least:
                raise ValueError(f"all_to_all_v: {name} must be an int of at least {least}, got {value!r}")
        self.ranks = w = ranks_of(group)
        self.rows, self.out_rows, self.row_shape, self.dtype = rows, out_rows, tuple(row_shape), dtype
        self.experts, self.layout = experts_per_rank, layout
        width = max(1, int(torch.Size(self.row_shape).numel()))
        self.method = Staged(rows, out_rows, width, dtype, experts_per_rank, layout,
                             sizing.programs_limit(programs, w), w)

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

    def __call__(self, x: torch.Tensor, in_splits: torch.Tensor, out: torch.Tensor,
                 major_align: int = 1) -> torch.Tensor:
        """One call in the layout the instance was built for ("expert_offset": `in_splits` is the
        (2, world_size * experts_per_rank) splits and offsets); see the module's functions."""
        chunks = self.ranks.world_size * self.experts
        offsets = self.layout == "expert_offset"
        name, shape = ("in_splits_offsets", (2, chunks)) if offsets else ("in_splits", (chunks,))
        checks.agree("all_to_all_v", lambda: self._check(x, in_splits, out, name, shape, major_align),
                        {"layout": self.layout, "shape of x": checks.shape_of(x),
                         "shape of out": checks.shape_of(out)}, group=self.ranks.group)
        if offsets:
            return self.method.launch(x, in_splits[0], in_splits[1], out, major_align=1)
        return self.method.launch(x, in_splits, in_splits, out, major_align)

    def free(self) -> None:
        """Give the symmetric buffers back (collective)."""
        self.method.free()


def _call(x: torch.Tensor, splits: torch.Tensor, out: torch.Tensor, splits_name: str, layout: str,
          major_align: int, group) -> torch.Tensor:
    def check() -> None:
        checks.check_input(x, "x", DTYPES)
        if x.dim() < 1:
            raise ValueError("x must have a dimension of rows")
        check_tensor(out, "out")
        check_tensor(splits, splits_name)
        if splits.dim() < 1 or splits.shape[-1] % world_size or not splits.shape[-1]:
            raise ValueError(f"{splits_name} has shape {tuple(splits.shape)}: its rows must hold world_size * "
                             f"experts_per_rank entries (world size {world_size})")

    ranks = ranks_of(group)  # a rank outside the group is refused here, before anything else
    world_size = ranks.world_size
    checks.agree(f"all_to_all_v ({layout} layout)", check,
                    {"shape of x": checks.shape_of(x), "shape of out": checks.shape_of(out),
                     splits_name: checks.shape_of(splits)}, group=ranks.group)
    experts = splits.shape[-1] // world_size
    op = instances.instance(lambda: AllToAllV(x.shape[0], out.shape[0], x.shape[1:], x.dtype, experts, layout,
                                              group=ranks.group),
                            AllToAllV, x.shape[0], out.shape[0], tuple(x.shape[1:]), x.dtype, experts, layout,
                            ranks.key, device=x.device)
    return op(x, splits, out, major_align)


def all_to_all_v(x: torch.Tensor, in_splits: torch.Tensor, out: torch.Tensor, group=None) -> torch.Tensor:
    """Send in_splits[p] rows of x to rank p, for every p; receive into `out`, in rank order,
    packed. Same meaning as PyTorch's `all_to_all_vdev`; the splits never leave the device.

    A collective: every rank (of `group`) calls it with x and out of the same shapes and dtype.

    Args:
        x: the rows for rank 0, then rank 1, ... (any row shape; bf16, fp16, fp32, fp8, integers).
        in_splits: int64 device tensor of `world_size` row counts (summing to at most x's rows).
        out: room for the rows that may arrive, x's row shape and dtype. More rows arriving than
            it holds is an error raised on the device in the emulator and with TRIDIST_DEBUG=1
            (`tridist.DeviceCheckError`, naming the rank and the counts); on GPUs without debug
            the rows past its end are dropped, and the returned splits still say how many came.
        group: the ranks it runs among: a `torch.distributed` process group (`dist.new_group`,
            a DeviceMesh's `get_group`), a `tridist.Group`, or None for the world. Rank p, the
            splits and world_size are then the group's (rank p of the group; group.size() of
            them); other groups may run their own calls meanwhile.

    Returns:
        int64 device tensor (2, world_size): rows received from each rank, and where they start
        in `out`.

    Raises:
        ValueError: before any launch, for a dtype, shape, device or layout it does not take, or on
            a rank that is not a member of `group`.
    """
    return _call(x, in_splits, out, "in_splits", "rank", 1, group)


def all_to_all_v_2d(x: torch.Tensor, in_splits: torch.Tensor, out: torch.Tensor, major_align: int = 1,
                    group=None) -> torch.Tensor:
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
        group: as for `all_to_all_v`: ranks, their experts and world_size are the group's.

    Returns:
        int64 (2, world_size * experts_per_rank), expert-major ([e * world_size + s]): the rows
        from rank s for local expert e, and where they start in `out`.
    """
    return _call(x, in_splits, out, "in_splits", "expert", major_align, group)


def all_to_all_v_2d_offset(x: torch.Tensor, in_splits_offsets: torch.Tensor, out: torch.Tensor,
                           group=None) -> torch.Tensor:
    """The combine of expert parallelism, the inverse of `all_to_all_v_2d`: expert-major chunks at
    given offsets in, rank-major packed out. Same meaning as PyTorch's `all_to_all_vdev_2d_offset`.

    Args:
        x: this rank's expert outputs: chunk (e, p), for local expert e and destination rank p,
            at row in_splits_offsets[1, e * world_size + p] (padding between chunks is not sent).
        in_splits_offsets: int64 (2, world_size * experts_per_rank): rows and offsets of each
            chunk, expert-major (what `all_to_all_v_2d` returned).
        out: receives from rank 0 its experts' chunks for this rank in expert order, then from
            rank 1, ..., packed. Overflow as in `all_to_all_v`.
        group: as for `all_to_all_v` (the group of the `all_to_all_v_2d` it inverts).

    Returns:
        int64 (2, world_size * experts_per_rank), rank-major ([s * experts_per_rank + e]): rows
        received from expert e of rank s, and where they start in `out`.
    """
    return _call(x, in_splits_offsets, out, "in_splits_offsets", "expert_offset", 1, group)
