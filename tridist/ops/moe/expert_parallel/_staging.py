"""What the expert-parallel methods (`normal`, `low_latency`) share: the layer they are built for,
the symmetric staging each allocates and the co-resident launch over (world, splits) that fills and
drains it, the sizes of their steps, and the sum with which both combines end."""
import dataclasses

import torch
import triton
import triton.language as tl

import tridist
import tridist.language as dl

from ... import sizing
from ...method import Method
from ...ranks import Ranks

BLOCK_R = 8       # rows a step moves
TILE = 8192       # elements a step moves at most


@dataclasses.dataclass(frozen=True)
class Layer:
    """What an `EPBuffer` was built for, as its methods take it: `num_experts` experts,
    `experts_local` of them on each rank, tokens of `hidden` elements of `dtype`, at most
    `max_tokens` tokens a rank; `w_pad` and `e_pad` the sides of a receiver's count matrix
    (`_exchange.matrix_pad`); `splits` programs per destination asked for (fewer where a
    co-resident grid cannot hold them); `ranks` the ranks it runs among (the world or a group)."""
    num_experts: int
    experts_local: int
    hidden: int
    max_tokens: int
    dtype: torch.dtype
    w_pad: int
    e_pad: int
    splits: int
    ranks: Ranks


def token_words(t: torch.Tensor) -> torch.Tensor:
    """Tokens as 4-byte words, as the kernels move them."""
    return t.view(torch.int32)


def nonempty(t: torch.Tensor) -> torch.Tensor:
    """`t`, or one row of zeros where it has no rows (a rank with no tokens): the kernels read none of
    it, their loops stopping at the token count, but on GPUs an empty tensor has no address to pass."""
    return t if t.shape[0] else t.new_zeros((1, *t.shape[1:]))


