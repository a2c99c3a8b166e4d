"""What the collectives share: double-buffered symmetric workspaces and the call epoch.

Protocol. Each op instance owns a symmetric workspace with two slots, and a counter of its calls
kept on the device (so that CUDA-graph replays count too). Call `e` (counting from 1) uses slot
`e % 2` and raises flags to the value `e`; readers wait for exactly `e`, so flags need no reset.
Two slots suffice without any handshake because every call waits for a flag from every peer: when a
rank starts call e+2, each peer has started call e+1, so each peer has finished call e, the last
one that used the slot about to be overwritten.

The calls counter is read by every program when a launch starts and incremented by the last
program to finish, so all programs of a launch agree on `e`. One op instance must not be used by
two streams at once; use one instance per stream.
"""
import torch
import triton
import triton.language as tl

import tridist
from tridist.runtime.tensors import check_tensor

from .. import language as dl


@triton.jit
def call_epoch(calls_ptr):
    """This launch's epoch: 1 + the number of earlier launches of this op instance."""
    return dl.ld(calls_ptr, scope="gpu", semantic="acquire") + 1


@triton.jit
def finish_call(calls_ptr):
    """The last program of a launch to get here counts the launch (every program must call this)."""
    done_ptr = calls_ptr + 1
    finished = dl.atomic_add(done_ptr, 1, scope="gpu", semantic="acq_rel")
    if finished == tl.num_programs(0) * tl.num_programs(1) - 1:
        dl.st(done_ptr, 0, scope="gpu", semantic="relaxed")
        dl.atomic_add(calls_ptr, 1, scope="gpu", semantic="release")


class Workspace:
    """Symmetric staging for one op instance: `slots` x `slot_numel` elements of `dtype`, a block
    of signal words per slot, and the device-side calls counter."""

    def __init__(self, slot_numel: int, dtype: torch.dtype, signals_per_slot: int):
        w = tridist.world()
        self.world = w
        self.slot_numel = slot_numel
        self.dtype = dtype
        self.staging = tridist.symm_empty((2, slot_numel), dtype)
        self.flags = tridist.signals(2 * signals_per_slot).view(2, signals_per_slot)
        self.calls = torch.zeros(2, dtype=torch.int64, device=w.device)

    def free(self) -> None:
        tridist.symm_free(self.flags.view(-1))
        tridist.symm_free(self.staging)


SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)


def check_input(x: torch.Tensor, name: str, dtypes=SUPPORTED) -> None:
    check_tensor(x, name)
    if x.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {x.dtype}; supported: {', '.join(str(d) for d in dtypes)}")
    if x.numel() == 0:
        raise ValueError(f"{name} is empty")


def check_output(out: torch.Tensor, shape: tuple, dtype: torch.dtype) -> None:
    check_tensor(out, "out")
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
        raise ValueError(f"out must be {dtype} of shape {tuple(shape)}, got {out.dtype} of shape {tuple(out.shape)}")


_instances: dict = {}


def instance(build, *key, device: torch.device):
    """The op instance for `key` on the current stream, made once by `build()`. The functions of
    `tridist.ops` keep one per shape and stream, since an instance must not serve two streams at once."""
    key = (*key, torch.cuda.current_stream() if device.type == "cuda" else None)
    if key not in _instances:
        _instances[key] = build()
    return _instances[key]


def method_error(op: str, method: str, methods) -> ValueError:
    return ValueError(f"{op}: unknown method {method!r}; choose one of {', '.join(methods)}")


@triton.jit
def placement(local_world_size):
    """(rank, world size, nodes, this rank's node, its index on the node)."""
    me = dl.rank()
    world = dl.num_ranks()
    return me, world, world // local_world_size, me // local_world_size, me % local_world_size


@triton.jit
def push_slice(src_ptr, dst_ptr, start, stop, flag_ptr, epoch, peer, local_world_size, BLOCK: tl.constexpr):
    """Copy src[start:stop] to dst[start:stop] on `peer` (`dst_ptr` is this rank's address of the
    symmetric destination), then set the peer's flag to `epoch`. On this node the program stores
    through the peer's pointer and raises the flag with a release; on another node NVSHMEM puts the
    data with the signal attached (and the caller's `quiet` completes it)."""
    me = dl.rank()
    if peer // local_world_size == me // local_world_size:
        remote = dl.symm_at(dst_ptr, peer)
        offsets = tl.arange(0, BLOCK)
        for offset in range(start, stop, BLOCK):
            mask = offset + offsets < stop
            tl.store(remote + offset + offsets, tl.load(src_ptr + offset + offsets, mask=mask), mask=mask)
        dl.notify(flag_ptr, peer, signal=epoch, sig_op="set")
    else:
        nbytes = (stop - start) * (src_ptr.dtype.element_ty.primitive_bitwidth // 8)
        dl.shmem.putmem_signal_nbi_block(dst_ptr + start, src_ptr + start, nbytes, flag_ptr, epoch,
                                         dl.shmem.SIGNAL_SET, peer)


@triton.jit
def copy_slice(src_ptr, dst_ptr, start, stop, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    for offset in range(start, stop, BLOCK):
        mask = offset + offsets < stop
        tl.store(dst_ptr + offset + offsets, tl.load(src_ptr + offset + offsets, mask=mask), mask=mask)


@triton.jit
def split_bounds(n, split, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """Part `split` [start, stop) of n elements cut in SPLITS parts. Parts are whole BLOCKs, so
    that Triton can prove their starts aligned and keeps loads and stores vectorised; the last
    parts may be empty (start == stop == n)."""
    per_split = tl.cdiv(tl.cdiv(n, SPLITS), BLOCK) * BLOCK
    start = tl.minimum(split * per_split, n)
    return start, tl.minimum(start + per_split, n)


def row_stride(numel: int) -> int:
    """Staging rows start at multiples of 64 elements (at least 128 bytes), for aligned accesses."""
    return triton.cdiv(numel, 64) * 64


def splits_for(numel: int, block: int, programs: int) -> int:
    """Programs per destination: enough for a few blocks each, at most `programs`."""
    return max(1, min(programs, triton.cdiv(numel, 4 * block)))


def programs_available(world) -> int:
    if world.device.type == "cuda":
        return torch.cuda.get_device_properties(world.device).multi_processor_count
    return 4  # the emulator: a few programs keep the threads busy without slowing tests down
