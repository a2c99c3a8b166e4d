"""The call protocol every op's kernels follow, and the device helpers that move data under it.

Each op instance owns a symmetric workspace with two slots, and a counter of its calls kept on the
device (so that CUDA-graph replays count too). Call `e` (counting from 1) uses slot `e % 2`
(`in_slot`) and raises flags to the value `e`; readers wait for exactly `e`, so flags need no reset.
Two slots suffice without any handshake because every call waits for a flag from every peer: when a
rank starts call e+2, each peer has started call e+1, so each peer has finished call e, the last
one that used the slot about to be overwritten.

The calls counter counts finished programs: every program adds 1 as it ends (`finish_call`, a
relaxed atomic, which waits for nothing). An instance always launches the same number of programs P,
and launches of one stream do not overlap, so when a program reads the counter it holds (e-1) * P
plus the programs of call e that already ended, fewer than P: every program of a launch computes the
same `e` = counter // P + 1 (`call_epoch`). One op instance must not be used by two streams at once;
use one instance per stream.

Here: the epoch, slot and flag helpers; `Workspace` (two slots of staging, their flags, the calls
counter) and `PacketRows` (the LL methods' workspace); the device helpers that copy, push and split
work under the protocol.
"""
import torch
import triton
import triton.language as tl

import tridist

from .. import language as dl
from .sizing import row_stride, splits_for


@triton.jit
def _programs():
    return tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)


@triton.jit
def call_epoch(calls_ptr):
    """This launch's epoch: 1 + the number of earlier launches of this op instance."""
    return dl.ld(calls_ptr, scope="gpu", semantic="relaxed") // _programs() + 1


@triton.jit
def in_slot(base_ptr, epoch, slot_size):
    """The part of a two-slot buffer that call `epoch` uses: slot `epoch % 2` of `slot_size`
    elements from `base_ptr` (see "Protocol" above)."""
    return base_ptr + (epoch % 2) * slot_size


@triton.jit
def after_flags(pointer, flags_ptr, count, value):
    """`pointer`, once the `count` flags from `flags_ptr` on all equal `value`. Loads through the
    result stay after the wait (`dl.consume_token`); the acquire is at system scope because the
    flags are raised by other GPUs' releases."""
    token = dl.wait(flags_ptr, count, scope="sys", semantic="acquire", waitValue=value)
    return dl.consume_token(pointer, token)


@triton.jit
def notify_peers(flag_ptr, value, group=None):
    """Raise the flag at `flag_ptr` to `value` on every other rank (all on this node; of `group`, if
    given), the next rank first."""
    me = dl.rank(group)
    world = dl.num_ranks(group)
    for step in range(1, world):
        dl.notify(flag_ptr, (me + step) % world, signal=value, sig_op="set", group=group)


@triton.jit
def sync_program():
    """Every thread of this program waits here, and its stores to global memory so far are visible
    to all the others after it. Needed wherever a program reads back what it stored: Triton lays out
    each load and store on its own (an fp32 store of a sum computed from bf16 loads moves 4 elements
    a thread, the fp32 load of it 8), so an element may be stored by one warp and loaded by another
    that ran ahead, as many programs per SM make likely (it happened: benchmarks/NOTES.md, "Moved from
    the code's docstrings (issue 41)")."""
    tl.debug_barrier()


@triton.jit
def finish_call(calls_ptr):
    """Every program calls this last. Relaxed: the next launch starts after this one has ended, and
    a launch's end makes its writes visible to the next."""
    dl.atomic_add(calls_ptr, 1, scope="gpu", semantic="relaxed")


class Workspace:
    """Symmetric staging for one op instance: two slots of `slot_numel` elements of `dtype` (none
    for kernels that write straight into symmetric tensors of the caller's), a block of signal
    words per slot, and the device-side calls counter. `name` (e.g. "all_gather push") names the
    allocations in the report of a wait that expires on them ("all_gather push flags[5]");
    `group` (a `tridist.Group`, None for the world) allocates them among its members only."""

    def __init__(self, slot_numel: int, dtype: torch.dtype, signals_per_slot: int, name: str | None = None,
                 group=None):
        self.slot_numel = slot_numel
        # Zeroed: packets (LL) left in this memory by an op freed before would look fresh to a
        # reader expecting the same epoch.
        self.staging = (tridist.symm_zeros((2, slot_numel), dtype, group, name=name and f"{name} staging")
                        if slot_numel else None)
        self.flags = tridist.signals(2 * signals_per_slot, group, name=name and f"{name} flags").view(
            2, signals_per_slot)
        self.calls = torch.zeros(1, dtype=torch.int64, device=tridist.world().device)

    def free(self) -> None:
        tridist.symm_free(self.flags.view(-1))
        if self.staging is not None:
            tridist.symm_free(self.staging)


