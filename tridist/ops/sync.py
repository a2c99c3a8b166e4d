"""Synchronisation a host queues on a stream: a barrier across ranks (NVSHMEM's, or one of
tridist's own with slots of its own, `Barrier`), also among a group's members only, and a timed
busy-wait (`sleep_async`)."""
import torch

from .. import language as dl
from ..language import global_time_ns as _global_time_ns
from ..runtime import config, groups
from ..runtime.backend import is_emulator
from ..runtime.jit import jit
from ..runtime.tensors import signals, symm_free
from ..runtime.world import bounded_barrier, world
from . import call_order


@jit
def _barrier_kernel():
    """NVSHMEM's barrier_all, one program: every rank's earlier work on the stream is done and its
    puts have landed when any rank passes it. Unbounded."""
    dl.shmem.barrier_all()


@jit
def _bounded_barrier_kernel(slots_ptr, passed_ptr, group=None):
    """A barrier with slots of its own (`Barrier`; also `barrier_all_on_stream` on GPUs with
    TRIDIST_DEBUG=1, where NVSHMEM's cannot be bounded): barrier e raises this rank's slot on every
    rank to e, then waits (bounded under debug, as every wait) until each slot here is at least e.
    Slot r is written only by rank r, with values that only grow, so a peer already in barrier e+1
    does not confuse this one. One program. With `group`, among the group's ranks."""
    me = dl.rank(group)
    world_size = dl.num_ranks(group)
    epoch = dl.ld(passed_ptr, scope="gpu", semantic="relaxed") + 1
    for peer in range(world_size):  # NVSHMEM's signal reaches every rank, on this node or another
        dl.notify(slots_ptr + me, peer, signal=epoch, sig_op="set", comm_scope="inter_node", group=group)
    for peer in range(world_size):
        dl.shmem.signal_wait_until(slots_ptr + peer, dl.shmem.CMP_GE, epoch)
    dl.st(passed_ptr, epoch, scope="gpu", semantic="relaxed")


@jit(do_not_specialize=["duration_ns"])  # one compiled kernel for every duration; GPUs only
def _sleep_kernel(duration_ns):
    """Spins on the global timer until `duration_ns` have passed, one program."""
    start = _global_time_ns()
    now = start
    while now - start < duration_ns:
        now = _global_time_ns()


def barrier_all_on_stream(stream: "torch.cuda.Stream | None" = None, group=None) -> None:
    """Queue a barrier across all ranks (or the members of `group`) on `stream` (default: the
    current one): work queued on the stream after it starts once every rank's stream has reached it.

    On GPUs the host does not wait for it. Across the world it is NVSHMEM's barrier, unbounded, or
    with TRIDIST_DEBUG=1 a barrier of tridist's own on symmetric words allocated at `tridist.init`,
    bounded like every wait. NVSHMEM's barrier is the whole world's, so within a group it is always
    tridist's own (`Barrier`), on slots the members allocate together at the group's first barrier:
    make that first call outside any CUDA-graph capture. In the emulator, which has no streams, the
    host runs it and returns once every rank (member) has reached it.

    Args:
        stream: where to queue it; the current stream by default.
        group: a `torch.distributed.ProcessGroup` or `tridist.Group` this rank is a member of:
            a barrier of its members only, which the other ranks take no part in. None: the world.

    Raises:
        ValueError: this rank is not a member of `group`.
    """
    world()
    g = groups.resolve(group)
    if g is not None and g not in _group_barriers:  # the members allocate its slots together, here
        _group_barriers[g] = Barrier(g)
    if is_emulator():
        _barrier(g)
        return
    with torch.cuda.stream(stream or torch.cuda.current_stream()):
        call_order.take_turn()
        _barrier(g)


# Group -> its Barrier, for `barrier_all_on_stream(group=...)`. Keyed by the Group object, which a
# finalize retires (`groups.forget`), so that a later world never meets a barrier of an old heap.
_group_barriers: dict = {}


def _barrier(g) -> None:
    """Queue the barrier of the world (g None) or of the group g on the current stream."""
    if g is not None:
        _group_barriers[g]()
    elif config.debug() and not is_emulator():
        _bounded_barrier_kernel[(1,)](*bounded_barrier())
    else:
        _barrier_kernel[(1,)]()


class Barrier:
    """A barrier across all ranks (or the members of `group`, a `tridist.Group`), queued on the
    current stream, with slots and a count of its own (`_bounded_barrier_kernel`). NVSHMEM's
    barrier_all is one collective of the whole world, paired across ranks in the order it is
    called: two op instances that each queued it on their own stream could pair one's barrier on
    one rank with the other's on another. An op that queues a barrier every call holds one of
    these instead. Build it on every rank (member) at once (it allocates symmetric memory); graph
    replays count, since the count is on the device."""

    def __init__(self, group=None):
        w = world()
        self.group = group
        self.slots = signals(w.world_size if group is None else group.size, group)
        self.passed = torch.zeros(1, dtype=torch.int64, device=w.device)

    def __call__(self) -> None:
        _bounded_barrier_kernel[(1,)](self.slots, self.passed, group=self.group)

    def free(self) -> None:
        symm_free(self.slots)


def sleep_async(microseconds: float, stream: "torch.cuda.Stream | None" = None) -> None:
    """Keep `stream` (default: the current one) busy for about `microseconds`, so that what the
    host queues behind it starts together and launch skew stays out of timings. A no-op in the
    emulator, which has no streams to keep busy.

    Raises:
        ValueError: a negative duration.
    """
    if microseconds < 0:
        raise ValueError(f"sleep_async takes a duration >= 0, got {microseconds}")
    if is_emulator():
        return
    with torch.cuda.stream(stream or torch.cuda.current_stream()):
        _sleep_kernel[(1,)](int(microseconds * 1000))
