"""OpenSHMEM-style device functions (`dl.shmem`), NVSHMEM's names without the `nvshmem_` prefix.

They reach any rank, on this node or another: on GPUs they are NVSHMEM's device functions (over
NVLink within a node, the network across nodes), in the emulator memory copies and atomics.
Within a node, stores through [`dl.symm_at`][tridist.language.symm_at] are the faster path.

Conventions of every function here:

- `dest`/`source` are symmetric addresses (pointers into tensors from `tridist.symm_empty`)
  where the remote side is meant, and any local address elsewhere (across nodes, put from
  symmetric memory: the network reads only memory NVSHMEM registered); `nbytes` counts bytes;
  `pe` is a rank: of the world, or, where the last argument `group` is given (a kernel argument
  given a [`tridist.Group`][tridist.Group]), of that group (`my_pe(group)` and `n_pes(group)`
  likewise). `barrier_all` and `sync_all` are the world's.
- Plain forms are issued by one thread of the program, `_warp` by its first warp, `_block` by
  all of its threads (the whole program cooperates in one transfer: the fast form for large
  data).
- `_nbi` forms return before the data has left; `quiet()` waits until they are complete.
  The others return once `source` may be reused.
- `barrier_all`/`sync_all` (and their `_block` forms, the same thing in Triton) must be called by
  one program of the kernel on every rank; on GPUs they are NVSHMEM's own, unbounded even with
  TRIDIST_DEBUG=1: a rank whose peer never arrives spins with no report.
- Bad constant arguments (`sig_op`, `cmp`) fail when the kernel compiles on GPUs and raise
  `ValueError` in the emulator; a negative `nbytes` raises there too.
"""
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:  # pragma: no cover - never run: the documented signatures, for readers, IDEs and the API reference
    import triton.language as tl

    def my_pe(group=None) -> tl.tensor:
        """This rank, as [`dl.rank`][tridist.language.rank] (in `group`, if given)."""

    def n_pes(group=None) -> tl.tensor:
        """The number of ranks, as [`dl.num_ranks`][tridist.language.num_ranks] (of `group`, if
        given)."""

    def ptr(dest: tl.tensor, pe, group=None) -> tl.tensor:
        """`pe`'s address of the symmetric `dest` if `pe` is load/store reachable (on this
        node), else a null pointer (`nvshmem_ptr`). Unlike `dl.symm_at`, asking about a rank on
        another node is not an error."""

    def putmem(dest: tl.tensor, source: tl.tensor, nbytes, pe, group=None) -> None:
        """Copy `nbytes` bytes from local `source` to `dest` on rank `pe`; returns once `source`
        may be reused (one thread issues it).

        Args:
            dest: this rank's address of the symmetric destination.
            source: local data (symmetric memory for a `pe` on another node).
            nbytes: bytes to copy.
            pe: the destination rank.
            group: a kernel argument given a `tridist.Group` (then `pe` is a rank of the
                group), or None.
        """

    def putmem_nbi(dest: tl.tensor, source: tl.tensor, nbytes, pe, group=None) -> None:
        """`putmem` that returns at once; `quiet()` completes it."""

    def putmem_warp(dest: tl.tensor, source: tl.tensor, nbytes, pe, group=None) -> None:
        """`putmem` issued by the program's first warp."""

    def putmem_nbi_warp(dest: tl.tensor, source: tl.tensor, nbytes, pe, group=None) -> None:
        """`putmem_nbi` issued by the program's first warp."""

    def putmem_block(dest: tl.tensor, source: tl.tensor, nbytes, pe, group=None) -> None:
        """`putmem` issued by every thread of the program together."""

    def putmem_nbi_block(dest: tl.tensor, source: tl.tensor, nbytes, pe, group=None) -> None:
        """`putmem_nbi` issued by every thread of the program together."""

    def getmem(dest: tl.tensor, source: tl.tensor, nbytes, pe, group=None) -> None:
        """Copy `nbytes` bytes from `source` on rank `pe` (this rank's address of the symmetric
        source) to local `dest`; returns once the data is in `dest`."""

    def getmem_nbi(dest: tl.tensor, source: tl.tensor, nbytes, pe, group=None) -> None:
        """`getmem` that returns at once; `quiet()` completes it."""

    def getmem_warp(dest: tl.tensor, source: tl.tensor, nbytes, pe, group=None) -> None:
        """`getmem` issued by the program's first warp."""

    def getmem_nbi_warp(dest: tl.tensor, source: tl.tensor, nbytes, pe, group=None) -> None:
        """`getmem_nbi` issued by the program's first warp."""

    def getmem_block(dest: tl.tensor, source: tl.tensor, nbytes, pe, group=None) -> None:
        """`getmem` issued by every thread of the program together."""

    def getmem_nbi_block(dest: tl.tensor, source: tl.tensor, nbytes, pe, group=None) -> None:
        """`getmem_nbi` issued by every thread of the program together."""

    def putmem_signal(dest: tl.tensor, source: tl.tensor, nbytes, sig_addr: tl.tensor, signal, sig_op,
                      pe, group=None) -> None:
        """`putmem`, then raise the signal word `sig_addr` on `pe` once the data has landed
        there: a reader that waits for the signal may read the data (one thread issues it).

        Args:
            dest: this rank's address of the symmetric destination.
            source: local data (symmetric memory for a `pe` on another node).
            nbytes: bytes to copy.
            sig_addr: this rank's address of the symmetric signal word (int64).
            signal: the value to set or add.
            sig_op: `SIGNAL_SET` or `SIGNAL_ADD`.
            pe: the destination rank.
            group: a kernel argument given a `tridist.Group` (then `pe` is a rank of the
                group), or None.
        """

    def putmem_signal_nbi(dest: tl.tensor, source: tl.tensor, nbytes, sig_addr: tl.tensor, signal, sig_op,
                          pe, group=None) -> None:
        """`putmem_signal` that returns at once; `quiet()` completes it."""

    def putmem_signal_block(dest: tl.tensor, source: tl.tensor, nbytes, sig_addr: tl.tensor, signal, sig_op,
                            pe, group=None) -> None:
        """`putmem_signal` issued by every thread of the program together."""

    def putmem_signal_nbi_block(dest: tl.tensor, source: tl.tensor, nbytes, sig_addr: tl.tensor, signal,
                                sig_op, pe, group=None) -> None:
        """`putmem_signal_nbi` issued by every thread of the program together: what the ops use
        to send a slice across nodes."""

    def signal_op(sig_addr: tl.tensor, signal, sig_op, pe, group=None) -> None:
        """Set (`SIGNAL_SET`) or add to (`SIGNAL_ADD`) the signal word `sig_addr` on rank `pe`,
        atomically, with no data (one thread issues it). Unlike
        [`dl.notify`][tridist.language.notify] it does not order the program's earlier stores
        before the signal: use `fence()` or `quiet()` first where it must."""

    def signal_wait_until(sig_addr: tl.tensor, cmp: tl.constexpr, cmp_value) -> tl.tensor:
        """Spin until this rank's signal word at `sig_addr` compares true against `cmp_value`
        (`cmp`: one of `CMP_EQ`, `CMP_NE`, `CMP_GT`, `CMP_GE`, `CMP_LT`, `CMP_LE`); returns the
        word. An acquire at system scope: loads after it see what was written before the signal.
        Bounded and reporting like [`dl.wait`][tridist.language.wait] in the emulator and, on GPUs,
        with TRIDIST_DEBUG=1."""

    def quiet() -> None:
        """Wait until every put and get this thread issued (the `_nbi` forms too) is complete."""

    def fence() -> None:
        """Order this thread's puts to each rank: those issued before the fence land before
        those issued after it (no wait for completion, unlike `quiet`)."""

    def barrier_all() -> None:
        """NVSHMEM's barrier across all ranks, called by one program of the kernel on every
        rank; completes the caller's puts first. Unbounded on GPUs even with TRIDIST_DEBUG=1 (a
        device function without arguments cannot reach the symmetric words a bounded barrier
        spins on); bounded in the emulator."""

    def barrier_all_block() -> None:
        """The same as `barrier_all` (in Triton every thread of the program calls it)."""

    def sync_all() -> None:
        """NVSHMEM's sync: a barrier that does not complete outstanding puts. Unbounded on GPUs,
        like `barrier_all`."""

    def sync_all_block() -> None:
        """The same as `sync_all`."""

    def p(dest: tl.tensor, value, pe, group=None) -> None:
        """Store one element `value` at `dest` on rank `pe` (int32, int64, uint32, uint64,
        fp32 or fp64 elements; one thread issues it)."""

    def g(source: tl.tensor, pe, group=None) -> tl.tensor:
        """Load one element from `source` on rank `pe` (the element types of `p`)."""

    def atomic_fetch_add(dest: tl.tensor, value, pe, group=None) -> tl.tensor:
        """Add `value` to the word `dest` on rank `pe` atomically; returns the old value to every
        thread (int32, int64, uint32 or uint64 words)."""

    def atomic_inc(dest: tl.tensor, pe, group=None) -> None:
        """Add 1 to the word `dest` on rank `pe` atomically."""

    def atomic_set(dest: tl.tensor, value, pe, group=None) -> None:
        """Set the word `dest` on rank `pe` to `value` atomically."""

    def atomic_compare_swap(dest: tl.tensor, cond, value, pe, group=None) -> tl.tensor:
        """Store `value` into the word `dest` on rank `pe` if it equals `cond`, atomically;
        returns the old value to every thread."""
