"""All-reduce method "ll" (one node, small messages): one-shot in low-latency packets. All of x
travels to every peer, each 4-byte word with the call's epoch as its flag, and every rank sums the
words in rank order, so every rank gets the same bits (`_packets`: the protocol, and the kernel the
reduce-scatter "ll" runs too). x must be whole 4-byte words.
"""
import torch

from ...protocol import PacketRows
from ...method import Method
from .._packets import reduce_packets


class Packets(Method):
    """The LL all-reduce among `ranks` (an `ops.ranks.Ranks`), built for `numel` elements of
    `dtype` per rank (whole 4-byte words), on at most `programs` programs.

    Raises:
        ValueError: x is not whole 4-byte words.
    """

    name = "ll"
    one_node = True

    def __init__(self, numel: int, dtype: torch.dtype, programs: int, ranks):
        super().__init__()
        self.ranks = ranks
        self.workspace = self.own(PacketRows("all_reduce", numel * dtype.itemsize, programs, ranks=ranks))

    def launch(self, x: torch.Tensor, out: torch.Tensor) -> None:
        reduce_packets(self.workspace, x, out, 0, self.ranks)