def block_w(width: int, rows: int = BLOCK_R) -> int:
    """BLOCK_W of a step of `rows` rows of `width` elements: TILE elements at most."""
    return triton.next_power_of_2(min(width, TILE // rows))


def combine_blocks(layer: Layer) -> dict:
    """The combines' tiles: (BLOCK_R, BLOCK_W) of TILE elements, as few rows as a program may sum
    (the tokens of max_tokens_per_rank over the world x splits programs: one row each at 128
    tokens on an H100), and 8 warps for the parts' loads in flight at once. Fixed per buffer:
    every call launches the variant whose co-resident grid `Exchange.fit` measured."""
    rows = min(BLOCK_R, triton.next_power_of_2(triton.cdiv(layer.max_tokens, layer.ranks.world_size * layer.splits)))
    return {"BLOCK_R": rows, "BLOCK_W": block_w(layer.hidden, rows), "num_warps": 8}


class Exchange(Method):
    """An expert-parallel method: symmetric staging (two slots, by call epoch) that its kernels fill
    and drain over a grid (world, splits), co-resident, since receiving programs wait for counters
    that sending programs of the same launch raise. At the first launch the splits shrink to what a
    co-resident grid can hold (`fit`); every launch then has the same grid, which their call epochs
    count on. `kind` names the allocations in the report of a wait that expires on them ("EPBuffer
    dispatch staging"). The ranks are the layer's: the world, or a group, whose members alone
    allocate the staging and whose handle the kernels get as their `group`."""

    def __init__(self, layer: Layer, kind: str):
        super().__init__()
        self.layer = layer
        self.ranks = layer.ranks
        self.kind = f"EPBuffer {kind}"
        self.splits = layer.splits
        self.fitted = False

    def symmetric(self, what: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed symmetric tensor of this method's, named `what` in wait reports."""
        return self.own(tridist.symm_zeros(shape, dtype, self.ranks.group, name=f"{self.kind} {what}"))

    def signals(self, what: str, count: int) -> torch.Tensor:
        """`count` signal words of this method's, named `what` in wait reports."""
        return self.own(tridist.signals(count, self.ranks.group, name=f"{self.kind} {what}"))

    def fit(self, kernel, **args) -> None:
        """At the first call, shrink the splits to what a co-resident launch of `kernel` with these
        arguments can hold."""
        if not self.fitted:
            self.splits = sizing.fit_coresident(kernel, self.splits, self.ranks.world_size, splits=self.splits,
                                                   group=self.ranks.group, **args)
            self.fitted = True

    def start(self, kernel, coresident: bool = True, **args) -> None:
        """Launch `kernel` over (world, splits), within the layer's group; co-resident unless it only
        sends or only receives."""
        self.fit(kernel, **args)
        kernel[(self.ranks.world_size, self.splits)](splits=self.splits, coresident=coresident,
                                                     group=self.ranks.group, **args)


@triton.jit
def sum_parts(stage, out_ptr, first, stop, hidden, present_ptr, weights_ptr, own_ptr, own_at_ptr, own_rows_ptr,
              max_tokens, experts_local, PARTS: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK_R: tl.constexpr,
              BLOCK_W: tl.constexpr, group=None):
    """What both combines end with: out[t] = the sum over j < PARTS, in j order, in fp32, of part j
    of token t, for the tokens t in [first, stop). Part j is there where present[t * PARTS + j] >= 0.
    The loop over the parts is unrolled, so that their loads are in flight together (a program may
    have a single token: 128 tokens over 132 programs at one rank).
    Parts that this rank's own experts made are read where they are, in y (`own_ptr`), which
    nothing copied to the staging:
    - WEIGHTED (low-latency mode): present holds the expert ids; part j is the pair (t, k = j)
      times weights[t * PARTS + j], in staging row t * PARTS + j, or for an expert e of this rank
      in y's row e * world * max_tokens + own_at[e] + own_rows[t * PARTS + j] (where the dispatch
      placed the pair);
    - else (normal mode): present holds the token's place among those sent to rank j; part j is
      what rank j sent, already weighted, in staging row j * max_tokens + t, or for j = this rank
      in y's row own_at[0] + the place.
    Ranks (this one, j) are of `group`, if given."""
    me = dl.rank(group)
    world = dl.num_ranks(group)
    columns = tl.arange(0, BLOCK_W)[None, :]
    for token in range(first, stop, BLOCK_R):
        rows = token + tl.arange(0, BLOCK_R)
        inside = rows < stop
        for column in range(0, hidden, BLOCK_W):
            where = column + columns
            total = tl.zeros([BLOCK_R, BLOCK_W], dtype=tl.float32)
            for j in tl.static_range(PARTS):
                index = rows.to(tl.int64) * PARTS + j
                value = tl.load(present_ptr + index, mask=inside, other=-1)
                present = inside & (value >= 0)
                if WEIGHTED:
                    own = present & (value // experts_local == me)
                    expert = value - me * experts_local
                    place = tl.load(own_rows_ptr + index, mask=own, other=0)
                    present = present & ~(own & (place >= max_tokens))  # a pair the dispatch dropped
                    own_row = expert * world * max_tokens + tl.load(own_at_ptr + expert, mask=own, other=0) + place
                    row = index
                    weight = tl.load(weights_ptr + index, mask=present, other=0.0)
                else:
                    own = present & (j == me)
                    own_row = tl.load(own_at_ptr) + value
                    row = (j * max_tokens + rows).to(tl.int64)
                    weight = present.to(tl.float32)
                source = tl.where(own[:, None], own_ptr + own_row.to(tl.int64)[:, None] * hidden,
                                  stage + row[:, None] * hidden)
                part = tl.load(source + where, mask=present[:, None] & (where < hidden), other=0.0)
                total += weight[:, None] * part.to(tl.float32)
            tl.store(out_ptr + rows.to(tl.int64)[:, None] * hidden + where, total.to(out_ptr.dtype.element_ty),
                     mask=inside[:, None] & (where < hidden))
