"""Reduce-scatter method "ll" (one node, small messages): chunk p of x travels to rank p in
low-latency packets, each 4-byte word with the call's epoch as its flag, and rank p sums the words
in rank order (`_packets`: the protocol, and the kernel the all-reduce "ll" runs too). Chunks must
be whole 4-byte words.
"""
import torch

from ...protocol import PacketRows
from ...method import Method
from .._packets import reduce_packets


class Packets(Method):
    """The LL reduce-scatter among `ranks` (an `ops.ranks.Ranks`), built for `numel` elements of
    `dtype` per rank (chunks of whole 4-byte words), on at most `programs` programs.

    Raises:
        ValueError: the chunks are not whole 4-byte words.
    """

    name = "ll"
    one_node = True

    def __init__(self, numel: int, dtype: torch.dtype, programs: int, ranks):
        super().__init__()
        self.ranks = ranks
        chunk = numel // ranks.world_size
        self.workspace = self.own(PacketRows("reduce_scatter", chunk * dtype.itemsize, programs, ranks=ranks))

    def launch(self, x: torch.Tensor, out: torch.Tensor) -> None:
        reduce_packets(self.workspace, x, out, self.workspace.words, self.ranks)
