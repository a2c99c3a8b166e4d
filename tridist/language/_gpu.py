"""GPU lowering of the device API: inline PTX for memory order, NVSHMEM's device library for the rest.

Groups: a function that takes `group` (a `tridist.Group` passed as a kernel argument, a pointer to
its int32 table `[rank, size, pe_0, ..., pe_{size-1}]`, `runtime/groups.py`) reads its rank and
size from the table and translates a group rank `peer` into the PE `pe_peer` with one load. Without
`group` (None, a constexpr) the test is decided when the kernel compiles, and nothing is added: a
kernel written for the world compiles as it did before groups came.

NVSHMEM functions are declared with `extern_elementwise` and resolved when Triton links
`libnvshmem_device.bc` (passed by `tridist.jit`). A Triton program runs every scalar statement on
all of its threads, so calls NVSHMEM means for one thread (or one warp) sit under a thread-id test.

With TRIDIST_DEBUG=1 every wait of ours is bounded by TRIDIST_WAIT_TIMEOUT: on expiry the first
thread of the waiting program writes the signal's address, the expected and observed values into
the report page (`runtime/wait_report.py`) and traps, so the launch fails instead of spinning
forever, and the host prints one line naming the rank, kernel, program, allocation and values.
NVSHMEM's barrier is the exception (see `barrier_all`). Both settings are read once, when tridist
is imported, and compiled into the kernels as constants: set them before the import.
"""
import triton
import triton.language as tl
from triton.language import core

from ..runtime import config, wait_report
from ..runtime.device_library import ATOMIC_TYPES, FUNCTIONS, RMA_TYPES
from ._constants import CMP_EQ, CMP_GE, CMP_GT, CMP_LE, CMP_LT, CMP_NE, SIGNAL_ADD, SIGNAL_SET

DEBUG = tl.constexpr(config.debug())
TIMEOUT_NS = tl.constexpr(int(config.wait_timeout_s() * 1e9))
if config.debug():
    wait_report.map_page()  # now, before CUDA reserves its address ranges
REPORT_ADDRESS = tl.constexpr(wait_report.REPORT_ADDRESS)
REPORT_SLOTS = tl.constexpr(wait_report.SLOTS)
REPORT_WORDS = tl.constexpr(wait_report.WORDS)
REPORT_MAGIC = tl.constexpr(wait_report.MAGIC)
KIND_SIGNAL = tl.constexpr(wait_report.KIND_SIGNAL)
KIND_PACKETS = tl.constexpr(wait_report.KIND_PACKETS)


# ---- NVSHMEM declarations --------------------------------------------------------------------------
def _extern(symbol, args, arg_types, result, _semantic):
    if symbol not in FUNCTIONS:  # what the cut device library keeps (runtime/device_library.py)
        raise ValueError(f"{symbol} is not in tridist.runtime.device_library.FUNCTIONS: add it there")
    return core.extern_elementwise("", "", list(args),
                                   {tuple(core.dtype(t) for t in arg_types): (symbol, core.dtype(result))},
                                   is_pure=False, _semantic=_semantic)


@core.extern
def _my_pe(_semantic=None):
    return _extern("nvshmem_my_pe", [], (), "int32", _semantic)


@core.extern
def _n_pes(_semantic=None):
    return _extern("nvshmem_n_pes", [], (), "int32", _semantic)


@core.extern
def _ptr(address, pe, _semantic=None):
    return _extern("nvshmem_ptr", [address, pe], ("int64", "int32"), "int64", _semantic)


@core.extern
def _copy(symbol: tl.constexpr, dest, source, nbytes, pe, _semantic=None):
    return _extern(core._unwrap_if_constexpr(symbol), [dest, source, nbytes, pe],
                   ("int64", "int64", "int64", "int32"), "int32", _semantic)


@core.extern
def _copy_signal(symbol: tl.constexpr, dest, source, nbytes, sig_addr, signal, sig_op, pe, _semantic=None):
    return _extern(core._unwrap_if_constexpr(symbol), [dest, source, nbytes, sig_addr, signal, sig_op, pe],
                   ("int64", "int64", "int64", "int64", "uint64", "int32", "int32"), "int32", _semantic)


