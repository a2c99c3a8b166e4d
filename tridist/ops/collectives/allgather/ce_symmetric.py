"""All-gather method "ce" into a symmetric `out` (one node, several ranks): the copy engines write
each shard straight into every peer's `out`, with no staging.

Protocol. `out` is a symmetric tensor, the same on every rank (`tridist.symm_empty`; the front checks
it). Each call runs between two barriers on the stream (the method's own `sync.Barrier`): the first
says every peer has reached this call, so its `out` may be overwritten (it has finished reading the
last call's result on its stream); then a side stream per peer (`PeerStreams`: separate copy
engines) writes x into row `rank` of that peer's `out`, and this rank copies x into its own row
(unless x is that row already); the second barrier says every peer's shard has landed here. The
fastest all-gather of large messages into a symmetric `out` (`policy.CE_SYMMETRIC_MIN_BYTES`). The
SM methods stage as usual even into a symmetric `out`: a push straight into the peers' `out` from
every SM was slower than the sliced push (benchmarks/NOTES.md, "Moved from the code's docstrings
(issue 41)").
"""
import torch

import tridist

from ... import sync
from ...copy_engines import PeerStreams
from ...method import Method


class CopyEnginesIntoOut(Method):
    """The copy-engine all-gather into a symmetric `out` among `ranks` (an `ops.ranks.Ranks`),
    built for shards of `numel` elements (any dtype; `programs` unused: no kernel runs)."""

    name = "ce"
    one_node = True

    def __init__(self, numel: int, dtype: torch.dtype, programs: int, ranks):
        super().__init__()
        self.ranks = ranks
        self.numel = numel
        self.streams = PeerStreams(ranks)
        self.barrier = self.own(sync.Barrier(ranks.group))

    def launch(self, x: torch.Tensor, out: torch.Tensor) -> None:
        ranks, n = self.ranks, self.numel
        mine = slice(ranks.rank * n, (ranks.rank + 1) * n)
        self.barrier()  # every peer's out may be written
        for index, peer in enumerate(self.streams.peers):
            with self.streams.side(index):
                tridist.peer_tensor(out, peer, ranks.group).view(-1)[mine].copy_(x.view(-1))
        own = out.view(-1)[mine]
        if own.data_ptr() != x.data_ptr():
            own.copy_(x.view(-1))
        self.streams.join()
        self.barrier()  # every peer's shard has landed here
