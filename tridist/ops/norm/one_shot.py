"""Method "one_shot" (any topology): every rank sends its x to every peer, then sums each row over
the ranks, adds the residual and norms it: one kernel.

Protocol (`protocol` for slots, call epochs and `push_slice`). Program s owns a contiguous range of
rows, the same on every rank. It pushes those rows of x into row `rank` of every peer's staging
(stores through `symm_at` on this node, a put with signal across nodes, from a symmetric copy of x
there: `Method.sendable`), raising the peer's flag (rank, s) to the call's epoch; then it waits for
every peer's flag (p, s) here and, row by row, sums rank 0's x, plus rank 1's, ... in fp32 (its own
from x, the peers' from staging row p), adds the residual and norms (`_rows`). A slot's staging has
a row of tokens * hidden elements per rank, and world_size * programs flags; two slots and call
epochs need no handshake. A program waits only for the same program of its peers, which sends
before it waits: any grid finishes. The unfused reference: `all_reduce(x)` summed in fp32 (not
rounded), `+ residual`, then the local method's norm.
"""
import torch
import triton
import triton.language as tl

import tridist.language as dl
from tridist.runtime.jit import jit

from .. import checks
from ..method import Method
from ..protocol import Workspace, after_flags, call_epoch, finish_call, in_slot, push_slice
from ..sizing import row_stride
from . import policy
from ._rows import add_residual, inverse_rms, mean_arguments, normed_row


@triton.jit
def _rank_terms(p, me, x_ptr, stage, row, offsets, mask):
    """Rank p's x at `offsets` in fp32: this rank's from x, a peer's from its staging row."""
    if p == me:
        terms = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    else:
        terms = tl.load(stage + p * row + offsets, mask=mask, other=0.0)
    return terms.to(tl.float32)


@jit
def all_reduce_rms_norm_one_shot_kernel(x_ptr, residual_ptr, weight_ptr, y_ptr, new_residual_ptr, staging_ptr,
                                        flags_ptr, calls_ptr, tokens, hidden, row, slot_numel, local_world_size, eps,
                                        count, factor, DIVIDE: tl.constexpr, BLOCK: tl.constexpr,
                                        ONE_PASS: tl.constexpr, group=None):
    """[tokens, hidden] tensors (weight [hidden]); staging and flags as the module docstring says
    (rows `row` elements apart); ranks and `local_world_size` of `group` (None: the world)."""
    epoch = call_epoch(calls_ptr)
    me = dl.rank(group)
    world = dl.num_ranks(group)
    programs = tl.num_programs(0)
    s = tl.program_id(0)
    stage = in_slot(staging_ptr, epoch, slot_numel)
    flags = in_slot(flags_ptr, epoch, world * programs)
    per_program = tl.cdiv(tokens, programs)
    first = s * per_program
    last = tl.minimum(first + per_program, tokens)
    for step in range(1, world):
        push_slice(x_ptr, stage + me * row, first * hidden, last * hidden, flags + me * programs + s, epoch,
                   (me + step) % world, local_world_size, BLOCK, group=group)
    for step in range(1, world):
        stage = after_flags(stage, flags + ((me + step) % world) * programs + s, 1, epoch)
    columns = tl.arange(0, BLOCK)
    for r in range(first, last):
        base = tl.cast(r, tl.int64) * hidden
        squares = tl.zeros([BLOCK], tl.float32)
        h = tl.zeros([BLOCK], tl.float32)
        for start in range(0, hidden, BLOCK):
            offsets = base + start + columns
            mask = start + columns < hidden
            total = _rank_terms(0, me, x_ptr, stage, row, offsets, mask)
            for p in range(1, world):
                total += _rank_terms(p, me, x_ptr, stage, row, offsets, mask)
            h = add_residual(total, residual_ptr, new_residual_ptr, offsets, mask)
            squares += h * h
        rstd = inverse_rms(squares, count, factor, eps, DIVIDE)
        normed_row(h, rstd, new_residual_ptr, weight_ptr, y_ptr, base, hidden, BLOCK, ONE_PASS)
    dl.shmem.quiet()
    finish_call(calls_ptr)


class OneShot(Method):
    """The one-shot method among `ranks` (an `ops.ranks.Ranks`) for `tokens` rows of `hidden`
    elements of `dtype`, on at most `programs` programs (one or more rows each); `block`: the chunk
    of a row (`policy.row_shape`).

    Raises:
        ValueError: staging past 2^31 elements.
    """

    name = "one_shot"

    def __init__(self, tokens: int, hidden: int, dtype: torch.dtype, block: int | None, programs: int, ranks):
        super().__init__()
        self.ranks = ranks
        self.tokens, self.hidden = tokens, hidden
        self.block, self.warps, self.one_pass = policy.row_shape(hidden, block)
        self.programs = policy.row_programs(tokens, programs)
        self.row = row_stride(tokens * hidden)
        checks.check_offsets("all_reduce_rms_norm", ranks.world_size * self.row)
        self.workspace = self.own(Workspace(ranks.world_size * self.row, dtype, ranks.world_size * self.programs,
                                            name="all_reduce_rms_norm one_shot", group=ranks.group))
        self.send = self.send_buffer(ranks, tokens * hidden, dtype, "all_reduce_rms_norm one_shot")

    def launch(self, x, residual, weight, eps, y, new_residual) -> None:
        ws = self.workspace
        x = self.sendable(x, self.send)
        all_reduce_rms_norm_one_shot_kernel[(self.programs,)](
            x_ptr=x, residual_ptr=residual, weight_ptr=weight, y_ptr=y, new_residual_ptr=new_residual,
            staging_ptr=ws.staging, flags_ptr=ws.flags, calls_ptr=ws.calls, tokens=self.tokens, hidden=self.hidden,
            row=self.row, slot_numel=ws.slot_numel, local_world_size=self.ranks.local_world_size, BLOCK=self.block,
            ONE_PASS=self.one_pass, group=self.ranks.group, num_warps=self.warps, enable_fp_fusion=False,
            **mean_arguments(self.tokens, self.hidden, x.device, eps))
