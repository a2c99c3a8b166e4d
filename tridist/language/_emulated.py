"""Emulator lowering of the device API: plain Python run by Triton's interpreter.

Under the interpreter a kernel is Python code whose values are `tl.tensor`s holding numpy arrays,
and a pointer is a real address in this process. Peers' heaps are mapped into this process, so
`symm_at` is `address - my_base + peer_base`, puts and gets are `memmove`, and signals are atomic
read-modify-writes under the lock every rank shares. Waits spin in Python, bounded, and watch the
peers (see `runtime/emulator.py`). The GPU lowering in `_gpu.py` has the same names and meanings.

A `group` argument arrives as a pointer to the group's device table; the emulator finds the
`tridist.Group` by that address, checks a group rank against the group's size, and translates it
into a world rank. A peer must also hold the memory reached: an address in a group's allocation
reaches only that group's members.
"""
import ctypes
import time

import numpy as np
import triton.language as tl
from triton.runtime import interpreter as _interpreter
from triton.runtime.interpreter import TensorHandle, _get_np_dtype
from triton.runtime.interpreter import _interpreter as _memory

from ..runtime import config, emulator, groups, wait_report
from ..runtime.errors import DeviceCheckError
from ..runtime.world import heap, transport, world
from ._constants import CMP_EQ, CMP_GE, CMP_GT, CMP_LE, CMP_LT, CMP_NE, SCOPES, SEMANTICS, SIGNAL_ADD, SIGNAL_SET

_COMPARE = {CMP_EQ.value: np.equal, CMP_NE.value: np.not_equal, CMP_GT.value: np.greater,
            CMP_GE.value: np.greater_equal, CMP_LT.value: np.less, CMP_LE.value: np.less_equal}
# What the GPU lowering compiles: `dl.notify` takes its operation by name (a constexpr string),
# `dl.shmem`'s functions by NVSHMEM's code (an int32 argument).
_NOTIFY_OPS = ("set", "add")
_SHMEM_SIGNAL_OPS = (SIGNAL_SET.value, SIGNAL_ADD.value)
_COMM_SCOPES = ("gpu", "intra_node", "inter_node")


# ---- values --------------------------------------------------------------------------------------
def _value(x):
    """A Python scalar from a constexpr, a Python number or a one-element tensor."""
    if isinstance(x, tl.constexpr):
        x = x.value
    if isinstance(x, tl.tensor):
        return x.handle.data.reshape(-1)[0].item()
    return x


def _addresses(ptr) -> np.ndarray:
    return ptr.handle.data.astype(np.uint64)


def _scalar(value, dtype) -> tl.tensor:
    return tl.tensor(TensorHandle(np.array([value], dtype=_get_np_dtype(dtype)), dtype), dtype)


def _like(ptr, addresses: np.ndarray) -> tl.tensor:
    return tl.tensor(TensorHandle(addresses.astype(np.uint64), ptr.handle.dtype), ptr.type)


def _read(addresses: np.ndarray, dtype) -> np.ndarray:
    """The values of type `dtype` (a Triton dtype) at `addresses`."""
    np_dtype = _get_np_dtype(dtype)
    return _memory.load(addresses, np.ones(addresses.shape, dtype=bool), np.zeros(addresses.shape, dtype=np_dtype),
                        np_dtype)


def _element(ptr):
    return ptr.type.scalar.element_ty


def _check_choice(what: str, name: str, value, valid, valid_text: str | None = None) -> None:
    """Raise a ValueError naming the valid values where the GPU lowering would not compile (or, for
    a run-time value, would hand NVSHMEM a code it does not know)."""
    if value not in valid:
        raise ValueError(f"rank {world().rank}, kernel {emulator.current_kernel()}: {what} with {name}={value!r}; "
                         f"use one of {valid_text or ', '.join(map(repr, valid))}")


def _check_order(what: str, kind: str, scope, semantic) -> None:
    """Scope and semantic change nothing here (the emulator's accesses are all ordered); they are
    checked so that what runs here also compiles on GPUs (see `_gpu._check_order`)."""
    _check_choice(what, "scope", _value(scope), SCOPES)
    _check_choice(what, "semantic", _value(semantic), SEMANTICS[kind])


