"""`tridist.language` (imported as `dl`): the device functions a distributed kernel calls.

```python
import tridist.language as dl
```

Every function has two lowerings with one meaning: `_gpu.py` (inline PTX and NVSHMEM's device
library) and `_emulated.py` (Python under Triton's interpreter). The backend chosen at import
(`tridist.BACKEND`) decides which one these names are bound to; the signatures and meanings
documented here (the `TYPE_CHECKING` block at the end of this file) are those of both.

| group | functions |
| --- | --- |
| identity, addressing | `rank(group=None)`, `num_ranks(group=None)`, `symm_at(ptr, peer, group=None, aligned=True)` |
| signals | `notify(ptr, peer, signal=1, sig_op="set", comm_scope="gpu", group=None)`, `wait(ptr, num, scope, semantic, waitValue)` -> token, `consume_token(x, token)` |
| memory order | `ld`, `st`, `atomic_add`, `atomic_cas`, `atomic_xchg`, `fence()`, `fence_async_proxy()` |
| time | `global_time_ns()` |
| checks | `check(condition, message, observed, limit)`: an error naming the rank and kernel (emulator, `TRIDIST_DEBUG=1`) |
| compute | `dot(a, b, acc)` |
| programs of one launch | `grid_barrier(counter_ptr)`, in a co-resident launch (`kernel[grid](..., coresident=True)`) |
| kernels of one stream | `launch_dependents()`, `wait_prior_kernel()`: programmatic dependent launch (`kernel[grid](..., launch_pdl=True)`) |
| [`dl.shmem`][tridist.language.shmem] | puts, gets, puts with signal (plain, `_nbi`, `_warp`, `_block` forms), `signal_op`, `signal_wait_until`, `quiet`, `fence`, barriers, typed `p`/`g`, remote atomics, `CMP_*`, `SIGNAL_*` |
| [`dl.ll`][tridist.language.ll] | low-latency packets: `pack`, `unpack`, `send`, `recv` |

Memory order: scopes are `"gpu"` (this GPU) or `"sys"` (every GPU and the host); semantics are
`"relaxed"`, `"acquire"`, `"release"` and `"acq_rel"`. A load (`ld`, `wait`) cannot release and a
store (`st`) cannot acquire. A signal raised by another GPU is acquired at `"sys"` scope. Other
values fail when the kernel compiles on GPUs, and raise `ValueError` in the emulator.

A device function is called by every thread of a Triton program; where NVSHMEM has per-thread,
per-warp and per-block forms (`dl.shmem`), the plain form is issued by one thread of the program,
the `_warp` form by its first warp, and the `_block` form by all of its threads.

`dl.shmem` reaches any rank, on this node or another; `symm_at` and `notify` (unless
`comm_scope="inter_node"`) reach the ranks of this node only.

Groups: a kernel runs within a process group when it is passed the group's
[`tridist.Group`][tridist.Group] (`tridist.group(process_group)`) as an argument, and gives that
argument as `group` to the functions that name ranks: `dl.rank(g)` and `dl.num_ranks(g)` are then
this rank's index in the group and the group's size, and `peer` (`pe` in `dl.shmem`) is a rank of
the group, translated into the world's rank (NVSHMEM's PE) with one load from the group's table.
Without `group` (None) ranks are the world's, and the kernel compiles exactly as it would without
groups. Memory a group allocated (`tridist.symm_empty(..., group=...)`) is held by its members
only. `wait` and the `ll` functions take this rank's own words, which need no group;
`dl.shmem.barrier_all` and `sync_all` are the world's (within a group, use signals).
"""
from typing import TYPE_CHECKING

from ..runtime.backend import is_emulator

if is_emulator():
    from ._emulated import (atomic_add, atomic_cas, atomic_xchg, check, consume_token, dot, fence, fence_async_proxy,
                            global_time_ns, grid_barrier, launch_dependents, ld, notify, num_ranks, rank, st, symm_at,
                            wait, wait_prior_kernel)
else:
    from ._gpu import (atomic_add, atomic_cas, atomic_xchg, check, consume_token, dot, fence, fence_async_proxy,
                       global_time_ns, grid_barrier, launch_dependents, ld, notify, num_ranks, rank, st, symm_at,
                       wait, wait_prior_kernel)

from . import ll, shmem

__all__ = ["rank", "num_ranks", "symm_at", "notify", "wait", "consume_token", "ld", "st", "atomic_add",
           "atomic_cas", "atomic_xchg", "check", "fence", "fence_async_proxy", "dot", "global_time_ns", "grid_barrier",
           "launch_dependents", "wait_prior_kernel", "shmem", "ll"]

