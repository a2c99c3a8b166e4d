"""Method "ll" (one node, decode sizes): every rank sends its x to every peer as low-latency
packets, then sums each row over the ranks, adds the residual and norms it: one kernel.

Protocol (`protocol` for slots and call epochs; `dl.ll` and `PacketRows` for the packets). x is
viewed as 4-byte words (a row must be whole words: an even hidden size for 16-bit data), each
travelling with the low 32 bits of the call's epoch as its flag, so that the reader polls the data
itself: no separate signal, no fence. Program s owns a contiguous range of rows, the same on every
rank. It first writes the words of its rows into row `rank` of every peer's packets; then, row by
row, it reads rank p's words of the row from its own packets (p's row there, once their flags
equal this call's epoch; its own words from x), sums them in rank order in fp32 (rank 0's, plus
rank 1's, ...), adds the residual and norms (`_rows`). A program waits only for the packets of the
same program on the peers, which every rank's program sends before it waits: any grid finishes.
Two slots suffice because every call receives a packet from every peer. The unfused reference:
`all_reduce(x)` summed in fp32 (not rounded), `+ residual`, then the local method's norm.
"""
import torch
import triton
import triton.language as tl

import tridist.language as dl
from tridist.runtime.jit import jit

from .. import checks, sizing
from ..method import Method
from ..protocol import LL_BLOCK, PacketRows, call_epoch, finish_call, in_slot, unpack_halves
from . import policy
from ._rows import add_residual, inverse_rms, mean_arguments, normed_row

SEND_STEP = tl.constexpr(LL_BLOCK)  # words a program sends per step


@triton.jit
def _rank_terms(p, me, x_words, stage, row, at, mask, epoch, DTYPE: tl.constexpr):
    """Rank p's x at the words `at` of a row, as fp32 elements in order (two per word for 16-bit
    data): this rank's from x, a peer's from its packets once they have arrived."""
    if p == me:
        words = tl.load(x_words + at, mask=mask, other=0)
    else:
        words = dl.ll.recv(stage + p * row + at, epoch, mask)
    # both arms of a constexpr `if`, not an early return: Triton compiles what follows a return too
    if DTYPE == tl.float32:
        terms = words.to(tl.float32, bitcast=True)
    else:
        low, high = unpack_halves(words, DTYPE)
        terms = tl.interleave(low, high)
    return terms


@jit
def all_reduce_rms_norm_ll_kernel(x_words, residual_ptr, weight_ptr, y_ptr, new_residual_ptr, packets_ptr, calls_ptr,
                                  tokens, hidden, row, slot_numel, eps, count, factor, DTYPE: tl.constexpr,
                                  DIVIDE: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, group=None):
    """x_words: x as int32 words, hidden / PER_WORD a row; the packets as the module docstring
    says (`row` words apart); ranks of `group` (None: the world)."""
    PER_WORD: tl.constexpr = 32 // DTYPE.primitive_bitwidth
    BLOCK_W: tl.constexpr = BLOCK // PER_WORD
    epoch = call_epoch(calls_ptr)
    me = dl.rank(group)
    world = dl.num_ranks(group)
    stage = in_slot(packets_ptr, epoch, slot_numel)
    row_words = hidden // PER_WORD
    per_program = tl.cdiv(tokens, tl.num_programs(0))
    first = tl.program_id(0) * per_program
    last = tl.minimum(first + per_program, tokens)
    sent = tl.arange(0, SEND_STEP)
    for step in range(1, world):
        remote = dl.symm_at(stage + me * row, (me + step) % world, group)
        for offset in range(first * row_words, last * row_words, SEND_STEP):
            mask = offset + sent < last * row_words
            dl.ll.send(remote + offset + sent, tl.load(x_words + offset + sent, mask=mask), epoch, mask)
    words = tl.arange(0, BLOCK_W)
    columns = tl.arange(0, BLOCK)
    for r in range(first, last):
        base = tl.cast(r, tl.int64) * hidden
        squares = tl.zeros([BLOCK], tl.float32)
        h = tl.zeros([BLOCK], tl.float32)
        for start in range(0, hidden, BLOCK):
            at = r * row_words + start // PER_WORD + words
            in_row = start // PER_WORD + words < row_words
            total = _rank_terms(0, me, x_words, stage, row, at, in_row, epoch, DTYPE)
            for p in range(1, world):
                total += _rank_terms(p, me, x_words, stage, row, at, in_row, epoch, DTYPE)
            mask = start + columns < hidden
            h = add_residual(total, residual_ptr, new_residual_ptr, base + start + columns, mask)
            squares += h * h
        rstd = inverse_rms(squares, count, factor, eps, DIVIDE)
        normed_row(h, rstd, new_residual_ptr, weight_ptr, y_ptr, base, hidden, BLOCK, ONE_PASS)
    finish_call(calls_ptr)


class Packets(Method):
    """The LL method among `ranks` (an `ops.ranks.Ranks`) for `tokens` rows of `hidden` elements of
    `dtype` (whole 4-byte words a row), on at most `programs` programs (one or more rows each);
    `block`: the chunk of a row (`policy.row_shape`).

    Raises:
        ValueError: a row that is not whole 4-byte words, or packets past 2^31 words.
    """

    name = "ll"
    one_node = True

    def __init__(self, tokens: int, hidden: int, dtype: torch.dtype, block: int | None, programs: int, ranks):
        super().__init__()
        if hidden * dtype.itemsize % 4:
            raise ValueError(f"all_reduce_rms_norm method 'll' moves 4-byte words: a row of {hidden} {dtype} elements "
                             "is not whole words; use method='one_shot' (or 'auto')")
        self.ranks = ranks
        self.tokens, self.hidden, self.dtype = tokens, hidden, dtype
        self.block, self.warps, self.one_pass = policy.row_shape(hidden, block)
        self.programs = policy.row_programs(tokens, programs)
        checks.check_offsets("all_reduce_rms_norm", ranks.world_size * sizing.row_stride(
            tokens * hidden * dtype.itemsize // 4))
        self.workspace = self.own(PacketRows("all_reduce_rms_norm", tokens * hidden * dtype.itemsize, self.programs,
                                             ranks=ranks))

    def launch(self, x, residual, weight, eps, y, new_residual) -> None:
        ws = self.workspace
        all_reduce_rms_norm_ll_kernel[(self.programs,)](
            x_words=x.view(torch.int32), residual_ptr=residual, weight_ptr=weight, y_ptr=y,
            new_residual_ptr=new_residual, packets_ptr=ws.staging, calls_ptr=ws.calls, tokens=self.tokens,
            hidden=self.hidden, row=ws.row, slot_numel=ws.slot_numel, DTYPE=checks.TRITON_DTYPES[self.dtype],
            BLOCK=self.block, ONE_PASS=self.one_pass, group=self.ranks.group, num_warps=self.warps,
            enable_fp_fusion=False, **mean_arguments(self.tokens, self.hidden, x.device, eps))