LL_BLOCK = 1024  # packets per step of the low-latency kernels


@triton.jit
def unpack_halves(words, dtype: tl.constexpr):
    """int32 words, each holding two 16-bit floats of `dtype` (the lower address low) -> (low, high) in fp32."""
    low = tl.cast((words & 0xFFFF).to(tl.int16), dtype, bitcast=True).to(tl.float32)
    high = tl.cast(((words >> 16) & 0xFFFF).to(tl.int16), dtype, bitcast=True).to(tl.float32)
    return low, high


@triton.jit
def pack_halves(low, high, dtype: tl.constexpr):
    """The inverse of `unpack_halves`: fp32 (low, high), rounded to `dtype`, -> int32 words."""
    low_bits = tl.cast(low.to(dtype), tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    high_bits = tl.cast(high.to(dtype), tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return low_bits | (high_bits << 16)


class PacketRows(Workspace):
    """Staging for the low-latency (LL) methods: per slot, a row of `words` packets for each rank
    (`dl.ll`: a 4-byte word and its flag in 8 bytes), moved by `splits` programs per row. `what`
    names the op in the error raised where the data is not whole 4-byte words; `ranks` (an
    `ops.ranks.Ranks`) the ranks it runs among."""

    def __init__(self, what: str, nbytes: int, programs: int, ranks):
        if nbytes % 4:
            raise ValueError(f"{what} method 'll' moves 4-byte words: each rank's part must be a multiple of 4 "
                             f"bytes, got {nbytes}")
        self.words = nbytes // 4
        self.splits = splits_for(self.words, LL_BLOCK, programs)
        self.row = row_stride(self.words)
        super().__init__(ranks.world_size * self.row, torch.int64, 1, f"{what} ll", ranks.group)


@triton.jit
def placement(local_world_size, group=None):
    """(rank, world size, nodes, this rank's node, its index on the node), in `group` if given."""
    me = dl.rank(group)
    world = dl.num_ranks(group)
    return me, world, world // local_world_size, me // local_world_size, me % local_world_size


@triton.jit
def copy_slice(src_ptr, dst_ptr, start, stop, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    for offset in range(start, stop, BLOCK):
        mask = offset + offsets < stop
        tl.store(dst_ptr + offset + offsets, tl.load(src_ptr + offset + offsets, mask=mask), mask=mask)


@triton.jit
def push_slice(src_ptr, dst_ptr, start, stop, flag_ptr, epoch, peer, local_world_size, BLOCK: tl.constexpr,
               WIDE: tl.constexpr = True, group=None):
    """Copy src[start:stop] to dst[start:stop] on `peer` (`dst_ptr` is this rank's address of the
    symmetric destination), then set the peer's flag to `epoch`. On this node the program stores
    through the peer's pointer and raises the flag with a release; on another node NVSHMEM puts the
    data with the signal attached (and the caller's `quiet` completes it). WIDE: in 16-byte stores
    (`dl.symm_at`'s `aligned`), else 2 bytes at a time for 16-bit data (see `collectives._sums.send_chunks`). `peer`
    and `local_world_size` are of `group`, if given."""
    me = dl.rank(group)
    if peer // local_world_size == me // local_world_size:
        copy_slice(src_ptr, dl.symm_at(dst_ptr, peer, group, aligned=WIDE), start, stop, BLOCK)
        dl.notify(flag_ptr, peer, signal=epoch, sig_op="set", group=group)
    else:
        nbytes = (stop - start) * (src_ptr.dtype.element_ty.primitive_bitwidth // 8)
        dl.shmem.putmem_signal_nbi_block(dst_ptr + start, src_ptr + start, nbytes, flag_ptr, epoch,
                                         dl.shmem.SIGNAL_SET, peer, group)


@triton.jit
def split_bounds(n, split, splits, BLOCK: tl.constexpr):
    """Part `split` [start, stop) of n elements cut in `splits` parts. Parts are whole BLOCKs, so
    that Triton can prove their starts aligned and keeps loads and stores vectorised; the last
    parts may be empty (start == stop == n)."""
    per_split = tl.cdiv(tl.cdiv(n, splits), BLOCK) * BLOCK
    start = tl.minimum(split * per_split, n)
    return start, tl.minimum(start + per_split, n)
