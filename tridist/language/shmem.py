"""OpenSHMEM-style device functions (`dl.shmem`), NVSHMEM's names without the `nvshmem_` prefix.

`dest`/`source` are symmetric addresses (pointers into tensors from `tridist.symm_empty`) where the
remote side is meant, and any local address elsewhere; `nbytes` counts bytes; `pe` is a rank.
Plain forms are issued by one thread of the program, `_warp` by its first warp, `_block` by all
of its threads; `_nbi` forms return before the data has left, and `quiet()` waits for them.
`barrier_all`/`sync_all` (and their `_block` forms, the same thing in Triton) must be called by
one program of the kernel on every rank; on GPUs they are NVSHMEM's own, unbounded even with
TRIDIST_DEBUG=1 (see `_gpu.barrier_all`).
"""
from ..runtime.backend import is_emulator

if is_emulator():
    from . import _emulated as _lowering
else:
    from . import _gpu as _lowering

from ._constants import CMP_EQ, CMP_GE, CMP_GT, CMP_LE, CMP_LT, CMP_NE, SIGNAL_ADD, SIGNAL_SET

my_pe = _lowering.my_pe
n_pes = _lowering.n_pes
ptr = _lowering.ptr
signal_op = _lowering.signal_op
signal_wait_until = _lowering.signal_wait_until
quiet = _lowering.quiet
fence = _lowering.shmem_fence
barrier_all = barrier_all_block = _lowering.barrier_all
sync_all = sync_all_block = _lowering.sync_all
p = _lowering.p
g = _lowering.g
atomic_fetch_add = _lowering.atomic_fetch_add
atomic_inc = _lowering.atomic_inc
atomic_set = _lowering.atomic_set
atomic_compare_swap = _lowering.atomic_compare_swap

putmem, putmem_nbi = _lowering.putmem, _lowering.putmem_nbi
putmem_warp, putmem_nbi_warp = _lowering.putmem_warp, _lowering.putmem_nbi_warp
putmem_block, putmem_nbi_block = _lowering.putmem_block, _lowering.putmem_nbi_block
getmem, getmem_nbi = _lowering.getmem, _lowering.getmem_nbi
getmem_warp, getmem_nbi_warp = _lowering.getmem_warp, _lowering.getmem_nbi_warp
getmem_block, getmem_nbi_block = _lowering.getmem_block, _lowering.getmem_nbi_block
putmem_signal, putmem_signal_nbi = _lowering.putmem_signal, _lowering.putmem_signal_nbi
putmem_signal_block, putmem_signal_nbi_block = _lowering.putmem_signal_block, _lowering.putmem_signal_nbi_block

__all__ = ["my_pe", "n_pes", "ptr", "signal_op", "signal_wait_until", "quiet", "fence", "barrier_all",
           "barrier_all_block", "sync_all", "sync_all_block", "p", "g", "atomic_fetch_add", "atomic_inc", "atomic_set",
           "atomic_compare_swap", "putmem", "putmem_nbi", "putmem_warp", "putmem_nbi_warp", "putmem_block",
           "putmem_nbi_block", "getmem", "getmem_nbi", "getmem_warp", "getmem_nbi_warp", "getmem_block",
           "getmem_nbi_block", "putmem_signal", "putmem_signal_nbi", "putmem_signal_block", "putmem_signal_nbi_block",
           "CMP_EQ", "CMP_NE", "CMP_GT", "CMP_GE", "CMP_LT", "CMP_LE", "SIGNAL_SET", "SIGNAL_ADD"]
