"""AllGather-GEMM: out = all_gather(a_shard) @ b, with the gather hidden behind the GEMM.

Shapes: a_shard is m_shard x K on every rank (M = world_size * m_shard rows in all), b is K x N
(this rank's columns of the weight), out is M x N, rank r's rows of A at r * m_shard. With
`group=`, world_size and r are the group's: the shards of its members are gathered. dtypes and
layouts as in `gemm`; with fp8, scale_a scales all of A, so every rank passes the same value.

One method with two feeders: this module's kernel is the GEMM of every comm, and a comm is the way
the shards reach `gathered`, a feeder of `shard_gather` ("ce": copy engines, one node; "sm": a few
programs pushing, any topology), which ag_moe shares. The comm changes nothing here but which
flags the GEMM waits for (`EPOCH_FLAGS`).

Protocol

- The gathered A lives in the feeder's symmetric buffer `gathered`, shard s at rows s * m_shard of
  a slot, each shard with its flags (`shard_gather`'s contract).
- The GEMM takes its tiles shard by shard: first its own, straight from a_shard (no wait, no copy),
  then rank+1, rank+2, ...: the order in which they arrive. Before a program's first tile of a
  peer's shard it waits for the shard's flags, and the TMA loads after it depend on the wait
  (consume_token) and are fenced behind it (the loads go through the async proxy, the shard came
  through the generic one).
- The GEMM launches at most the feeder's `gemm_programs`, so that both are resident at once: the
  GEMM's programs wait for the transfer, never for each other.
"""
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

import tridist.language as dl
from tridist.runtime.jit import jit

from .. import checks
from ..ranks import ranks_of
from . import persistent, policy
from ..protocol import after_flags, call_epoch, finish_call
from .shard_gather import COMMS, FEEDERS, ShardGather


@jit
def ag_gemm_kernel(own_desc, a_desc, b_desc, scale_a_ptr, scale_b_ptr, out_ptr, flags_ptr, calls_ptr, m_shard, N, K,
                   slot_rows, FLAGS_PER_SHARD: tl.constexpr, EPOCH_FLAGS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, FLATTEN: tl.constexpr,
                   group):
    """own_desc covers a_shard (m_shard x K), a_desc `gathered` as (slots * M) x K. With EPOCH_FLAGS
    the flags of shard s in slot e % 2 are raised to the call epoch e; without, slot 0's are raised
    to 1 (and zeroed by the host). Shards are numbered by the ranks of `group` (None: the world)."""
    epoch = call_epoch(calls_ptr)
    scale = persistent.load_scale(scale_a_ptr, scale_b_ptr)
    me = dl.rank(group)
    world = dl.num_ranks(group)
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
        persistent.store_tile(out_ptr, acc * scale, me * m_shard + tm * BLOCK_M, tn * BLOCK_N, (me + 1) * m_shard, N,
                              BLOCK_M, BLOCK_N)
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
        acc = persistent.tile_product(a_desc, b_desc, slot * slot_rows + row, tn * BLOCK_N, K, BLOCK_M, BLOCK_N,
                                      BLOCK_K)
        persistent.store_tile(out_ptr, acc * scale, row, tn * BLOCK_N, (shard + 1) * m_shard, N, BLOCK_M, BLOCK_N)
    finish_call(calls_ptr)


