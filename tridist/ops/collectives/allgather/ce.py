"""All-gather method "ce" (one node), through staging: the copy engines move the shards, no SM
drives NVLink.

Protocol (`copy_engines.CopyEnginePush`). A barrier at the start of each call (the transfer's own)
says every peer has finished with its staging and flags. This rank's copy engines then write its
shard into row `rank` of every peer's staging, chunk by chunk (8 MB, `sizing.CE_CHUNK_BYTES`),
each chunk followed by its flag (rank, chunk) = 1; `all_gather_ce_kernel` copies each chunk of each
peer's row out to `out` as soon as its flag is up, and this rank's shard from x. Once the kernel
has run, the flags are zeroed for the next call. For large messages next to other work on the SMs:
on its own "push" is faster, so `auto` picks "ce" only into a symmetric `out`
(`policy.choose_all_gather`), where it skips the staging (`ce_symmetric`).
"""
import torch

from ... import sizing
from ...copy_engines import CopyEnginePush
from ...method import Method
from .._copy_engine import all_gather_ce_kernel


class CopyEngines(Method):
    """The copy-engine all-gather through staging among `ranks` (an `ops.ranks.Ranks`), built for
    shards of `numel` elements of `dtype`; at most `programs` programs copy out (world_size sources
    share them)."""

    name = "ce"
    one_node = True

    def __init__(self, numel: int, dtype: torch.dtype, programs: int, ranks):
        super().__init__()
        self.ranks = ranks
        self.numel = numel
        self.block, self.splits, self.warps = sizing.steps_for(numel, dtype.itemsize,
                                                                  max(1, programs // ranks.world_size),
                                                                  sizing.CE_STEP_BYTES)
        self.transfer = self.own(CopyEnginePush(numel, dtype, ranks, name="all_gather ce"))

    def launch(self, x: torch.Tensor, out: torch.Tensor) -> None:
        transfer, ranks = self.transfer, self.ranks
        transfer.barrier()
        transfer.push([x.view(-1)] * ranks.world_size)
        all_gather_ce_kernel[(ranks.world_size, self.splits)](
            x_ptr=x, out_ptr=out, staging_ptr=transfer.staging, flags_ptr=transfer.flags, n=self.numel,
            total=out.numel(), row=transfer.row, chunk=transfer.chunk, chunks=transfer.chunks, COPY_OWN=True,
            splits=self.splits, BLOCK=self.block, num_warps=self.warps, group=ranks.group)
        transfer.join()