@core.extern
def _signal_op(sig_addr, signal, sig_op, pe, _semantic=None):
    return _extern("nvshmemx_signal_op", [sig_addr, signal, sig_op, pe], ("int64", "uint64", "int32", "int32"),
                   "int32", _semantic)


@core.extern
def _no_arguments(symbol: tl.constexpr, _semantic=None):
    return _extern(core._unwrap_if_constexpr(symbol), [], (), "int32", _semantic)


def _typed(name, pointer):
    element = pointer.dtype.element_ty if pointer.dtype.is_ptr() else pointer.type.scalar.element_ty
    types = ATOMIC_TYPES if name.startswith("atomic_") else RMA_TYPES
    if element.name not in types:
        raise TypeError(f"shmem.{name} takes pointers to {', '.join(types)}, not {element.name}")
    return f"nvshmem_{types[element.name]}_{name}", element


@core.extern
def _typed_put(dest, value, pe, _semantic=None):
    symbol, element = _typed("p", dest)
    return _extern(symbol, [dest.to(core.int64, _semantic=_semantic), value, pe],
                   ("int64", element.name, "int32"), "int32", _semantic)


@core.extern
def _typed_get(source, pe, _semantic=None):
    symbol, element = _typed("g", source)
    return _extern(symbol, [source.to(core.int64, _semantic=_semantic), pe], ("int64", "int32"), element.name,
                   _semantic)


@core.extern
def _typed_atomic(op: tl.constexpr, dest, values, pe, _semantic=None):
    symbol, element = _typed("atomic_" + core._unwrap_if_constexpr(op), dest)
    values = list(values)
    return _extern(symbol, [dest.to(core.int64, _semantic=_semantic), *values, pe],
                   ("int64", *[element.name] * len(values), "int32"), element.name, _semantic)