class AllGatherGEMM:
    """`out = all_gather(a_shard) @ b` for an a_shard of m_shard x k and a b of k x n, with its own
    symmetric buffers: every rank's shard of A is gathered while the GEMM runs, and out has all
    `world_size * m_shard` rows, rank r's at `r * m_shard`.

    The GEMM takes its own shard's tiles first, straight from a_shard, then each peer's shard in
    the order they arrive (rank+1, rank+2, ...); before its first tile of a peer's shard a
    program waits for that shard's flags, so the transfer hides behind the GEMM of the own shard.

    Build it on every rank (of `group`) at once; call it back to back on one stream, also in CUDA
    graphs; `free()` it on every rank (of `group`). `tridist.ops.ag_gemm` keeps one per shape,
    group and stream.

    | comm | how | where |
    | --- | --- | --- |
    | `"ce"` | the copy engines write a_shard into every peer's buffer, 8 MB at a time with a flag each: no SM is taken from the GEMM; a barrier per call | one node |
    | `"sm"` | `comm_programs` programs on a side stream push the shard (the `2d` all-gather's order: one put with signal per other node, forwarded along it), the GEMM runs on the other SMs | any topology |
    | `"auto"` | [`choose_ag_gemm_comm`][tridist.ops.gemm.policy.choose_ag_gemm_comm]: `ce` on one node, else `sm` | |

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
        group: a `torch.distributed` process group (`dist.new_group`, a DeviceMesh's
            `mesh.get_group("tp")`), a `tridist.Group`, or None for the world: the ranks whose
            shards are gathered, world_size being the group's size and rank r its r-th member
            (the comms' "one node" is then the group's nodes). Build it on every member (only).

    Raises:
        ValueError: an unknown comm, a dtype it does not take, K or N not a multiple of 8 (16
            for fp8), `m_shard` or `comm_programs` not a positive int, `comm="ce"` on several
            nodes (a group that spans several), buffers past 2^31 elements, this rank not a member
            of `group`.
    """

    def __init__(self, m_shard: int, k: int, n: int, dtype: torch.dtype, comm: str = "auto",
                 comm_programs: int | None = None, config: dict | str | None = None, group=None):
        if comm not in COMMS:
            raise checks.method_error("ag_gemm comm", comm, COMMS)
        persistent.check_sizes("ag_gemm", dtype, k, n)
        if not isinstance(m_shard, int) or m_shard < 1:
            raise ValueError(f"ag_gemm needs a positive int m_shard (rows of A per rank), got {m_shard!r}")
        if comm_programs is not None:
            checks.check_programs(comm_programs, "comm_programs", "the programs that push the shard with comm='sm'")
        self.ranks = w = ranks_of(group)
        self.comm = policy.choose_ag_gemm_comm(w) if comm == "auto" else comm
        if FEEDERS[self.comm].one_node:
            checks.require_one_node(f"ag_gemm comm='{self.comm}'", "comm='sm'", w)
        self.m_shard, self.k, self.n, self.dtype = m_shard, k, n, dtype
        self.m = w.world_size * m_shard
        self.config = persistent.resolve_config(
            config, "ag_gemm", (m_shard, k, n, str(dtype), self.comm, comm_programs),
            lambda c: AllGatherGEMM(m_shard, k, n, dtype, self.comm, comm_programs, c, group),
            lambda: persistent.random_operands(m_shard, k, n, dtype, w.device), w.device, self.m, n,
            shards=w.world_size, dtype=dtype, group=w.group)
        self.calls = torch.zeros(1, dtype=torch.int64, device=w.device)
        self.gather = ShardGather(m_shard, k, dtype, self.comm, comm_programs, ranks=w)
        self.a_desc = TensorDescriptor.from_tensor(self.gather.gathered, [self.config["BLOCK_M"], self.config["BLOCK_K"]])

    def __call__(self, a_shard: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None,
                 scale_a: torch.Tensor | None = None, scale_b: torch.Tensor | None = None) -> torch.Tensor:
        """`all_gather(a_shard) @ b` into `out`.

        Args:
            a_shard: m_shard x k of `dtype` (as built), row-major, on this rank's device.
            b: k x n of `dtype` (column-major for fp8).
            out: `world_size * m_shard` x n (world_size: the group's size, with a group) of the
                output dtype (bf16 for fp8); a new tensor if None.
            scale_a: fp8 only: a one-element float32 tensor, the same on every rank.
            scale_b: fp8 only: this rank's scale of b.

        Returns:
            `out`.

        Raises:
            ValueError: operands, scales or `out` not what this instance was built for.
        """
        out = persistent.check_call(a_shard, b, scale_a, scale_b, out, self.m, "a_shard",
                                    built=("ag_gemm", (self.m_shard, self.k), (self.k, self.n), self.dtype),
                                    group=self.ranks.group)
        own_desc, b_desc = persistent.descriptors(a_shard, b, self.config)
        gather = self.gather
        gather.start(a_shard)
        tiles = self.ranks.world_size * triton.cdiv(self.m_shard, self.config["BLOCK_M"]) * \
            triton.cdiv(self.n, self.config["BLOCK_N"])
        ag_gemm_kernel[(min(tiles, gather.gemm_programs),)](
            own_desc=own_desc, a_desc=self.a_desc, b_desc=b_desc, scale_a_ptr=scale_a, scale_b_ptr=scale_b,
            out_ptr=out, flags_ptr=gather.flags, calls_ptr=self.calls, m_shard=self.m_shard, N=self.n, K=self.k,
            slot_rows=gather.slot_rows, FLAGS_PER_SHARD=gather.flags_per_shard, EPOCH_FLAGS=gather.epoch_flags,
            group=self.ranks.group, **self.config)
        gather.finish()
        return out

    def free(self) -> None:
        """Give the symmetric buffers back (collective: every rank, in the same order)."""
        self.gather.free()


def ag_gemm(a_shard: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, comm: str = "auto",
            config: dict | str | None = None, scale_a: torch.Tensor | None = None,
            scale_b: torch.Tensor | None = None, group=None) -> torch.Tensor:
    """`all_gather(a_shard) @ b`, the gather (among `group`'s ranks, if given) overlapped with the
    GEMM: the column-parallel layer of tensor parallelism, with tokens split over the ranks by
    rows.

    A collective: every rank (every member of `group`) calls it with the same shapes. Keeps one
    [`AllGatherGEMM`][tridist.ops.AllGatherGEMM] per shape, dtype, comm, config, group and
    stream.

    Args:
        a_shard: this rank's rows of A, m_shard x K, row-major; bf16, fp16 or fp8.
        b: this rank's K x N weight (column-major for fp8).
        out: `world_size * m_shard` x N (world_size: the group's size); a new tensor if None.
        comm: `"auto"`, `"ce"` (copy engines, one node) or `"sm"` (any topology).
        config: a dict from [`configs`][tridist.ops.gemm.configs], None for the default, or
            `"tune"`.
        scale_a: fp8 only: A's scale, the same on every rank.
        scale_b: fp8 only: b's scale.
        group: a `torch.distributed` process group, a `tridist.Group`, or None for the world: the
            ranks whose shards are gathered (rank r of the group's at rows `r * m_shard`).

    Returns:
        `out`, all the rows of A times b.

    Raises:
        ValueError: before any launch, for operands, scales, `out`, comm or config it does not
            take (see `AllGatherGEMM`), or on a rank that is not a member of `group`.
    """
    op = persistent.cached(AllGatherGEMM, a_shard, b, config, "a_shard", group=group, comm=comm)
    return op(a_shard, b, out, scale_a, scale_b)
