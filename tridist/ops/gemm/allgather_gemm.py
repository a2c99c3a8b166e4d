"""AllGather-GEMM: out = all_gather(a_shard) @ b, with the gather hidden behind the GEMM.

Shapes: a_shard is m_shard x K on every rank (M = world_size * m_shard rows in all), b is K x N
(this rank's columns of the weight), out is M x N, rank r's rows of A at r * m_shard. dtypes and
layouts as in `gemm`; with fp8, scale_a scales all of A, so every rank passes the same value.

Protocol

- The gathered A lives in a symmetric buffer `gathered` (slots x M x K), shard s at rows
  s * m_shard of a slot, each shard with its flags.
- The GEMM takes its tiles shard by shard: first its own, straight from a_shard (no wait, no copy),
  then rank+1, rank+2, ...: the order in which they arrive. Before a program's first tile of a
  peer's shard it waits for the shard's flags, and the TMA loads after it depend on the wait
  (consume_token) and are fenced behind it.
- comm="ce" (one node): `_protocol.CopyEnginePush` with `gathered` as its staging: after a barrier
  (every peer is done with the last call), the copy engines write a_shard into every peer's
  `gathered` on a stream per peer, 8 MB at a time, and raise a flag there after each piece (a
  4-byte memset): no SM is taken from the GEMM, and the GEMM of the own shard hides the transfer.
  The flags are zeroed after the GEMM.
- comm="sm" (any topology): a few programs on the side stream spread this rank's shard into every
  peer's `gathered` in the 2D order (one NVSHMEM put with signal to each other node, which forwards
  it along its node with stores through symm_at) and raise flags (slot, rank, split) everywhere to
  the call epoch, one per split of the shard: all_gather's "2d" kernel
  (`allgather.all_gather_2d_kernel`) without its copy-out, launched co-resident as all_gather
  launches it (its few programs always fit). The GEMM runs on the remaining SMs of those this
  process may use (`_protocol.programs_for`, fewer under CUDA MPS), so both are resident at once:
  the GEMM's programs wait for the push, never for each other. Two slots and call epochs (see
  `_protocol.py`), no barriers.
"""
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

import tridist
import tridist.language as dl
from tridist.runtime.jit import jit

from .. import _protocol
from ..collectives import allgather
from . import persistent
from .._protocol import after_flags, call_epoch, finish_call

COMMS = ("auto", "ce", "sm")
PUSH_BLOCK = 8192  # elements per copy step: a few SMs push a whole shard, so each moves a lot at once


