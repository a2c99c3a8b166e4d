"""Synchronisation a host queues on a stream: a barrier across ranks (NVSHMEM's, or one of
tridist's own with slots of its own, `Barrier`), and a timed busy-wait (`sleep_async`)."""
import torch

from .. import language as dl
from ..language import global_time_ns as _global_time_ns
from ..runtime import config
from ..runtime.backend import is_emulator
from ..runtime.jit import jit
from ..runtime.tensors import signals, symm_free
from ..runtime.world import bounded_barrier, world


@jit
def _barrier_kernel():
    """NVSHMEM's barrier_all, one program: every rank's earlier work on the stream is done and its
    puts have landed when any rank passes it. Unbounded."""
    dl.shmem.barrier_all()


@jit
def _bounded_barrier_kernel(slots_ptr, passed_ptr):
    """A barrier with slots of its own (`Barrier`; also `barrier_all_on_stream` on GPUs with
    TRIDIST_DEBUG=1, where NVSHMEM's cannot be bounded): barrier e raises this rank's slot on every
    rank to e, then waits (bounded under debug, as every wait) until each slot here is at least e.
    Slot r is written only by rank r, with values that only grow, so a peer already in barrier e+1
    does not confuse this one. One program."""
    me = dl.rank()
    world_size = dl.num_ranks()
    epoch = dl.ld(passed_ptr, scope="gpu", semantic="relaxed") + 1
    for peer in range(world_size):  # NVSHMEM's signal reaches every rank, on this node or another
        dl.notify(slots_ptr + me, peer, signal=epoch, sig_op="set", comm_scope="inter_node")
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


def barrier_all_on_stream(stream: "torch.cuda.Stream | None" = None) -> None:
    """Queue a barrier across all ranks on `stream` (default: the current one): work queued on
    the stream after it starts once every rank's stream has reached it.

    On GPUs the host does not wait for it. It is NVSHMEM's barrier, unbounded, or with
    TRIDIST_DEBUG=1 a barrier of tridist's own on symmetric words allocated at `tridist.init`,
    bounded like every wait. In the emulator, which has no streams, the host runs it and returns
    once every rank has reached it.
    """
    world()
    if is_emulator():
        _barrier_kernel[(1,)]()
        return
    with torch.cuda.stream(stream or torch.cuda.current_stream()):
        if config.debug():
            _bounded_barrier_kernel[(1,)](*bounded_barrier())
        else:
            _barrier_kernel[(1,)]()


class Barrier:
    """A barrier across all ranks, queued on the current stream, with slots and a count of its own
    (`_bounded_barrier_kernel`). NVSHMEM's barrier_all is one collective of the whole world, paired
    across ranks in the order it is called: two op instances that each queued it on their own
    stream could pair one's barrier on one rank with the other's on another. An op that queues a
    barrier every call holds one of these instead. Build it on every rank at once (it allocates
    symmetric memory); graph replays count, since the count is on the device."""

    def __init__(self):
        w = world()
        self.slots = signals(w.world_size)
        self.passed = torch.zeros(1, dtype=torch.int64, device=w.device)

    def __call__(self) -> None:
        _bounded_barrier_kernel[(1,)](self.slots, self.passed)

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
