"""Symmetric tensors: ordinary torch tensors that live in the symmetric heap.

They are CUDA tensors on GPUs and CPU tensors in the emulator. A symmetric tensor's address means
the same buffer on every rank, which is what lets a kernel find a peer's copy (`dl.symm_at`).
Allocating is collective: every rank must allocate and free the same shapes in the same order, so
that offsets agree. In the emulator and with TRIDIST_DEBUG=1 each allocation and free also waits
for every rank (they compare what they asked for, `heap.py`), and `symm_zeros` and `signals` end
with a barrier on every backend.

With `group=` (a torch.distributed process group) only the group's members allocate, free and
meet at the barrier, and only they hold the tensor: see `groups.py` and `heap.py`.
"""
import torch

from . import groups
from .errors import TridistError
from .world import heap, transport, world

SIGNAL_DTYPE = torch.int64
"""The dtype of signal words: int64 (NVSHMEM's signal type is uint64; the bits are the same)."""


def _shape(shape) -> tuple:
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if any(not isinstance(d, int) or d < 0 for d in shape):
        raise ValueError(f"shape {shape} must be non-negative ints")
    return shape


def symm_empty(shape, dtype: torch.dtype = torch.float32, group=None, name: str | None = None) -> torch.Tensor:
    """An uninitialised symmetric tensor: a torch tensor (CUDA on GPUs, CPU in the emulator) in
    this rank's symmetric heap, at the same offset as every other rank's copy, which kernels
    reach with `dl.symm_at` and `dl.shmem`.

    Collective: every rank (with `group`, every member of the group) must allocate the same
    shapes and dtypes in the same order (checked in the emulator and with TRIDIST_DEBUG=1, where
    every rank waits for the others). An empty shape gives an empty regular tensor (torch gives
    empty tensors no address), which `symm_free` takes back all the same.

    Args:
        shape: an int or a sequence of ints.
        dtype: the element type.
        group: a `torch.distributed.ProcessGroup` (from `dist.new_group`, or a DeviceMesh's
            `mesh.get_group(dim)`) or a [`tridist.Group`][tridist.Group]: only its members
            allocate, together, and only they hold a copy; the other ranks take no part and do not
            wait. The members agree on the offset (a host collective among them, on every
            backend, so not while a CUDA graph is captured: a TridistError). None: the world.
        name: what the report of a wait that expired on a word of it calls it (default:
            "allocation #N", its place among this rank's allocations of the world or the group).

    Raises:
        ValueError: a shape that is not non-negative ints, a dtype the heap does not take, or a
            `group` this rank is not a member of.
        TypeError: a `group` that is not a process group.
        SymmetricAllocationError: the heap (TRIDIST_HEAP_SIZE) is exhausted, or ranks asked
            for different allocations (what each asked for is in the message).
        TridistError: a group allocation inside a CUDA-graph capture.
    """
    g = groups.resolve(group)
    if g is not None and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise TridistError(f"symm_empty(group=...) inside a CUDA-graph capture: the members of group "
                           f"{list(g.ranks)} agree on the offset through a host exchange, which the capture "
                           "refuses; allocate before capturing")
    return heap().allocate(_shape(shape), dtype, name, g)


def symm_zeros(shape, dtype: torch.dtype = torch.float32, group=None, name: str | None = None) -> torch.Tensor:
    """A zeroed symmetric tensor (as `symm_empty`, `group` included). Collective: it returns once
    every rank (of the group) has zeroed its copy, so that no rank's zeroing can erase what a faster
    peer already wrote into it."""
    t = symm_empty(shape, dtype, group, name)
    t.zero_()
    barrier_all(group)
    return t


def symm_free(t: torch.Tensor) -> None:
    """Give a symmetric tensor's memory back to the heap. Collective: every rank that allocated it
    (the world, or its group's members) frees the same tensors in the same order."""
    heap().free(t)


def signals(n: int, group=None, name: str | None = None) -> torch.Tensor:
    """`n` zeroed signal words (`SIGNAL_DTYPE`) in symmetric memory, for `dl.notify`, `dl.wait`
    and `dl.shmem`'s signals. Collective, like `symm_zeros` (`group` included)."""
    return symm_zeros((n,), SIGNAL_DTYPE, group, name)


def is_symmetric(t: torch.Tensor) -> bool:
    """Whether `t` lies in this rank's symmetric heap (a tensor from `symm_empty`, or a view of one)."""
    return heap().contains(t)


def peer_tensor(t: torch.Tensor, peer: int, group=None) -> torch.Tensor:
    """`peer`'s copy of the symmetric tensor `t`, as a tensor this rank can read and write
    (with torch ops, or copy engines: `peer_tensor(t, p).copy_(x)`).

    Only for peers on this (virtual) node; other nodes are reached with puts and gets inside
    kernels.

    Args:
        t: a symmetric tensor (or a view of one).
        peer: a rank of the world, or with `group` a rank of the group.
        group: a process group or [`tridist.Group`][tridist.Group] this rank is a member of.

    Raises:
        ValueError: `peer` outside the world (group), on another node, or without a copy of `t`
            (`t` was allocated by a group `peer` is not in); `t` not symmetric.
    """
    w = world()
    g = groups.resolve(group)
    if g is not None:
        peer = g.world_rank(peer)
    if not 0 <= peer < w.world_size:
        raise ValueError(f"peer {peer} is outside the world of {w.world_size} ranks")
    if not is_symmetric(t):
        raise ValueError("peer_tensor takes a symmetric tensor; allocate it with tridist.symm_empty")
    base = transport().heaps[peer]
    if base is None or not w.same_node(peer):
        raise ValueError(f"rank {peer} is on node {w.node_of(peer)}, not load/store reachable from rank {w.rank} "
                         f"on node {w.node}; move data to it with put/get inside a kernel")
    offset = heap().offset_of(t)
    owner = heap().group_at(offset)
    if owner is not None and peer not in owner.ranks:
        raise ValueError(f"rank {peer} holds no copy of this tensor: group {list(owner.ranks)} allocated it")
    if offset % t.element_size():
        raise ValueError("peer_tensor takes a tensor aligned to its element size")
    return torch.as_strided(base.view(t.dtype), t.size(), t.stride(), offset // t.element_size())


def barrier_all(group=None) -> None:
    """Host barrier: returns on every rank once all ranks have called it (and, on GPUs, once the
    device work queued before it has finished). For a barrier queued on a stream, with no host
    wait, see `barrier_all_on_stream`.

    Args:
        group: a process group or [`tridist.Group`][tridist.Group]: a barrier of its members
            only. None: the world.
    """
    transport().barrier(groups.resolve(group))


def check_tensor(t: torch.Tensor, name: str) -> None:
    """Host functions call this on their tensor arguments: contiguous and on this rank's device."""
    w = world()
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != w.device:
        raise ValueError(f"{name} is on {t.device} but this rank's device is {w.device}; move it with .to({str(w.device)!r})")
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous; pass {name}.contiguous()")