@jit
def ag_gemm_kernel(own_desc, a_desc, b_desc, scale_a_ptr, scale_b_ptr, out_ptr, flags_ptr, calls_ptr, m_shard, N, K,
                   slot_rows, FLAGS_PER_SHARD: tl.constexpr, EPOCH_FLAGS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, FLATTEN: tl.constexpr):
    """own_desc covers a_shard (m_shard x K), a_desc `gathered` as (slots * M) x K. With EPOCH_FLAGS
    the flags of shard s in slot e % 2 are raised to the call epoch e; without, slot 0's are raised
    to 1 (and zeroed by the host)."""
    epoch = call_epoch(calls_ptr)
    scale = persistent.load_scale(scale_a_ptr, scale_b_ptr)
    me = dl.rank()
    world = dl.num_ranks()
    slot = 0
    expected = 1
    if EPOCH_FLAGS:
        slot = (epoch % 2).to(tl.int32)  # TMA coordinates are 32-bit
        expected = epoch
    tiles_m = tl.cdiv(m_shard, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_shard = tiles_m * tiles_n
    programs = tl.num_programs(0)
    for tile in tl.range(tl.program_id(0), per_shard, programs, flatten=FLATTEN):
        tm, tn = persistent.tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        acc = persistent.tile_product(own_desc, b_desc, tm * BLOCK_M, tn * BLOCK_N, K, BLOCK_M, BLOCK_N, BLOCK_K)
        persistent.store_tile(out_ptr, acc * scale, me * m_shard + tm * BLOCK_M, tn * BLOCK_N, (me + 1) * m_shard, N, BLOCK_M,
                        BLOCK_N)
    # Each program goes on where its walk over the tiles of all shards (program_id, program_id +
    # programs, ...) left this rank's shard.
    own_tiles = tl.maximum(per_shard - tl.program_id(0) + programs - 1, 0) // programs
    arrived = tl.cast(-1, tl.int32)  # the last shard whose flags this program has seen
    for tile in tl.range(tl.program_id(0) + own_tiles * programs, world * per_shard, programs, flatten=FLATTEN):
        shard = (me + tile // per_shard) % world
        tm, tn = persistent.tile_coords(tile % per_shard, tiles_m, tiles_n, GROUP_M)
        row = shard * m_shard + tm * BLOCK_M
        if shard != arrived:
            row = after_flags(row, flags_ptr + (slot * world + shard) * FLAGS_PER_SHARD, FLAGS_PER_SHARD, expected)
            dl.fence_async_proxy()
            arrived = shard
        # Rows past the shard's end belong to the next shard, perhaps not there yet: they are
        # multiplied (rows are independent) but never stored.
        acc = persistent.tile_product(a_desc, b_desc, slot * slot_rows + row, tn * BLOCK_N, K, BLOCK_M, BLOCK_N, BLOCK_K)
        persistent.store_tile(out_ptr, acc * scale, row, tn * BLOCK_N, (shard + 1) * m_shard, N, BLOCK_M, BLOCK_N)
    finish_call(calls_ptr)


class AllGatherGEMM:
    """`out = all_gather(a_shard) @ b` for an a_shard of m_shard x k and a b of k x n, with its own
    symmetric buffers: every rank's shard of A is gathered while the GEMM runs, and out has all
    `world_size * m_shard` rows, rank r's at `r * m_shard`.

    The GEMM takes its own shard's tiles first, straight from a_shard, then each peer's shard in
    the order they arrive (rank+1, rank+2, ...); before its first tile of a peer's shard a
    program waits for that shard's flags, so the transfer hides behind the GEMM of the own shard.

    Build it on every rank at once; call it back to back on one stream, also in CUDA graphs;
    `free()` it on every rank. `tridist.ops.ag_gemm` keeps one per shape and stream.

    | comm | how | where |
    | --- | --- | --- |
    | `"ce"` | the copy engines write a_shard into every peer's buffer, 8 MB at a time with a flag each: no SM is taken from the GEMM; a barrier per call | one node |
    | `"sm"` | `comm_programs` programs on a side stream push the shard (the `2d` all-gather's order: one put with signal per other node, forwarded along it), the GEMM runs on the other SMs | any topology |
    | `"auto"` | `ce` on one node, else `sm` | |

    Args:
        m_shard: rows of A per rank.
        k: columns of A, rows of b.
        n: columns of b.
        dtype: bf16, fp16 or fp8 (see the family's page for layouts and scales).
        comm: one of the above.
        comm_programs: with `comm="sm"`, the programs that push the shard (default: a sixteenth
            of the SMs).
        config: a dict from [`configs`][tridist.ops.gemm.configs], None for the default, or
            `"tune"`.

    Raises:
        ValueError: an unknown comm, a dtype it does not take, K or N not a multiple of 8 (16
            for fp8), `m_shard` or `comm_programs` not a positive int, `comm="ce"` on several
            nodes, buffers past 2^31 elements.
    """

    def __init__(self, m_shard: int, k: int, n: int, dtype: torch.dtype, comm: str = "auto",
                 comm_programs: int | None = None, config: dict | str | None = None):
        if comm not in COMMS:
            raise _protocol.method_error("ag_gemm comm", comm, COMMS)
        persistent.check_sizes("ag_gemm", dtype, k, n)
        if not isinstance(m_shard, int) or m_shard < 1:
            raise ValueError(f"ag_gemm needs a positive int m_shard (rows of A per rank), got {m_shard!r}")
        if comm_programs is not None:
            _protocol.check_programs(comm_programs, "comm_programs", "the programs that push the shard with comm='sm'")
        self.world = w = tridist.world()
        self.comm = ("ce" if w.nnodes == 1 else "sm") if comm == "auto" else comm
        if self.comm == "ce":
            _protocol.require_one_node("ag_gemm comm='ce'", "comm='sm'")
        self.m_shard, self.k, self.n, self.dtype = m_shard, k, n, dtype
        self.m = w.world_size * m_shard
        self.config = persistent.resolve_config(
            config, "ag_gemm", (m_shard, k, n, str(dtype), self.comm, comm_programs),
            lambda c: AllGatherGEMM(m_shard, k, n, dtype, self.comm, comm_programs, c),
            lambda: persistent.random_operands(m_shard, k, n, dtype, w.device), w.device, self.m, n, shards=w.world_size,
            dtype=dtype)
        self.calls = torch.zeros(1, dtype=torch.int64, device=w.device)
        self.gather = ShardGather(m_shard, k, dtype, self.comm, comm_programs)
        self.a_desc = TensorDescriptor.from_tensor(self.gather.gathered, [self.config["BLOCK_M"], self.config["BLOCK_K"]])

    def __call__(self, a_shard: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None,
                 scale_a: torch.Tensor | None = None, scale_b: torch.Tensor | None = None) -> torch.Tensor:
        """`all_gather(a_shard) @ b` into `out`.

        Args:
            a_shard: m_shard x k of `dtype` (as built), row-major, on this rank's device.
            b: k x n of `dtype` (column-major for fp8).
            out: `world_size * m_shard` x n of the output dtype (bf16 for fp8); a new tensor if
                None.
            scale_a: fp8 only: a one-element float32 tensor, the same on every rank.
            scale_b: fp8 only: this rank's scale of b.

        Returns:
            `out`.

        Raises:
            ValueError: operands, scales or `out` not what this instance was built for.
        """
        out = persistent.check_call(a_shard, b, scale_a, scale_b, out, self.m, "a_shard",
                              built=("ag_gemm", (self.m_shard, self.k), (self.k, self.n), self.dtype))
        own_desc, b_desc = persistent.descriptors(a_shard, b, self.config)
        gather = self.gather
        gather.start(a_shard)
        tiles = self.world.world_size * triton.cdiv(self.m_shard, self.config["BLOCK_M"]) * \
            triton.cdiv(self.n, self.config["BLOCK_N"])
        ag_gemm_kernel[(min(tiles, gather.gemm_programs),)](
            own_desc, self.a_desc, b_desc, scale_a, scale_b, out, gather.flags, self.calls, self.m_shard, self.n,
            self.k, self.m, FLAGS_PER_SHARD=gather.flags_per_shard, EPOCH_FLAGS=gather.epoch_flags, **self.config)
        gather.finish()
        return out

    def free(self) -> None:
        """Give the symmetric buffers back (collective: every rank, in the same order)."""
        self.gather.free()


class ShardGather:
    """The all-gather behind ag_gemm (and ag_moe): every rank's shard of m_shard x k into
    `gathered` on every rank (shard s at rows s * m_shard of a slot, `slot_rows` rows per slot),
    with `flags_per_shard` flags per shard that a GEMM on the current stream waits for before
    reading it: with `epoch_flags`, flag (slot, s, i) raised to the call epoch (comm "sm"), without,
    flag (s, i) of the single slot raised to 1 and zeroed after the call (comm "ce"; see the module
    docstring). `gemm_programs`: the SMs left to that GEMM. Queue `start(shard)` before the GEMM
    and `finish()` after it."""

    def __init__(self, m_shard: int, k: int, dtype: torch.dtype, comm: str, comm_programs: int | None = None):
        self.world = w = tridist.world()
        self.comm, self.m_shard, self.k = comm, m_shard, k
        self.slot_rows = m = w.world_size * m_shard
        programs = _protocol.programs_for(w.device)
        self.epoch_flags = comm == "sm"
        if comm == "sm":
            _protocol.check_offsets("ag_gemm comm='sm'", 2 * m * k)  # all_gather_2d_kernel into `gathered`
            self.gathered = tridist.symm_empty((2 * m, k), dtype)
            self.side = _protocol.SideStream(w.device)
            # A few SMs push (8 of an H200's 132), the GEMM keeps the others; "sm" is there for several
            # nodes, where the network, not these programs, sets the pace.
            self.comm_programs = comm_programs or max(1, programs // 16)
            self.push_tasks = allgather.spread_tasks(w)
            self.splits = _protocol.splits_for(m_shard * k, PUSH_BLOCK, max(1, self.comm_programs // self.push_tasks))
            self.flags = tridist.signals(2 * w.world_size * self.splits)
            self.flags_per_shard = self.splits
            self.push_calls = torch.zeros(1, dtype=torch.int64, device=w.device)
            self.gemm_programs = max(1, programs - self.push_tasks * self.splits)
        else:
            self.push = _protocol.CopyEnginePush(m_shard * k, dtype, row=m_shard * k)
            self.gathered = self.push.staging.view(m, k)
            self.flags, self.flags_per_shard = self.push.flags, self.push.chunks
            self.gemm_programs = programs

    def start(self, shard: torch.Tensor) -> None:
        """Queue the transfer of this rank's shard (contiguous, m_shard x k) to every peer (none at
        world size 1: the GEMM reads its own shard where it is)."""
        if self.world.world_size == 1:
            return
        if self.comm == "ce":
            self.push.barrier()  # every peer is done with the last call (see CopyEnginePush)
            self.push.push([shard.reshape(-1)] * self.world.world_size)
            return
        w = self.world
        with self.side.fork():
            # Shards lie back to back in `gathered` (row = shard size), as the GEMM reads them;
            # without the copy-out, `out` (here `gathered`) is never written.
            n = shard.numel()
            allgather.all_gather_2d_kernel[(self.push_tasks, self.splits)](
                shard, self.gathered, self.gathered, self.flags, self.push_calls, n, n, self.slot_rows * self.k,
                w.local_world_size, COPY_OUT=False, splits=self.splits, BLOCK=PUSH_BLOCK, num_warps=8,
                coresident=True)

    def finish(self) -> None:
        """After the GEMM that read the shards: the current stream waits for the transfer (and "ce"
        zeroes its flags)."""
        if self.world.world_size == 1:
            return
        if self.comm == "ce":
            self.push.join()
        else:
            self.side.join()

    def free(self) -> None:
        """Give the symmetric buffers back (collective: every rank, in the same order)."""
        if self.comm == "sm":
            tridist.symm_free(self.flags)
            tridist.symm_free(self.gathered)
        else:
            self.push.free()


def ag_gemm(a_shard: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, comm: str = "auto",
            config: dict | str | None = None, scale_a: torch.Tensor | None = None,
            scale_b: torch.Tensor | None = None) -> torch.Tensor:
    """`all_gather(a_shard) @ b`, the gather overlapped with the GEMM: the column-parallel layer
    of tensor parallelism, with tokens split over the ranks by rows.

    A collective: every rank calls it with the same shapes. Keeps one
    [`AllGatherGEMM`][tridist.ops.AllGatherGEMM] per shape, dtype, comm, config and stream.

    Args:
        a_shard: this rank's rows of A, m_shard x K, row-major; bf16, fp16 or fp8.
        b: this rank's K x N weight (column-major for fp8).
        out: `world_size * m_shard` x N; a new tensor if None.
        comm: `"auto"`, `"ce"` (copy engines, one node) or `"sm"` (any topology).
        config: a dict from [`configs`][tridist.ops.gemm.configs], None for the default, or
            `"tune"`.
        scale_a: fp8 only: A's scale, the same on every rank.
        scale_b: fp8 only: b's scale.

    Returns:
        `out`, all the rows of A times b.

    Raises:
        ValueError: before any launch, for operands, scales, `out`, comm or config it does not
            take (see `AllGatherGEMM`).
    """
    op = persistent.cached(AllGatherGEMM, a_shard, b, config, "a_shard", comm=comm)
    return op(a_shard, b, out, scale_a, scale_b)


@torch.library.custom_op("tridist::ag_gemm", mutates_args=())
def ag_gemm_op(a_shard: torch.Tensor, b: torch.Tensor, comm: str = "auto", scale_a: torch.Tensor | None = None,
               scale_b: torch.Tensor | None = None) -> torch.Tensor:
    """`ag_gemm` as a PyTorch custom op (`torch.ops.tridist.ag_gemm`), for torch.compile."""
    return ag_gemm(a_shard, b, comm=comm, scale_a=scale_a, scale_b=scale_b)


@ag_gemm_op.register_fake
def _ag_gemm_shape(a_shard: torch.Tensor, b: torch.Tensor, comm: str = "auto", scale_a: torch.Tensor | None = None,
                   scale_b: torch.Tensor | None = None) -> torch.Tensor:
    return a_shard.new_empty((tridist.world().world_size * a_shard.shape[0], b.shape[1]),
                             dtype=persistent.out_dtype(a_shard.dtype))