def _group_of(group, what: str):
    """The `tridist.Group` of a `group` argument (a pointer to its table), or None for the world."""
    group = group.value if isinstance(group, tl.constexpr) else group
    if group is None:
        return None
    found = groups.at_address(int(_addresses(group).reshape(-1)[0])) if isinstance(group, tl.tensor) else None
    if found is None:
        raise ValueError(f"rank {world().rank}, kernel {emulator.current_kernel()}: {what} with a group argument "
                         "which is not a group: pass the kernel a tridist.Group (tridist.group(process_group)) "
                         "and give that argument")
    return found


def _pe(peer, group, what: str) -> int:
    """The world rank of `peer`, a rank of `group` (a kernel's group argument) or of the world (None)."""
    peer = int(_value(peer))
    g = _group_of(group, what)
    if g is None:
        return peer
    if not 0 <= peer < g.size:
        raise IndexError(f"rank {world().rank}, kernel {emulator.current_kernel()}: {what} to group rank {peer}, "
                         f"outside the group of {g.size} ranks {list(g.ranks)}")
    return g.ranks[peer]


def _translate(addresses: np.ndarray, peer: int, what: str, allow_remote_node: bool) -> np.ndarray:
    w = world()
    if not 0 <= peer < w.world_size:
        raise IndexError(f"rank {w.rank}, kernel {emulator.current_kernel()}: {what} to rank {peer}, "
                         f"outside the world of {w.world_size}")
    if not allow_remote_node and not w.same_node(peer):
        raise ValueError(f"rank {w.rank}, kernel {emulator.current_kernel()}: {what} to rank {peer} on node "
                         f"{w.node_of(peer)}: peers on other nodes are not load/store reachable; move data to "
                         "them with dl.shmem.putmem/getmem")
    h = heap()
    offsets = addresses.astype(np.int64) - h.base_ptr
    if offsets.size and (offsets.min() < 0 or offsets.max() >= h.nbytes):
        raise ValueError(f"rank {w.rank}, kernel {emulator.current_kernel()}: {what} of an address outside the "
                         "symmetric heap; use a tensor from tridist.symm_empty")
    owner = h.group_at(int(offsets.reshape(-1)[0])) if offsets.size else None
    if owner is not None and peer not in owner.ranks:
        raise ValueError(f"rank {w.rank}, kernel {emulator.current_kernel()}: {what} to rank {peer} of an address "
                         f"in {h.name_of(int(addresses.reshape(-1)[0]))}, which group {list(owner.ranks)} allocated: "
                         f"rank {peer} holds no copy of it; pass the group (its ranks are numbered within it), or "
                         "allocate for a group that holds both ranks")
    return (offsets + transport().peer_base(peer)).astype(np.uint64)


def _peer_ptr(ptr, peer, what: str, allow_remote_node: bool, group=None) -> tl.tensor:
    """`ptr` (a pointer or a block of them) moved to `peer`'s copy of the heap (`peer` a rank of
    `group`, or of the world)."""
    return _like(ptr, _translate(_addresses(ptr), _pe(peer, group, what), what, allow_remote_node))


# ---- identity and addressing ---------------------------------------------------------------------
def rank(group=None):
    g = _group_of(group, "dl.rank")
    return _scalar(world().rank if g is None else g.rank, tl.int32)


def num_ranks(group=None):
    g = _group_of(group, "dl.num_ranks")
    return _scalar(world().world_size if g is None else g.size, tl.int32)


def symm_at(ptr, peer, group=None, aligned=True):
    return _peer_ptr(ptr, peer, "symm_at", allow_remote_node=False, group=group)


# ---- memory order --------------------------------------------------------------------------------
def ld(ptr, scope="gpu", semantic="acquire"):
    _check_order("dl.ld", "load", scope, semantic)
    return tl.load(ptr, volatile=True)


def st(ptr, value, scope="gpu", semantic="release"):
    _check_order("dl.st", "store", scope, semantic)
    tl.store(ptr, value)


def atomic_add(ptr, value, scope="gpu", semantic="acq_rel"):
    _check_order("dl.atomic_add", "atomic", scope, semantic)
    return tl.atomic_add(ptr, value)


def atomic_cas(ptr, compare, value, scope="gpu", semantic="acq_rel"):
    _check_order("dl.atomic_cas", "atomic", scope, semantic)
    return tl.atomic_cas(ptr, compare, value)


