"""All-reduce method "ce" (one node): a copy-engine reduce-scatter, then a copy-engine all-gather of
the reduced chunks; no SM drives NVLink.

Protocol (`copy_engines.CopyEnginePush`, two of them: `scatter` and `gather`). x is world_size chunks
of m elements (the last ranks' shorter). A barrier at the start of each call (the scatter's own)
says every peer has finished with both stagings and their flags. This rank's copy engines write
chunk p of x into row `rank` of rank p's scatter staging, a flag = 1 per transfer chunk (8 MB);
`reduce_ce_kernel` sums this rank's chunk over the ranks as the pieces land (rank order, fp32) into
its part of `out`. The copy engines then write that sum into row `rank` of every peer's gather
staging, and `all_gather_ce_kernel` copies each peer's sum into `out` as it lands. Once the kernels
have run, both transfers' flags are zeroed for the next call. For large messages next to other
work on the SMs: on its own the SM methods are faster, so `auto` does not pick it
(`policy.choose_all_reduce`).

In place (out is x) is safe: a peer's reduced part overwrites x only after the peer has received
all of this rank's x that it needed.
"""
import torch
import triton

from ... import sizing
from ...copy_engines import CopyEnginePush
from ...method import Method
from .._copy_engine import all_gather_ce_kernel, reduce_ce_kernel


class CopyEngines(Method):
    """The copy-engine all-reduce among `ranks` (an `ops.ranks.Ranks`), built for `numel` elements
    of `dtype` per rank; at most `programs` programs sum and copy out (world_size sources share
    them)."""

    name = "ce"
    one_node = True

    def __init__(self, numel: int, dtype: torch.dtype, programs: int, ranks):
        super().__init__()
        self.ranks = ranks
        self.numel = numel
        self.chunk = triton.cdiv(numel, ranks.world_size)
        self.block, self.splits, self.warps = sizing.steps_for(self.chunk, dtype.itemsize,
                                                                  max(1, programs // ranks.world_size),
                                                                  sizing.CE_STEP_BYTES)
        self.scatter = self.own(CopyEnginePush(self.chunk, dtype, ranks, name="all_reduce ce scatter"))
        self.gather = self.own(CopyEnginePush(self.chunk, dtype, ranks, name="all_reduce ce gather"))

    def launch(self, x: torch.Tensor, out: torch.Tensor) -> None:
        ranks, m, n = self.ranks, self.chunk, self.numel
        scatter, gather = self.scatter, self.gather
        source, target = x.view(-1), out.view(-1)
        mine = target[min(ranks.rank * m, n):min((ranks.rank + 1) * m, n)]
        scatter.barrier()  # every peer is done with the last call, with both stagings
        scatter.push([source[min(p * m, n):min((p + 1) * m, n)] for p in range(ranks.world_size)])
        reduce_ce_kernel[(self.splits,)](
            x_ptr=source, out_ptr=mine, staging_ptr=scatter.staging, flags_ptr=scatter.flags, n=n, m=m,
            row=scatter.row, chunk=scatter.chunk, chunks=scatter.chunks, splits=self.splits, BLOCK=self.block,
            num_warps=self.warps, group=ranks.group)
        gather.push([mine] * ranks.world_size)
        all_gather_ce_kernel[(ranks.world_size, self.splits)](
            x_ptr=target, out_ptr=target, staging_ptr=gather.staging, flags_ptr=gather.flags, n=m, total=n,
            row=gather.row, chunk=gather.chunk, chunks=gather.chunks, COPY_OWN=False, splits=self.splits,
            BLOCK=self.block, num_warps=self.warps, group=ranks.group)
        scatter.join()
        gather.join()
