"""Synchronisation a host queues on a stream: a barrier across ranks, and a timed busy-wait."""
import torch
import triton.language as tl

from .. import language as dl
from ..runtime.backend import is_emulator
from ..runtime.jit import jit
from ..runtime.world import world


@jit
def _barrier_kernel():
    dl.shmem.barrier_all()


@jit(do_not_specialize=["duration_ns"])  # one compiled kernel for every duration
def _sleep_kernel(duration_ns):
    start = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    now = start
    while now - start < duration_ns:
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


def barrier_all_on_stream(stream: "torch.cuda.Stream | None" = None) -> None:
    """Queue a barrier across all ranks on `stream` (default: the current one); the host does not wait."""
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
