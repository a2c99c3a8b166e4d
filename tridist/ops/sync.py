"""Synchronisation a host queues on a stream: a barrier across ranks, and a timed busy-wait."""
import torch

from .. import language as dl
from ..language._gpu import _global_time_ns
from ..runtime.backend import is_emulator
from ..runtime.jit import jit
from ..runtime.world import world


@jit
def _barrier_kernel():
    dl.shmem.barrier_all()


@jit(do_not_specialize=["duration_ns"])  # one compiled kernel for every duration; GPUs only
def _sleep_kernel(duration_ns):
    start = _global_time_ns()
    now = start
    while now - start < duration_ns:
        now = _global_time_ns()


def barrier_all_on_stream(stream: "torch.cuda.Stream | None" = None) -> None:
    """Queue a barrier across all ranks on `stream` (default: the current one). On GPUs the host
    does not wait for it; in the emulator, which has no streams, the host runs it and returns once
    every rank has reached it."""
    world()
    if is_emulator():
        _barrier_kernel[(1,)]()
        return
    with torch.cuda.stream(stream or torch.cuda.current_stream()):
        _barrier_kernel[(1,)]()


def sleep_async(microseconds: float, stream: "torch.cuda.Stream | None" = None) -> None:
    """Keep `stream` busy for about `microseconds` (so that launch skew stays out of timings).
    A no-op in the emulator, which has no streams to keep busy."""
    if microseconds < 0:
        raise ValueError(f"sleep_async takes a duration >= 0, got {microseconds}")
    if is_emulator():
        return
    with torch.cuda.stream(stream or torch.cuda.current_stream()):
        _sleep_kernel[(1,)](int(microseconds * 1000))