def atomic_xchg(ptr, value, scope="gpu", semantic="acq_rel"):
    _check_order("dl.atomic_xchg", "atomic", scope, semantic)
    return tl.atomic_xchg(ptr, value)


def fence(scope="sys"):
    _check_order("dl.fence", "atomic", scope, "acq_rel")


def fence_async_proxy():
    pass


# ---- time ----------------------------------------------------------------------------------------
def global_time_ns():
    return _scalar(time.time_ns(), tl.int64)


# ---- compute -------------------------------------------------------------------------------------
def dot(a, b, acc):
    # Triton 3.6's interpreter multiplies bf16 blocks as their raw 16-bit integers; fp32 operands
    # hold bf16 and fp16 values exactly, and the products accumulate in fp32 as on the GPU.
    return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)


# ---- signals -------------------------------------------------------------------------------------
def _program() -> int:
    """This program's index in its launch, x fastest (as the GPU's reports count it)."""
    (x, y, z), (gx, gy, _) = _interpreter.interpreter_builder.grid_idx, _interpreter.interpreter_builder.grid_dim
    return x + gx * (y + gy * z)


def _wait_line(address: int, comparison: int, expected, observed, waited: float, stale: int | None = None) -> str:
    """`wait_report.line` for the word at `address`, the same line a GPU's report gives."""
    return wait_report.line(world().rank, emulator.current_kernel(), _program(), heap().name_of(address),
                            wait_report.COMPARISONS[comparison], expected, observed, waited, stale)


def _wait_until(addresses: np.ndarray, dtype, compare: int, expected) -> np.ndarray:
    """Spin until every word at `addresses` compares true against `expected`; returns the words.
    Past the timeout, the report names the first word that does not."""
    test = _COMPARE[compare]
    box = [_read(addresses, dtype)]
    if test(box[0], expected).all():
        return box[0]

    def done():
        box[0] = _read(addresses, dtype)
        return bool(test(box[0], expected).all())

    def describe(waited):
        words = box[0].reshape(-1)
        first = int(np.flatnonzero(~test(words, expected))[0])
        return _wait_line(int(addresses.reshape(-1)[first]), compare, expected, int(words[first]), waited)

    emulator.spin_until(done, describe, transport=transport())
    return box[0]


