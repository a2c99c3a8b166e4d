"""All-reduce method "rs_ag" (any topology): a reduce-scatter, then an all-gather of the sums, two
kernels one after the other on the caller's stream, each the method its own op's policy picks.

Protocol: none of its own. x is world_size chunks of m elements (padded with zeros to whole chunks
where it is not); the reduce-scatter (`policy.choose_reduce_scatter`) sums chunk `rank` over the
ranks straight into this rank's chunk of `out`; the all-gather (`policy.choose_all_gather`) then
takes that chunk as its shard and fills every chunk of `out`. Each keeps its own workspace and
call epochs, so calls run back to back with no barrier; stream order puts the gather after the
sums it sends.

Where the fused two-shot is slower than its two halves run apart (at 4 ranks from 16 MB:
benchmarks/NOTES.md, "rs_ag: the two-shot's halves apart"), this is those halves: `auto` does not
pick it until it is timed beside them (`tridist bench allreduce`).
"""
import torch
import triton

from ...method import Method
from .. import policy
from ..allgather import CLASSES as ALL_GATHER_METHODS
from ..reducescatter import CLASSES as REDUCE_SCATTER_METHODS


class ReduceScatterAllGather(Method):
    """The reduce-scatter + all-gather all-reduce among `ranks` (an `ops.ranks.Ranks`), built for
    `numel` elements of `dtype` per rank, each half on at most `programs` programs."""

    name = "rs_ag"

    def __init__(self, numel: int, dtype: torch.dtype, programs: int, ranks):
        super().__init__()
        self.ranks = ranks
        self.numel = numel
        self.chunk = triton.cdiv(numel, ranks.world_size)
        total = self.chunk * ranks.world_size
        scatter = policy.choose_reduce_scatter(total * dtype.itemsize, ranks)
        gather = policy.choose_all_gather(total * dtype.itemsize, ranks)
        self.methods = (scatter, gather)
        self.scatter = self.own(REDUCE_SCATTER_METHODS[scatter](total, dtype, programs, ranks))
        self.gather = self.own(ALL_GATHER_METHODS[gather](self.chunk, dtype, programs, ranks))
        # x and out padded to world_size whole chunks where they are not already
        self.padded = None if total == numel else torch.zeros(2, total, dtype=dtype, device=ranks.device)

    def launch(self, x: torch.Tensor, out: torch.Tensor) -> None:
        source, target = x.view(-1), out.view(-1)
        if self.padded is not None:
            self.padded[0, :self.numel].copy_(source)
            source, target = self.padded[0], self.padded[1]
        mine = target[self.ranks.rank * self.chunk:(self.ranks.rank + 1) * self.chunk]
        self.scatter.launch(source, mine)
        self.gather.launch(mine, target)
        if self.padded is not None:
            out.view(-1).copy_(target[:self.numel])