# ---- threads -------------------------------------------------------------------------------------
@triton.jit
def _thread_index():
    return tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _sync_threads():
    # Through inline PTX rather than tl.debug_barrier: Triton 3.6's software pipeliner gives up on a
    # loop that contains a gpu.barrier op, so a barrier in the epilogue of a persistent GEMM's tile
    # loop (a flag raised after a tile's stores) would leave its loads unpipelined. As a
    # side-effecting asm it keeps its place between the stores and the release.
    # The unaligned `barrier.sync`, not `bar.sync` (= barrier.sync.aligned): LLVM does not know that
    # inline asm must not be duplicated onto divergent paths, and it unswitches a loop such as
    # `for peer: _sync_threads(); if thread 0: signal` on the thread test, leaving thread 0 and the
    # others at different copies of the barrier. An aligned barrier reached that way hangs (it did:
    # benchmarks/NOTES.md, "Moved from the code's docstrings (issue 41)"); an unaligned one counts
    # each thread's arrivals wherever they happen.
    tl.inline_asm_elementwise("barrier.sync 0; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def global_time_ns():
    """Nanoseconds on the GPU's global timer (PTX's %globaltimer), for timing inside a kernel."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _report_and_trap(kind: tl.constexpr, address, cmp: tl.constexpr, expected, observed, elapsed_ns, stale):
    """An expired wait: the program's first thread writes its slot of the report page (the fields
    of `wait_report.FIELDS`, the magic word last, each store at system scope: the page is host
    memory) and traps, which ends the launch; the other threads come back here until it has."""
    if _thread_index() == 0:
        program = tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))
        slot = tl.full((), REPORT_ADDRESS, tl.int64) + (program % REPORT_SLOTS).to(tl.int64) * (REPORT_WORDS * 8)
        words = slot.to(tl.pointer_type(tl.int64), bitcast=True)
        st(words + 1, kind, "sys", "relaxed")
        st(words + 2, program, "sys", "relaxed")
        st(words + 3, address, "sys", "relaxed")
        st(words + 4, cmp, "sys", "relaxed")
        st(words + 5, expected, "sys", "relaxed")
        st(words + 6, observed, "sys", "relaxed")
        st(words + 7, elapsed_ns, "sys", "relaxed")
        st(words + 8, stale, "sys", "relaxed")
        st(words, REPORT_MAGIC, "sys", "release")
        fence("sys")
        _trap()


@triton.jit
def _trap():
    # Ends the kernel with an error the host sees at its next synchronisation (tl.device_assert
    # would be compiled out unless Triton's own debug mode is on).
    tl.inline_asm_elementwise("trap; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


# ---- identity and addressing ---------------------------------------------------------------------
@triton.jit
def rank(group=None):
    if group is None:
        return _my_pe()
    else:
        return tl.load(group)


@triton.jit
def num_ranks(group=None):
    if group is None:
        return _n_pes()
    else:
        return tl.load(group + 1)


@triton.jit
def _pe(peer, group):
    """The PE of `peer`: a rank of `group`'s, or of the world's (group None, decided at compile time)."""
    if group is None:
        return peer
    else:
        return tl.load(group + 2 + peer)


@triton.jit
def symm_at(ptr, peer, group=None, aligned: tl.constexpr = True):
    """`peer`'s address of the symmetric `ptr` (on this node; null on another). With `aligned`, as
    an offset from `ptr` hinted a multiple of 16 bytes (every rank's heap starts at least that
    aligned, so a peer's copy is as aligned as this rank's), so that Triton can move data through
    it in 16-byte accesses; unhinted, the pointer NVSHMEM returns tells Triton nothing, and a bf16
    kernel stores 2 bytes at a time."""
    remote = _ptr(ptr.to(tl.int64), _pe(peer, group))
    if aligned:
        nbytes: tl.constexpr = ptr.dtype.element_ty.primitive_bitwidth // 8
        return ptr + tl.multiple_of((remote - ptr.to(tl.int64)) // nbytes, max(1, 16 // nbytes))
    return remote.to(ptr.dtype, bitcast=True)


# ---- memory order --------------------------------------------------------------------------------
@triton.jit
def _check_order(what: tl.constexpr, kind: tl.constexpr, scope: tl.constexpr, semantic: tl.constexpr):
    # PTX takes scope and semantic as text, so a typo would surface as a ptxas error far from the
    # call. The sets are `_constants.SCOPES` and `SEMANTICS`, which the emulator checks.
    tl.static_assert(scope == "gpu" or scope == "sys", what + ": scope is 'gpu' or 'sys'")
    if kind == "load":
        tl.static_assert(semantic == "relaxed" or semantic == "acquire",
                         what + ": semantic is 'relaxed' or 'acquire' (a load cannot release)")
    elif kind == "store":
        tl.static_assert(semantic == "relaxed" or semantic == "release",
                         what + ": semantic is 'relaxed' or 'release' (a store cannot acquire)")
    else:
        tl.static_assert(semantic == "relaxed" or semantic == "acquire" or semantic == "release"
                         or semantic == "acq_rel", what + ": semantic is 'relaxed', 'acquire', 'release' or 'acq_rel'")


@triton.jit
def ld(ptr, scope: tl.constexpr = tl.constexpr("gpu"), semantic: tl.constexpr = tl.constexpr("acquire")):
    _check_order("dl.ld", "load", scope, semantic)
    if ptr.dtype.element_ty.primitive_bitwidth == 64:
        return tl.inline_asm_elementwise("ld.global." + semantic + "." + scope + ".b64 $0, [$1];", "=l,l", [ptr],
                                         dtype=ptr.dtype.element_ty, is_pure=False, pack=1)
    else:
        return tl.inline_asm_elementwise("ld.global." + semantic + "." + scope + ".b32 $0, [$1];", "=r,l", [ptr],
                                         dtype=ptr.dtype.element_ty, is_pure=False, pack=1)


@triton.jit
def st(ptr, value, scope: tl.constexpr = tl.constexpr("gpu"), semantic: tl.constexpr = tl.constexpr("release")):
    _check_order("dl.st", "store", scope, semantic)
    if ptr.dtype.element_ty.primitive_bitwidth == 64:
        tl.inline_asm_elementwise("st.global." + semantic + "." + scope + ".b64 [$1], $2; mov.u32 $0, 0;",
                                  "=r,l,l", [ptr, tl.cast(value, ptr.dtype.element_ty)], dtype=tl.int32, is_pure=False,
                                  pack=1)
    else:
        tl.inline_asm_elementwise("st.global." + semantic + "." + scope + ".b32 [$1], $2; mov.u32 $0, 0;",
                                  "=r,l,r", [ptr, tl.cast(value, ptr.dtype.element_ty)], dtype=tl.int32, is_pure=False,
                                  pack=1)


@triton.jit
def atomic_add(ptr, value, scope: tl.constexpr = tl.constexpr("gpu"), semantic: tl.constexpr = tl.constexpr("acq_rel")):
    _check_order("dl.atomic_add", "atomic", scope, semantic)
    return tl.atomic_add(ptr, value, sem=semantic, scope=scope)


@triton.jit
def atomic_cas(ptr, compare, value, scope: tl.constexpr = tl.constexpr("gpu"), semantic: tl.constexpr = tl.constexpr("acq_rel")):
    _check_order("dl.atomic_cas", "atomic", scope, semantic)
    element = ptr.dtype.element_ty
    return tl.atomic_cas(ptr, tl.cast(compare, element), tl.cast(value, element), sem=semantic, scope=scope)


@triton.jit
def atomic_xchg(ptr, value, scope: tl.constexpr = tl.constexpr("gpu"), semantic: tl.constexpr = tl.constexpr("acq_rel")):
    _check_order("dl.atomic_xchg", "atomic", scope, semantic)
    return tl.atomic_xchg(ptr, value, sem=semantic, scope=scope)


@triton.jit
def fence(scope: tl.constexpr = tl.constexpr("sys")):
    _check_order("dl.fence", "atomic", scope, "acq_rel")
    tl.inline_asm_elementwise("fence.acq_rel." + scope + "; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def fence_async_proxy():
    tl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                              pack=1)


# ---- compute -------------------------------------------------------------------------------------
@triton.jit
def dot(a, b, acc):
    return tl.dot(a, b, acc)


# ---- signals -------------------------------------------------------------------------------------
@triton.jit
def _compare(observed, cmp: tl.constexpr, value):
    if cmp == CMP_EQ:
        return observed == value
    elif cmp == CMP_NE:
        return observed != value
    elif cmp == CMP_GT:
        return observed > value
    elif cmp == CMP_GE:
        return observed >= value
    elif cmp == CMP_LT:
        return observed < value
    elif cmp == CMP_LE:
        return observed <= value
    else:
        tl.static_assert(False, "unknown comparison: use one of dl.shmem.CMP_*")


@triton.jit
def _spin(ptr, cmp: tl.constexpr, value, scope: tl.constexpr, semantic: tl.constexpr):
    """Spin on one word until it compares true; bounded and reporting under TRIDIST_DEBUG."""
    observed = ld(ptr, scope, semantic)
    if DEBUG:
        start = global_time_ns()
        while not _compare(observed, cmp, value):
            elapsed = global_time_ns() - start
            if elapsed > TIMEOUT_NS:
                _report_and_trap(KIND_SIGNAL, ptr.to(tl.int64), cmp, value, observed, elapsed, 0)
            observed = ld(ptr, scope, semantic)
    else:
        while not _compare(observed, cmp, value):
            observed = ld(ptr, scope, semantic)
    return observed


@triton.jit
def wait(ptr, num, scope: tl.constexpr = tl.constexpr("gpu"), semantic: tl.constexpr = tl.constexpr("acquire"), waitValue=1):
    _check_order("dl.wait", "load", scope, semantic)
    token = ld(ptr, scope, semantic)
    for i in range(num):
        token = _spin(ptr + i, CMP_EQ, waitValue, scope, semantic)
    return token


@triton.jit
def consume_token(x, token):
    # A zero that the compiler cannot know before the wait has returned: anything computed from
    # `x + zero` (the addresses of later loads) stays after the wait. Declaring it a multiple of
    # 16 keeps the alignment of pointer blocks, so their loads stay vectorised.
    zero = tl.inline_asm_elementwise("mov.b32 $0, 0; // $1", "=r,l", [tl.cast(token, tl.int64)], dtype=tl.int32,
                                     is_pure=True, pack=1)
    return x + tl.multiple_of(zero, 16)


@triton.jit
def notify(ptr, peer, signal=1, sig_op: tl.constexpr = tl.constexpr("set"), comm_scope: tl.constexpr = tl.constexpr("gpu"),
           group=None):
    tl.static_assert(comm_scope == "gpu" or comm_scope == "intra_node" or comm_scope == "inter_node",
                     "dl.notify: comm_scope is 'gpu', 'intra_node' or 'inter_node'")
    tl.static_assert(sig_op == "set" or sig_op == "add",
                     "dl.notify: sig_op is 'set' or 'add' (dl.shmem.SIGNAL_* are for dl.shmem's functions)")
    # Every thread's earlier writes must be visible before the signal: the barrier makes them
    # visible to the signalling thread, and its release (or NVSHMEM's fence) carries them along.
    pe = _pe(peer, group)
    _sync_threads()
    if comm_scope == "inter_node":
        if _thread_index() == 0:
            if sig_op == "add":
                _signal_op(ptr.to(tl.int64), tl.cast(signal, tl.uint64), SIGNAL_ADD, pe)
            else:
                _signal_op(ptr.to(tl.int64), tl.cast(signal, tl.uint64), SIGNAL_SET, pe)
    else:
        remote = symm_at(ptr, pe)
        if sig_op == "add":
            tl.atomic_add(remote, signal, sem="release", scope="sys")
        else:
            tl.atomic_xchg(remote, signal, sem="release", scope="sys")


# ---- checks -------------------------------------------------------------------------------------
@triton.jit
def check(condition, message: tl.constexpr, observed, limit):
    if DEBUG:
        if not condition:
            if _thread_index() == 0:  # one thread's lines, not one per thread; the others go on until its trap
                tl.device_print(message, _my_pe(), observed, limit)
                _trap()


# ---- programs of one launch ----------------------------------------------------------------------
@triton.jit
def grid_barrier(counter_ptr):
    """Wait until every program of this launch has reached this barrier; their writes before it are
    visible to all of them after it. Only in a co-resident launch (`kernel[grid](...,
    coresident=True)`): a program waiting here holds its SM. `counter_ptr`: an int64 word, zero when
    first used, that only this barrier touches, in launches of one grid size. Returns the count
    observed, a token for `consume_token`.

    The word counts arrivals and only grows: barrier g (counting every barrier the word has seen,
    across launches, from 1) is passed once it reaches g x programs. No program arrives at barrier
    g+1 before all have passed g, so a program that arrives to find `arrived` arrivals before it is
    at barrier arrived // programs + 1. Nothing is reset, so repeated barriers and back-to-back
    launches need nothing from the host."""
    programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    _sync_threads()  # every thread's writes so far, ordered before the release below
    arrived = tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")  # a scalar: one thread adds
    return _spin(counter_ptr, CMP_GE, (arrived // programs + 1) * programs, "gpu", "acquire")


# ---- kernels of one stream -----------------------------------------------------------------------
# Programmatic dependent launch (sm_90): a kernel launched with `launch_pdl=True` may start while the
# kernel before it on the stream still runs, once every program of that one has called
# `launch_dependents` (or ended); `wait_prior_kernel` holds it until that kernel has ended and its
# writes are visible. Without `launch_pdl` both instructions do nothing.
@triton.jit
def launch_dependents():
    tl.inline_asm_elementwise("griddepcontrol.launch_dependents; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def wait_prior_kernel():
    tl.inline_asm_elementwise("griddepcontrol.wait; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                              pack=1)


# ---- OpenSHMEM-style API ---------------------------------------------------------------------------
# On GPUs NVSHMEM's own answers are ours; nvshmem_ptr already returns null for unreachable peers.
my_pe = rank
n_pes = num_ranks
ptr = symm_at


# Which threads of the program call an NVSHMEM function (`threads` of `_issue_copy`): the plain
# forms are per-thread calls, made by thread 0 alone; NVSHMEM's `_warp` forms are collective over a
# warp, so all 32 threads of the first warp call them; its `_block` forms are collective over the
# block, so every thread of the program calls them.
_ONE_THREAD = tl.constexpr(1)
_FIRST_WARP = tl.constexpr(32)
_WHOLE_BLOCK = tl.constexpr(0)


@triton.jit
def _issue_copy(symbol: tl.constexpr, threads: tl.constexpr, dest, source, nbytes, pe):
    if threads == _ONE_THREAD:
        if _thread_index() == 0:
            _copy(symbol, dest.to(tl.int64), source.to(tl.int64), tl.cast(nbytes, tl.int64), pe)
    elif threads == _FIRST_WARP:
        if _thread_index() < 32:
            _copy(symbol, dest.to(tl.int64), source.to(tl.int64), tl.cast(nbytes, tl.int64), pe)
    else:  # _WHOLE_BLOCK
        _copy(symbol, dest.to(tl.int64), source.to(tl.int64), tl.cast(nbytes, tl.int64), pe)


@triton.jit
def putmem(dest, source, nbytes, pe, group=None):
    _issue_copy("nvshmem_putmem", _ONE_THREAD, dest, source, nbytes, _pe(pe, group))


@triton.jit
def putmem_nbi(dest, source, nbytes, pe, group=None):
    _issue_copy("nvshmem_putmem_nbi", _ONE_THREAD, dest, source, nbytes, _pe(pe, group))


@triton.jit
def putmem_warp(dest, source, nbytes, pe, group=None):
    _issue_copy("nvshmemx_putmem_warp", _FIRST_WARP, dest, source, nbytes, _pe(pe, group))


@triton.jit
def putmem_nbi_warp(dest, source, nbytes, pe, group=None):
    _issue_copy("nvshmemx_putmem_nbi_warp", _FIRST_WARP, dest, source, nbytes, _pe(pe, group))


@triton.jit
def putmem_block(dest, source, nbytes, pe, group=None):
    _issue_copy("nvshmemx_putmem_block", _WHOLE_BLOCK, dest, source, nbytes, _pe(pe, group))


@triton.jit
def putmem_nbi_block(dest, source, nbytes, pe, group=None):
    _issue_copy("nvshmemx_putmem_nbi_block", _WHOLE_BLOCK, dest, source, nbytes, _pe(pe, group))


@triton.jit
def getmem(dest, source, nbytes, pe, group=None):
    _issue_copy("nvshmem_getmem", _ONE_THREAD, dest, source, nbytes, _pe(pe, group))


@triton.jit
def getmem_nbi(dest, source, nbytes, pe, group=None):
    _issue_copy("nvshmem_getmem_nbi", _ONE_THREAD, dest, source, nbytes, _pe(pe, group))


@triton.jit
def getmem_warp(dest, source, nbytes, pe, group=None):
    _issue_copy("nvshmemx_getmem_warp", _FIRST_WARP, dest, source, nbytes, _pe(pe, group))


@triton.jit
def getmem_nbi_warp(dest, source, nbytes, pe, group=None):
    _issue_copy("nvshmemx_getmem_nbi_warp", _FIRST_WARP, dest, source, nbytes, _pe(pe, group))


@triton.jit
def getmem_block(dest, source, nbytes, pe, group=None):
    _issue_copy("nvshmemx_getmem_block", _WHOLE_BLOCK, dest, source, nbytes, _pe(pe, group))


@triton.jit
def getmem_nbi_block(dest, source, nbytes, pe, group=None):
    _issue_copy("nvshmemx_getmem_nbi_block", _WHOLE_BLOCK, dest, source, nbytes, _pe(pe, group))


@triton.jit
def _issue_copy_signal(symbol: tl.constexpr, threads: tl.constexpr, dest, source, nbytes, sig_addr, signal, sig_op,
                       pe):
    if threads == _ONE_THREAD:
        if _thread_index() == 0:
            _copy_signal(symbol, dest.to(tl.int64), source.to(tl.int64), tl.cast(nbytes, tl.int64), sig_addr.to(tl.int64),
                         tl.cast(signal, tl.uint64), sig_op, pe)
    else:  # _WHOLE_BLOCK
        _copy_signal(symbol, dest.to(tl.int64), source.to(tl.int64), tl.cast(nbytes, tl.int64), sig_addr.to(tl.int64),
                     tl.cast(signal, tl.uint64), sig_op, pe)


@triton.jit
def putmem_signal(dest, source, nbytes, sig_addr, signal, sig_op, pe, group=None):
    _issue_copy_signal("nvshmem_putmem_signal", _ONE_THREAD, dest, source, nbytes, sig_addr, signal, sig_op,
                       _pe(pe, group))


@triton.jit
def putmem_signal_nbi(dest, source, nbytes, sig_addr, signal, sig_op, pe, group=None):
    _issue_copy_signal("nvshmem_putmem_signal_nbi", _ONE_THREAD, dest, source, nbytes, sig_addr, signal, sig_op,
                       _pe(pe, group))


@triton.jit
def putmem_signal_block(dest, source, nbytes, sig_addr, signal, sig_op, pe, group=None):
    _issue_copy_signal("nvshmemx_putmem_signal_block", _WHOLE_BLOCK, dest, source, nbytes, sig_addr, signal, sig_op,
                       _pe(pe, group))


@triton.jit
def putmem_signal_nbi_block(dest, source, nbytes, sig_addr, signal, sig_op, pe, group=None):
    _issue_copy_signal("nvshmemx_putmem_signal_nbi_block", _WHOLE_BLOCK, dest, source, nbytes, sig_addr, signal,
                       sig_op, _pe(pe, group))


@triton.jit
def signal_op(sig_addr, signal, sig_op, pe, group=None):
    pe = _pe(pe, group)
    if _thread_index() == 0:
        _signal_op(sig_addr.to(tl.int64), tl.cast(signal, tl.uint64), sig_op, pe)


@triton.jit
def signal_wait_until(sig_addr, cmp: tl.constexpr, cmp_value):
    tl.static_assert(cmp == CMP_EQ or cmp == CMP_NE or cmp == CMP_GT or cmp == CMP_GE or cmp == CMP_LT
                     or cmp == CMP_LE, "shmem.signal_wait_until: cmp is one of dl.shmem.CMP_*")
    # Our acquire spin rather than NVSHMEM's wait: `ld.acquire.sys` orders the caller's later loads
    # after the word and keeps them off L1 lines filled before it, which NVSHMEM's documentation does
    # not promise of its loop (with it, reads after the wait saw partial rows: benchmarks/NOTES.md,
    # "Moved from the code's docstrings (issue 41)").
    return _spin(sig_addr, cmp, cmp_value, "sys", "acquire")


@triton.jit
def quiet():
    _no_arguments("nvshmem_quiet")


@triton.jit
def shmem_fence():
    _no_arguments("nvshmem_fence")


@triton.jit
def barrier_all():
    """NVSHMEM's barrier, unbounded even with TRIDIST_DEBUG=1: a bounded one would spin on
    symmetric words of its own (as the emulator's does), and a device function that takes no
    arguments has no way to reach a symmetric allocation. A rank stuck here (a peer never calls the
    barrier) spins until the job is stopped, and the host never learns which kernel it was. (The
    host's `barrier_all_on_stream` takes a bounded barrier of its own then: `ops/sync.py`.)"""
    _no_arguments("nvshmemx_barrier_all_block")


@triton.jit
def sync_all():
    """NVSHMEM's sync, unbounded even with TRIDIST_DEBUG=1 (see `barrier_all`)."""
    _no_arguments("nvshmemx_sync_all_block")


@triton.jit
def p(dest, value, pe, group=None):
    pe = _pe(pe, group)
    if _thread_index() == 0:
        _typed_put(dest, tl.cast(value, dest.dtype.element_ty), pe)


@triton.jit
def g(source, pe, group=None):
    return _typed_get(source, _pe(pe, group))


@triton.jit
def _from_first_thread(value):
    # Thread 0 holds the answer. Each element of a 1024-wide block belongs to exactly one thread
    # (programs have at most 1024 threads), so a max over the block, with every thread but thread 0
    # contributing the smallest value of the type, hands thread 0's value to all threads.
    lanes = tl.full([1024], 0, tl.int32) + _thread_index()
    lowest = tl.full([1024], value.dtype.get_int_min_value(), value.dtype)
    return tl.max(tl.where(lanes == 0, value, lowest), axis=0)


@triton.jit
def atomic_fetch_add(dest, value, pe, group=None):
    pe = _pe(pe, group)
    old = tl.zeros((), dest.dtype.element_ty)
    if _thread_index() == 0:
        old = _typed_atomic("fetch_add", dest, (tl.cast(value, dest.dtype.element_ty),), pe)
    return _from_first_thread(old)


@triton.jit
def atomic_compare_swap(dest, cond, value, pe, group=None):
    pe = _pe(pe, group)
    old = tl.zeros((), dest.dtype.element_ty)
    if _thread_index() == 0:
        old = _typed_atomic("compare_swap", dest, (tl.cast(cond, dest.dtype.element_ty), tl.cast(value, dest.dtype.element_ty)), pe)
    return _from_first_thread(old)


@triton.jit
def atomic_inc(dest, pe, group=None):
    pe = _pe(pe, group)
    if _thread_index() == 0:
        _typed_atomic("inc", dest, (), pe)


@triton.jit
def atomic_set(dest, value, pe, group=None):
    pe = _pe(pe, group)
    if _thread_index() == 0:
        _typed_atomic("set", dest, (tl.cast(value, dest.dtype.element_ty),), pe)


# ---- low-latency packets -------------------------------------------------------------------------
@triton.jit
def _is_stale(packets, mask, flag):
    return ((packets >> 32).to(tl.int32) != flag) & mask


@triton.jit
def _stale(packets, mask, flag):
    return tl.sum(_is_stale(packets, mask, flag))


@triton.jit
def _report_stale(ptrs, packets, mask, flag, elapsed_ns):
    # The stale packet of lowest address, and the flag it carries (over every axis of the block).
    addresses = tl.where(_is_stale(packets, mask, flag), ptrs.to(tl.int64), 0x7FFFFFFFFFFFFFFF)
    first = tl.min(addresses, axis=None)
    observed = tl.max(tl.where(addresses == first, (packets >> 32).to(tl.int32), -0x80000000), axis=None)
    _report_and_trap(KIND_PACKETS, first, CMP_EQ, flag, observed, elapsed_ns, _stale(packets, mask, flag))


@triton.jit
def wait_packets(ptrs, mask, flag):
    packets = tl.load(ptrs, mask=mask, other=0, volatile=True)
    if DEBUG:
        start = global_time_ns()
        while _stale(packets, mask, flag) > 0:
            elapsed = global_time_ns() - start
            if elapsed > TIMEOUT_NS:
                _report_stale(ptrs, packets, mask, flag, elapsed)
            packets = tl.load(ptrs, mask=mask, other=0, volatile=True)
    else:
        while _stale(packets, mask, flag) > 0:
            packets = tl.load(ptrs, mask=mask, other=0, volatile=True)
    # The count above covers one copy of each packet, but a block with fewer packets than the program
    # has threads is laid out with each packet in several threads (warps 2 and 3 repeating warps 0 and
    # 1, say), each loading its own copy, and Triton's reduction counts only the first: another copy
    # may still hold the stale word when the loop ends (it did, on GPUs: benchmarks/NOTES.md, "LL
    # packets held by several threads"). So each thread loads again whatever copy it holds stale; the
    # barrier orders that load after the counted copy's, so by coherence it finds that packet or newer.
    _sync_threads()
    stale = _is_stale(packets, mask, flag)
    return tl.where(stale, tl.load(ptrs, mask=stale, other=0, volatile=True), packets)
