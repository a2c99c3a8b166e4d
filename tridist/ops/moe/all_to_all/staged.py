"""The all-to-all-v's method: one network round into per-source staging (the family's protocol,
`moe/_exchange.py`), in any world and node layout.

Program (p, s) of a call (grid (world, splits)):
1. sends its share s of the rows for rank p (the chunks for p, concatenated in expert order, cut in
   `splits` parts) into region `rank` of p's staging, which holds as many rows as x; writes its
   count per chunk into row `rank` of p's counts, and raises flag (rank, s) on p to the epoch;
2. waits for flag (q, s) from every rank q: every count is then here, and q's part s too;
3. lays out the output from every source's counts and copies part s of rank p's region into it.
A receiver's part s is the sender's part s (both cut the same total in the same way), so one flag
covers it. The layout is computed alike by every program from the counts, in rank order. Every
call waits for a flag from every peer, so two slots of staging, counts and flags (by epoch) need
no handshake.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

import tridist
import tridist.language as dl
from tridist.runtime.jit import jit

from ... import checks, protocol, sizing
from ...protocol import after_flags, finish_call, in_slot
from ...method import Method
from .._exchange import (chunk_of, copy_rows, exchange_program, gather, matrix_pad, raise_flag, send_rows,
                         send_values, split_rows)

LAYOUTS = ("rank", "expert", "expert_offset")  # the kernel's LAYOUT is the index
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
BLOCK_R = 8       # rows a step moves
TILE = 4096       # elements a step moves at most: BLOCK_R rows of up to TILE // BLOCK_R


def as_words(t: torch.Tensor) -> torch.Tensor:
    """`t` viewed as integers of its element size: the kernel moves bits, whatever they mean."""
    return t.view(_WORDS[t.element_size()])


class Staging(NamedTuple):
    """The kernel's symmetric buffers, one tuple argument (unpacked by position in the kernel: a
    kernel compiled from the compile log sees a plain tuple, without the names)."""
    rows: torch.Tensor       # [2, slot_numel]: per slot, a region of `region` rows per source
    counts: torch.Tensor     # int32 [2, W_PAD * G_PAD]: per slot, a row of G_PAD per source
    flags: torch.Tensor      # [2, world * splits]: per slot, flag (source, split)
    calls: torch.Tensor      # the calls counter (`protocol.call_epoch`)
    slot_numel: int


@jit
def all_to_all_v_kernel(x_ptr, splits_ptr, offsets_ptr, out_ptr, result_ptr, staging, width, region, out_rows,
                        experts, major_align, local_world_size, splits, LAYOUT: tl.constexpr, W_PAD: tl.constexpr,
                        G_PAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, group=None):
    """Grid (world, splits). x, out: rows of `width` elements; staging: a `Staging`, `region` rows a
    source. LAYOUT 0: rank-major in and out; 1: rank-major in, expert-major out (aligned to
    `major_align`); 2: expert-major in at offsets_ptr, rank-major out. result: [2, world * experts]
    int64, the rows received per chunk and where they start in out. Ranks (the world, the peers,
    `local_world_size`) are of `group`, if given."""
    staging_ptr, counts_ptr, flags_ptr, calls_ptr, slot_numel = staging
    epoch, me, world, peer, split, stage = exchange_program(calls_ptr, staging_ptr, slot_numel, group)
    counts = in_slot(counts_ptr, epoch, W_PAD * G_PAD)
    flags = in_slot(flags_ptr, epoch, world * splits)
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
                  width, peer, local_world_size, BLOCK_R, BLOCK_W, group)
    send_values(counts, me * G_PAD + experts_, chunk, real, peer, local_world_size, G_PAD, group)
    raise_flag(flags + me * splits + split, epoch, peer, local_world_size, group)

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
        copy_rows(stage + peer * region * width, rows, out_ptr, target, (rows < stop) & (target < out_rows),
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


class Staged(Method):
    """The all-to-all-v of `rows` rows of `width` elements of `dtype` (moved as bits) into
    `out_rows`, `experts` chunks per rank, in `layout` (one of LAYOUTS), at most `programs`
    programs a call, among `ranks` (an `ops.ranks.Ranks`). Staging: per source as many rows as x,
    two slots.

    Raises:
        ValueError: staging that would pass 2^31 elements.
    """

    name = "staged"

    def __init__(self, rows: int, out_rows: int, width: int, dtype: torch.dtype, experts: int, layout: str,
                 programs: int, ranks):
        super().__init__()
        self.ranks = w = ranks
        self.rows, self.out_rows, self.width, self.experts = rows, out_rows, width, experts
        self.layout = LAYOUTS.index(layout)
        self.w_pad, self.g_pad = matrix_pad(w.world_size), matrix_pad(experts)
        checks.check_offsets("all_to_all_v", w.world_size * rows * width)
        self.splits = max(1, programs // w.world_size)  # programs per destination; fitted at the first call
        self.fitted = False
        self.block_w = triton.next_power_of_2(min(width, TILE // BLOCK_R))
        # At least a row per source: the kernel takes a staging pointer even when nothing is sent.
        workspace = self.own(protocol.Workspace(w.world_size * max(rows, 1) * width, _WORDS[dtype.itemsize],
                                                 w.world_size * self.splits, "all_to_all_v", w.group))
        counts = self.own(tridist.symm_zeros((2, self.w_pad * self.g_pad), torch.int32, w.group))
        self.send = self.send_buffer(w, rows * width, _WORDS[dtype.itemsize], "all_to_all_v")
        self.staging = Staging(rows=workspace.staging, counts=counts, flags=workspace.flags, calls=workspace.calls,
                               slot_numel=workspace.slot_numel)

    def launch(self, x: torch.Tensor, in_splits: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor,
               major_align: int) -> torch.Tensor:
        """One call: rows of x by `in_splits` (and, in the "expert_offset" layout, `offsets`) into out;
        returns the int64 [2, world * experts] rows received per chunk and where they start."""
        w = self.ranks
        result = torch.empty((2, w.world_size * self.experts), dtype=torch.int64, device=x.device)
        args = dict(x_ptr=self.sendable(as_words(x), self.send), splits_ptr=in_splits, offsets_ptr=offsets,
                    out_ptr=as_words(out), result_ptr=result, staging=self.staging, width=self.width, region=self.rows,
                    out_rows=self.out_rows, experts=self.experts, major_align=major_align,
                    local_world_size=w.local_world_size, LAYOUT=self.layout, W_PAD=self.w_pad, G_PAD=self.g_pad,
                    BLOCK_R=BLOCK_R, BLOCK_W=self.block_w, group=w.group)
        if not self.fitted:  # a program waits for a flag another program of its launch raises
            self.splits = sizing.fit_coresident(all_to_all_v_kernel, self.splits, w.world_size, splits=self.splits,
                                                   **args)
            self.fitted = True
        all_to_all_v_kernel[(w.world_size, self.splits)](splits=self.splits, coresident=True, **args)
        return result
