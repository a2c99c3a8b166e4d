"""The all-gather half of ag_gemm and ag_moe: every rank's shard of A (m_shard x k) into the
symmetric buffer `gathered` on every rank, with flags that a GEMM on the current stream waits for
before it reads a shard. One contract, two feeders (the `comm` of those ops):

| comm | feeder | how | where |
| --- | --- | --- | --- |
| `"ce"` | `CopyEngineGather` | the copy engines write the shard into every peer, one peer after another (each rank receives the next rank's shard first, as its GEMM reads them), a flag per 8 MB piece; no SM taken; a barrier per call | one node |
| `"sm"` | `PushGather` | a few programs on a side stream push the shard (the `2d` all-gather's order), a flag per split | any topology |

The contract a GEMM reads (`ShardGather`'s attributes):

- `gathered` holds slots of `slot_rows` = world_size * m_shard rows, shard s at rows s * m_shard
  of a slot.
- `flags`: `flags_per_shard` flags per shard, those of shard s in slot j at
  (j * world_size + s) * flags_per_shard. With `epoch_flags` ("sm": two slots, `protocol.py`'s
  call epochs), call e uses slot e % 2 and its flags are raised to e; without ("ce": one slot),
  slot 0's flags are raised to 1 and zeroed after the call. A shard is whole once all its flags
  read that value; the GEMM's loads of it must depend on the wait (`protocol.after_flags`).
- `gemm_programs`: the programs the GEMM may launch, so that it and the transfer are resident at
  once and the GEMM's programs wait for the transfer, never for each other.
- Queue `start(shard)` before the GEMM and `finish()` after it. At world size 1 both do nothing:
  the GEMM reads its own shard where it is, never from `gathered`.
- Ranks, shards and world_size are those of the feeder's `ranks` (the world, or the op's group):
  a GEMM reading it numbers shards by the same ranks (its kernel's `group` is `ranks.group`).
"""
import torch

import tridist

from .. import checks, copy_engines, sizing
from ..collectives.allgather import two_d
from ..method import Method
from ..ranks import Ranks, ranks_of
from . import policy

COMMS = ("auto", "ce", "sm")
PUSH_BLOCK = 8192  # elements per copy step: a few SMs push a whole shard, so each moves a lot at once


class ShardGather(Method):
    """The transfer of every rank's m_shard x k shard of A into `gathered` on every rank, with the
    attributes of the contract above. A feeder is launched in two halves around the GEMM that reads
    it, `start(shard)` and `finish()`, rather than by `launch`.

    `ShardGather(m_shard, k, dtype, comm, comm_programs, ranks=None)` builds the feeder of `comm`,
    "ce" or "sm" (the op resolves "auto": `policy.choose_ag_gemm_comm`): a `CopyEngineGather` or a
    `PushGather`. `comm_programs`: with "sm", the programs that push (default:
    1/`policy.SM_COMM_SHARE` of the SMs). `ranks`: an `ops.ranks.Ranks`, the ranks whose shards
    are gathered (default: the world). Every rank (of `ranks`) builds it with the same arguments,
    in the same order.
    """

    epoch_flags: bool = False

    def __new__(cls, m_shard: int, k: int, dtype: torch.dtype, comm: str, comm_programs: int | None = None,
                ranks: Ranks | None = None):
        if cls is ShardGather:
            cls = FEEDERS[comm]
        return super().__new__(cls)

    def __init__(self, m_shard: int, k: int, dtype: torch.dtype, comm: str, comm_programs: int | None = None,
                 ranks: Ranks | None = None):
        super().__init__()
        self.ranks = ranks or ranks_of()
        self.m_shard, self.k = m_shard, k
        self.slot_rows = self.ranks.world_size * m_shard

    def start(self, shard: torch.Tensor) -> None:
        """Queue the transfer of this rank's shard (contiguous, m_shard x k) to every peer."""
        raise NotImplementedError(f"{type(self).__name__}.start")

    def finish(self) -> None:
        """After the GEMM that read the shards: the current stream waits for the transfer."""
        raise NotImplementedError(f"{type(self).__name__}.finish")