def wait(ptr, num, scope="gpu", semantic="acquire", waitValue=1):
    _check_order("dl.wait", "load", scope, semantic)
    num, expected, dtype = int(_value(num)), _value(waitValue), _element(ptr)
    first = _addresses(ptr).reshape(-1)[0]
    flags = first + np.arange(num, dtype=np.uint64) * np.uint64(dtype.primitive_bitwidth // 8)
    observed = _wait_until(flags, dtype, CMP_EQ.value, expected)
    return _scalar(observed[-1], dtype)


def consume_token(x, token):
    return x


def _signal(ptr, peer, signal, add: bool, what: str, allow_remote_node: bool, group=None):
    """Add `signal` to `peer`'s word at `ptr` (or set the word to it) atomically; returns the word's
    old value."""
    remote = _peer_ptr(ptr, peer, what, allow_remote_node, group)
    signal = _value(signal)
    if add:
        return tl.atomic_add(remote, signal)
    return tl.atomic_xchg(remote, signal)


def notify(ptr, peer, signal=1, sig_op="set", comm_scope="gpu", group=None):
    # Only "inter_node" may reach another node: on GPUs the others store through symm_at, which has
    # no address there.
    comm_scope, sig_op = _value(comm_scope), _value(sig_op)
    _check_choice("dl.notify", "comm_scope", comm_scope, _COMM_SCOPES)
    _check_choice("dl.notify", "sig_op", sig_op, _NOTIFY_OPS)
    _signal(ptr, peer, signal, sig_op == "add", "dl.notify", allow_remote_node=comm_scope == "inter_node", group=group)


# ---- checks -------------------------------------------------------------------------------------
def check(condition, message, observed, limit):
    if not bool(_value(condition)):
        raise DeviceCheckError(f"rank {world().rank}, kernel {emulator.current_kernel()}: {_value(message)}: "
                               f"{_value(observed)} (limit {_value(limit)})")


# ---- programs of one launch ----------------------------------------------------------------------
def grid_barrier(counter_ptr):
    """The GPU lowering's counting barrier (see `_gpu.grid_barrier`), with the wait bounded. Only a
    co-resident launch gives every program a thread, so anything else is refused at once."""
    state = getattr(emulator._launch, "state", None)
    if state is None or not state.coresident:
        raise ValueError(f"rank {world().rank}, kernel {emulator.current_kernel()}: dl.grid_barrier waits for every "
                         "program of the launch, which needs them all running at once: launch it with "
                         "kernel[grid](..., coresident=True)")
    grid = _interpreter.interpreter_builder.grid_dim
    programs = grid[0] * grid[1] * grid[2]
    arrived = int(_value(tl.atomic_add(counter_ptr, 1)))
    target = (arrived // programs + 1) * programs
    observed = _wait_until(_addresses(counter_ptr).reshape(-1)[:1], _element(counter_ptr), CMP_GE.value, target)
    return _scalar(observed[0], _element(counter_ptr))


# ---- kernels of one stream -----------------------------------------------------------------------
# The emulator runs one launch at a time: the kernel before this one has ended when it starts.
def launch_dependents():
    pass


def wait_prior_kernel():
    pass


# ---- OpenSHMEM-style API ---------------------------------------------------------------------------
def my_pe(group=None):
    return rank(group)


def n_pes(group=None):
    return num_ranks(group)


def ptr(dest, pe, group=None):
    if not world().same_node(_pe(pe, group, "shmem.ptr")):
        return _like(dest, np.zeros_like(_addresses(dest)))
    return symm_at(dest, pe, group)


def _copy(dst: int, src: int, nbytes: int) -> None:
    if nbytes < 0:  # on a GPU NVSHMEM reads it as a huge size and faults
        raise ValueError(f"rank {world().rank}, kernel {emulator.current_kernel()}: a put or get of {nbytes} bytes")
    if nbytes:
        ctypes.memmove(dst, src, nbytes)


def _remote(dest, pe, what, group) -> int:
    return int(_translate(_addresses(dest).reshape(-1)[:1], _pe(pe, group, what), what, allow_remote_node=True)[0])


def _local(x) -> int:
    return int(_addresses(x).reshape(-1)[0])


def _registered(local: int, nbytes: int, pe, group, what: str) -> int:
    """`local`, checked (TRIDIST_REGISTERED_ONLY, on unless 0): a network transport moves only memory
    NVSHMEM registered (the symmetric heap), so the local side of a transfer to another node must lie
    in it."""
    peer = _pe(pe, group, what)
    if nbytes > 0 and config.registered_only() and not world().same_node(peer):
        h = heap()
        if not 0 <= local - h.base_ptr <= h.nbytes - nbytes:
            raise ValueError(f"rank {world().rank}, kernel {emulator.current_kernel()}: {what} with rank {peer} on "
                             f"node {world().node_of(peer)} of {nbytes} bytes at local memory outside the symmetric "
                             "heap: a network transport refuses memory NVSHMEM did not register; stage it through "
                             "a tensor from tridist.symm_empty (TRIDIST_REGISTERED_ONLY=0 allows it, as NVLink "
                             "between virtual nodes does)")
    return local


def putmem(dest, source, nbytes, pe, group=None):
    nbytes = int(_value(nbytes))
    _copy(_remote(dest, pe, "putmem", group), _registered(_local(source), nbytes, pe, group, "putmem"), nbytes)


def getmem(dest, source, nbytes, pe, group=None):
    nbytes = int(_value(nbytes))
    _copy(_registered(_local(dest), nbytes, pe, group, "getmem"), _remote(source, pe, "getmem", group), nbytes)


def _shmem_signal(sig_addr, signal, sig_op, pe, what: str, group):
    sig_op = _value(sig_op)
    _check_choice(what, "sig_op", sig_op, _SHMEM_SIGNAL_OPS, "dl.shmem.SIGNAL_SET, dl.shmem.SIGNAL_ADD")
    _signal(sig_addr, pe, signal, sig_op == SIGNAL_ADD.value, what, allow_remote_node=True, group=group)


def signal_op(sig_addr, signal, sig_op, pe, group=None):
    _shmem_signal(sig_addr, signal, sig_op, pe, "shmem.signal_op", group)


def putmem_signal(dest, source, nbytes, sig_addr, signal, sig_op, pe, group=None):
    putmem(dest, source, nbytes, pe, group)
    _shmem_signal(sig_addr, signal, sig_op, pe, "shmem.putmem_signal", group)


def signal_wait_until(sig_addr, cmp, cmp_value):
    cmp = _value(cmp)
    _check_choice("shmem.signal_wait_until", "cmp", cmp, _COMPARE,
                  "dl.shmem.CMP_EQ, CMP_NE, CMP_GT, CMP_GE, CMP_LT, CMP_LE")
    observed = _wait_until(_addresses(sig_addr).reshape(-1)[:1], _element(sig_addr), cmp, _value(cmp_value))
    return _scalar(observed[0], _element(sig_addr))


def quiet():
    pass


def barrier_all():
    """Epoch barrier: write my epoch into my slot on every peer, then wait until every slot reaches it.

    Slot `r` on any rank is written only by rank `r`, with epochs that only grow, so plain stores
    suffice and a peer already in the next barrier cannot confuse this one (the test is `>=`).
    """
    w = world()
    slots = transport().device_barrier
    epoch = transport().next_device_barrier_epoch()
    offset = slots.data_ptr() - heap().base_ptr + 8 * w.rank
    for peer in range(w.world_size):
        ctypes.c_int64.from_address(transport().peer_base(peer) + offset).value = epoch
    mine = slots.data_ptr() + 8 * np.arange(w.world_size, dtype=np.uint64)
    _wait_until(mine, tl.int64, CMP_GE.value, epoch)


sync_all = barrier_all


def p(dest, value, pe, group=None):
    tl.store(_peer_ptr(dest, pe, "shmem.p", allow_remote_node=True, group=group), value)


def g(source, pe, group=None):
    return tl.load(_peer_ptr(source, pe, "shmem.g", allow_remote_node=True, group=group), volatile=True)


def atomic_fetch_add(dest, value, pe, group=None):
    return _signal(dest, pe, value, True, "shmem.atomic_fetch_add", allow_remote_node=True, group=group)


def atomic_inc(dest, pe, group=None):
    _signal(dest, pe, 1, True, "shmem.atomic_inc", allow_remote_node=True, group=group)


def atomic_set(dest, value, pe, group=None):
    _signal(dest, pe, value, False, "shmem.atomic_set", allow_remote_node=True, group=group)


def atomic_compare_swap(dest, cond, value, pe, group=None):
    return tl.atomic_cas(_peer_ptr(dest, pe, "shmem.atomic_compare_swap", allow_remote_node=True, group=group), cond,
                         value)


# The emulator copies synchronously, so every issuing form and every ordering call is the same.
putmem_nbi = putmem_warp = putmem_nbi_warp = putmem_block = putmem_nbi_block = putmem
getmem_nbi = getmem_warp = getmem_nbi_warp = getmem_block = getmem_nbi_block = getmem
putmem_signal_nbi = putmem_signal_block = putmem_signal_nbi_block = putmem_signal
shmem_fence = quiet


# ---- low-latency packets -------------------------------------------------------------------------
def wait_packets(ptrs, mask, flag):
    """Spin until every packet word at `ptrs` (where `mask`) carries `flag` in its high half;
    returns the words (zeros where masked off)."""
    flag = int(_value(flag))
    addresses = _addresses(ptrs)
    active = np.broadcast_to(mask.handle.data.astype(bool), addresses.shape)
    words = np.zeros(addresses.shape, dtype=np.int64)
    if active.any():
        watched = addresses[active]
        box = [None]

        def done():
            box[0] = _read(watched, tl.int64)
            return bool(((box[0] >> 32).astype(np.int32) == flag).all())

        def describe(waited):
            flags = (box[0] >> 32).astype(np.int32)
            stale = np.flatnonzero(flags != flag)
            return _wait_line(int(watched[stale[0]]), CMP_EQ.value, flag, int(flags[stale[0]]), waited, stale.size)

        emulator.spin_until(done, describe, transport=transport())
        words[active] = box[0]
    return tl.tensor(TensorHandle(words, tl.int64), ptrs.type.with_element_ty(tl.int64)
                     if ptrs.type.is_block() else tl.int64)
