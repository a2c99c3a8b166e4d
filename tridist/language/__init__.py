"""`tridist.language` (imported as `dl`): the device functions a distributed kernel calls.

Every function has two lowerings with one meaning: `_gpu.py` (inline PTX and NVSHMEM's device
library) and `_emulated.py` (Python under Triton's interpreter). The backend chosen at import
(`tridist.runtime.backend`) decides which one these names are bound to.

Scopes are "gpu" (this GPU) or "sys" (every GPU and the host); semantics are "relaxed",
"acquire", "release" and "acq_rel" (`ld` and `wait` cannot release, `st` cannot acquire). A
device function is called by every thread of a Triton program; where NVSHMEM has per-thread,
per-warp and per-block forms, the plain form is issued by one thread of the program, the `_warp`
form by its first warp, and the `_block` form by all its threads.

`grid_barrier(counter_ptr)` holds every program of a co-resident launch (`kernel[grid](...,
coresident=True)`) until all have reached it, on a counter word of its own that never needs a reset.

`fence_async_proxy` orders this thread's earlier memory accesses (a wait's acquire) before the
tensor-memory-accelerator loads that follow (TMA runs in the "async proxy"). `dot` is `tl.dot`,
and in the emulator a `tl.dot` that is exact for bf16. `global_time_ns` reads the GPU's
nanosecond timer (the host's clock in the emulator).
"""
from ..runtime.backend import is_emulator

if is_emulator():
    from ._emulated import (atomic_add, atomic_cas, atomic_xchg, consume_token, dot, fence, fence_async_proxy,
                            global_time_ns, grid_barrier, ld, notify, num_ranks, rank, st, symm_at, wait)
else:
    from ._gpu import (atomic_add, atomic_cas, atomic_xchg, consume_token, dot, fence, fence_async_proxy,
                       global_time_ns, grid_barrier, ld, notify, num_ranks, rank, st, symm_at, wait)

from . import ll, shmem

__all__ = ["rank", "num_ranks", "symm_at", "notify", "wait", "consume_token", "ld", "st", "atomic_add",
           "atomic_cas", "atomic_xchg", "fence", "fence_async_proxy", "dot", "global_time_ns", "shmem", "ll",
           "grid_barrier"]