class CopyEngineGather(ShardGather):
    """comm="ce" (one node): `copy_engines.CopyEnginePush` with `gathered` as its staging. After a
    barrier (every peer is done with the last call), the copy engines write the shard into one
    peer's `gathered` after another (`policy.CE_PUSH_IN_TURN`: each rank receives rank+1's shard
    first, the one its GEMM reads next), 8 MB at a time, and raise a flag there after each piece
    (a 4-byte memset): no SM is taken from the GEMM, and the GEMM of the own shard hides the
    transfer. One slot: the flags are zeroed after the GEMM (`finish`)."""

    name = "ce"
    one_node = True

    def __init__(self, m_shard: int, k: int, dtype: torch.dtype, comm: str = "ce", comm_programs: int | None = None,
                 ranks: Ranks | None = None):
        super().__init__(m_shard, k, dtype, comm, comm_programs, ranks)
        self.push = self.own(copy_engines.CopyEnginePush(m_shard * k, dtype, self.ranks, row=m_shard * k))
        self.gathered = self.push.staging.view(self.slot_rows, k)
        self.flags, self.flags_per_shard = self.push.flags, self.push.chunks
        self.gemm_programs = sizing.programs_for(self.ranks.device)

    def start(self, shard: torch.Tensor) -> None:
        if self.ranks.world_size == 1:
            return
        self.push.barrier()  # every peer is done with the last call (see CopyEnginePush)
        self.push.push([shard.reshape(-1)] * self.ranks.world_size, in_turn=policy.CE_PUSH_IN_TURN)

    def finish(self) -> None:
        if self.ranks.world_size > 1:
            self.push.join()


class PushGather(ShardGather):
    """comm="sm" (any topology): `comm_programs` programs on a side stream spread this rank's shard
    into every peer's `gathered` in the 2D order (one NVSHMEM put with signal to each other node,
    which forwards it along its node with stores through symm_at) and raise flags (slot, rank,
    split) everywhere to the call epoch, one per split of the shard: all_gather's "2d" kernel
    (`allgather.two_d.all_gather_2d_kernel`) without its copy-out, launched co-resident as all_gather
    launches it (its few programs always fit). The GEMM runs on the remaining SMs of those this
    process may use (`sizing.programs_for`, fewer under CUDA MPS). Two slots and call epochs,
    no barriers."""

    name = "sm"
    epoch_flags = True

    def __init__(self, m_shard: int, k: int, dtype: torch.dtype, comm: str = "sm", comm_programs: int | None = None,
                 ranks: Ranks | None = None):
        super().__init__(m_shard, k, dtype, comm, comm_programs, ranks)
        w = self.ranks
        checks.check_offsets("ag_gemm comm='sm'", 2 * self.slot_rows * k)  # the 2d kernel indexes `gathered`
        self.gathered = self.own(tridist.symm_empty((2 * self.slot_rows, k), dtype, w.group))
        self.send = self.send_buffer(w, m_shard * k, dtype, "ag_gemm comm='sm'")
        self.side = copy_engines.SideStream(w.device)
        programs = sizing.programs_for(w.device)
        self.comm_programs = comm_programs or max(1, programs // policy.SM_COMM_SHARE)
        self.push_tasks = two_d.spread_tasks(w)
        self.splits = sizing.splits_for(m_shard * k, PUSH_BLOCK, max(1, self.comm_programs // self.push_tasks))
        self.flags = self.own(tridist.signals(2 * w.world_size * self.splits, w.group))
        self.flags_per_shard = self.splits
        self.push_calls = torch.zeros(1, dtype=torch.int64, device=w.device)
        self.gemm_programs = max(1, programs - self.push_tasks * self.splits)

    def start(self, shard: torch.Tensor) -> None:
        if self.ranks.world_size == 1:
            return
        n = shard.numel()
        with self.side.fork():
            shard = self.sendable(shard, self.send)
            # Shards lie back to back in `gathered` (row = shard size), as the GEMM reads them;
            # without the copy-out, `out` (here `gathered`) is never written.
            two_d.all_gather_2d_kernel[(self.push_tasks, self.splits)](
                x_ptr=shard, out_ptr=self.gathered, staging_ptr=self.gathered, flags_ptr=self.flags,
                calls_ptr=self.push_calls, n=n, row=n, slot_numel=self.slot_rows * self.k,
                local_world_size=self.ranks.local_world_size, COPY_OUT=False, splits=self.splits, BLOCK=PUSH_BLOCK,
                group=self.ranks.group, num_warps=8, coresident=True)

    def finish(self) -> None:
        if self.ranks.world_size > 1:
            self.side.join()


FEEDERS = {feeder.name: feeder for feeder in (CopyEngineGather, PushGather)}
