"""Reduce-scatter method "ce" (one node): the copy engines move the chunks, no SM drives NVLink.

Protocol (`copy_engines.CopyEnginePush`). A barrier at the start of each call (the transfer's own)
says every peer has finished with its staging and flags. This rank's copy engines then write chunk
p of x into row `rank` of rank p's staging, chunk by chunk of the transfer (8 MB), each followed by
its flag = 1; `reduce_ce_kernel` sums this rank's chunk over the ranks, block by block as the
pieces land, in rank order and in fp32. Once it has run, the flags are zeroed for the next call.
For large messages next to other work on the SMs: on its own the SM methods are faster, so `auto`
does not pick it (`policy.choose_reduce_scatter`).
"""
import torch

from ... import sizing
from ...copy_engines import CopyEnginePush
from ...method import Method
from .._copy_engine import reduce_ce_kernel


class CopyEngines(Method):
    """The copy-engine reduce-scatter among `ranks` (an `ops.ranks.Ranks`), built for `numel`
    elements of `dtype` per rank; at most `programs` programs sum (world_size sources share them)."""

    name = "ce"
    one_node = True

    def __init__(self, numel: int, dtype: torch.dtype, programs: int, ranks):
        super().__init__()
        self.ranks = ranks
        self.numel = numel
        self.chunk = numel // ranks.world_size
        self.block, self.splits, self.warps = sizing.steps_for(self.chunk, dtype.itemsize,
                                                                  max(1, programs // ranks.world_size),
                                                                  sizing.CE_STEP_BYTES)
        self.transfer = self.own(CopyEnginePush(self.chunk, dtype, ranks, name="reduce_scatter ce"))

    def launch(self, x: torch.Tensor, out: torch.Tensor) -> None:
        transfer = self.transfer
        transfer.barrier()
        transfer.push(x.view(self.ranks.world_size, -1))
        reduce_ce_kernel[(self.splits,)](
            x_ptr=x, out_ptr=out, staging_ptr=transfer.staging, flags_ptr=transfer.flags, n=self.numel, m=self.chunk,
            row=transfer.row, chunk=transfer.chunk, chunks=transfer.chunks, splits=self.splits, BLOCK=self.block,
            num_warps=self.warps, group=self.ranks.group)
        transfer.join()