if TYPE_CHECKING:  # pragma: no cover - never run: the documented signatures, for readers, IDEs and the API reference
    import triton.language as tl

    def rank(group=None) -> tl.tensor:
        """This rank's index in the world, an int32 scalar (NVSHMEM's PE number on GPUs); with
        `group` (a kernel argument given a `tridist.Group`), its index in the group."""

    def num_ranks(group=None) -> tl.tensor:
        """The number of ranks in the world, an int32 scalar; with `group`, in the group."""

    def symm_at(ptr: tl.tensor, peer, group=None, aligned: tl.constexpr = True) -> tl.tensor:
        """`peer`'s address of the symmetric pointer `ptr`: loads and stores through it reach
        `peer`'s copy of the buffer directly (over NVLink or PCIe).

        Only ranks of this node are load/store reachable; across nodes move data with
        [`dl.shmem`][tridist.language.shmem] puts and gets.

        Args:
            ptr: a pointer, or a block of pointers, into a symmetric tensor
                (`tridist.symm_empty`).
            peer: the rank whose copy is meant (this rank's own gives `ptr` back): a rank of
                the world, or of `group`.
            group: a kernel argument given a [`tridist.Group`][tridist.Group], or None (the
                world).
            aligned: tell Triton that the peer's copy is as aligned as `ptr` (true of every
                symmetric buffer: each rank's heap starts at least 16-byte aligned), so that
                accesses through the result can be 16 bytes wide. Without it a bf16 kernel
                stores 2 bytes at a time through the peer's pointer.

        Returns:
            Pointers of `ptr`'s type into `peer`'s memory. On GPUs a peer on another node
            gives null pointers.

        Raises:
            ValueError: in the emulator, for a peer on another (virtual) node, a `ptr` outside
                the symmetric heap, a `ptr` in a group's allocation that `peer` does not hold,
                or a `group` that is not a `tridist.Group`.
            IndexError: in the emulator, for a `peer` outside the world (the group).
        """

    def notify(ptr: tl.tensor, peer, signal=1, sig_op: tl.constexpr = "set",
               comm_scope: tl.constexpr = "gpu", group=None) -> None:
        """Raise `peer`'s signal word at `ptr`: set it to `signal` or add `signal` to it,
        atomically, after every write this program made before the call is visible to `peer`
        (a barrier of the program's threads, then a release at system scope).

        A reader waits for the value with [`wait`][tridist.language.wait] (or
        `dl.shmem.signal_wait_until`) and may then read what was written before the notify.

        Args:
            ptr: a symmetric signal word (`tridist.signals`, int64), this rank's address of it.
            peer: the rank whose word is raised (may be this rank): of the world, or of
                `group`.
            signal: the value to set or add.
            sig_op: `"set"` or `"add"` (a constexpr string; `dl.shmem.SIGNAL_*` are for
                `dl.shmem`'s functions).
            comm_scope: `"gpu"` or `"intra_node"` store through `symm_at` and reach the ranks
                of this node; `"inter_node"` signals through NVSHMEM and reaches any rank.
            group: a kernel argument given a [`tridist.Group`][tridist.Group], or None (the
                world).

        Raises:
            ValueError: in the emulator, for another `sig_op` or `comm_scope`, or a `peer` on
                another node with a `comm_scope` other than `"inter_node"` (on GPUs those
                values fail to compile).
        """

    def wait(ptr: tl.tensor, num, scope: tl.constexpr = "gpu", semantic: tl.constexpr = "acquire",
             waitValue=1) -> tl.tensor:
        """Spin until each of the `num` signal words from `ptr` on equals `waitValue`.

        Every thread of the program waits. The comparison is equality: signals that only grow
        (an epoch per call) let a reader wait for exactly this call's value without resetting
        them.

        Bounded in the emulator, always, and on GPUs with `TRIDIST_DEBUG=1`: after
        `TRIDIST_WAIT_TIMEOUT` seconds the wait reports the rank, the kernel, the signal and the
        expected and observed values instead of spinning forever (see the guide's page on hangs).

        Args:
            ptr: the first of `num` consecutive signal words (int64 or int32), this rank's own.
            num: how many words to wait for.
            scope: `"sys"` when the signal is raised by another GPU (a peer's `notify`), `"gpu"`
                when by this GPU.
            semantic: `"acquire"` (loads after the wait see what the signaller wrote before
                raising the signal) or `"relaxed"`.
            waitValue: the value every word must reach.

        Returns:
            A token (the last word's value). Pass it to
            [`consume_token`][tridist.language.consume_token] with the pointers of the loads
            that must not start before the wait has ended.

        Raises:
            tridist.WaitTimeoutError: in the emulator, when the bound expires (on GPUs with
                `TRIDIST_DEBUG=1` the kernel prints the same facts and traps).
            tridist.PeerFailedError: in the emulator, when a peer died or failed meanwhile.
        """

    def consume_token(x, token) -> tl.tensor:
        """`x` (a pointer or a block of pointers) made to depend on `token`, so that the
        compiler keeps the loads computed from the result after the wait that gave the token.
        Without it Triton may hoist a load whose address does not depend on the wait above the
        spin loop. Alignment hints of `x` are kept, so the loads stay vectorised."""

    def ld(ptr: tl.tensor, scope: tl.constexpr = "gpu", semantic: tl.constexpr = "acquire") -> tl.tensor:
        """Load one 32- or 64-bit word with a memory order (`ld.global.<semantic>.<scope>`).

        Args:
            ptr: a pointer to a 32- or 64-bit element.
            scope: `"gpu"` or `"sys"`.
            semantic: `"relaxed"` or `"acquire"`.
        """

    def st(ptr: tl.tensor, value, scope: tl.constexpr = "gpu", semantic: tl.constexpr = "release") -> None:
        """Store one 32- or 64-bit word with a memory order (`st.global.<semantic>.<scope>`).

        Args:
            ptr: a pointer to a 32- or 64-bit element.
            value: the value, cast to the element type.
            scope: `"gpu"` or `"sys"`.
            semantic: `"relaxed"` or `"release"`.
        """

    def atomic_add(ptr: tl.tensor, value, scope: tl.constexpr = "gpu",
                   semantic: tl.constexpr = "acq_rel") -> tl.tensor:
        """Add `value` to the word at `ptr` atomically (atomic across the ranks' processes in the
        emulator too); returns the old value. `semantic`: any of the four."""

    def atomic_cas(ptr: tl.tensor, compare, value, scope: tl.constexpr = "gpu",
                   semantic: tl.constexpr = "acq_rel") -> tl.tensor:
        """Store `value` at `ptr` if the word there equals `compare`, atomically; returns the old
        value."""

    def atomic_xchg(ptr: tl.tensor, value, scope: tl.constexpr = "gpu",
                    semantic: tl.constexpr = "acq_rel") -> tl.tensor:
        """Store `value` at `ptr` atomically; returns the old value."""

    def fence(scope: tl.constexpr = "sys") -> None:
        """An acquire-release fence at `scope` (`fence.acq_rel.<scope>`): this thread's accesses
        before it are ordered before those after it, as seen from `scope`."""

    def fence_async_proxy() -> None:
        """Order this thread's earlier memory accesses (a wait's acquire) before the
        tensor-memory-accelerator (TMA) loads that follow: TMA runs in the "async proxy", which
        a generic acquire does not order. Call it between a `wait` and TMA loads of the data the
        signal guards. Nothing to do in the emulator."""

    def global_time_ns() -> tl.tensor:
        """Nanoseconds on the GPU's global timer (PTX's `%globaltimer`), an int64 scalar, for
        timing inside a kernel; the host's clock in the emulator."""

    def dot(a: tl.tensor, b: tl.tensor, acc: tl.tensor) -> tl.tensor:
        """`acc + a @ b`, as `tl.dot(a, b, acc)`. In the emulator the product is taken in fp32
        (Triton 3.6's interpreter multiplies bf16 blocks as raw 16-bit integers), which is
        exact for bf16 and fp16 operands; use it instead of `tl.dot` in kernels that must run
        in both."""

    def check(condition, message: tl.constexpr, observed, limit) -> None:
        """Fail the kernel where `condition` (a scalar) is false: what a kernel cannot do right
        with the input it got (more rows than a buffer holds), found on the device, where the host
        could only find it by synchronising. In the emulator it raises `tridist.DeviceCheckError`
        naming the rank, the kernel, `message` (a constexpr string), `observed` and `limit`; on GPUs
        with `TRIDIST_DEBUG=1` it prints the same and traps (the host names the kernel at its next
        synchronisation); on GPUs without debug it compiles to nothing, and the kernel must make
        its own safe choice (drop what does not fit)."""

    def grid_barrier(counter_ptr: tl.tensor) -> tl.tensor:
        """Wait until every program of this launch has reached the barrier; their writes before it
        are visible to all of them after it. Only in a co-resident launch (`kernel[grid](...,
        coresident=True)`), where every program holds an SM until it ends: otherwise a waiting
        program could keep out one that has yet to start (the emulator refuses it). `counter_ptr`
        is an int64 word, zero when first used, that only this barrier touches, in launches of one
        grid size; it counts arrivals and is never reset, so repeated barriers and back-to-back
        launches need nothing from the host. Bounded under TRIDIST_DEBUG=1 and in the emulator, as
        every wait. Returns a token for `consume_token`."""

    def launch_dependents() -> None:
        """Let the next kernel on this stream start, if it was launched with `launch_pdl=True`
        (programmatic dependent launch, sm_90): it starts once every program of this kernel has
        called this or ended, and so takes SMs as this kernel's last programs free them, instead
        of launching only after this kernel has ended. A hint: it orders no memory. Does nothing
        in the emulator, which runs one launch at a time."""

    def wait_prior_kernel() -> None:
        """Wait until the kernel before this one on the stream has ended and its writes are
        visible: the first thing a kernel launched with `launch_pdl=True` does before it reads
        anything that kernel wrote (or writes what it reads). Returns at once without
        `launch_pdl`, and in the emulator."""
