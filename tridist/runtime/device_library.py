"""NVSHMEM's device library cut down to the functions tridist's kernels call.

Triton links `libnvshmem_device.bc` into every kernel that calls an NVSHMEM function, and nearly
every tridist kernel does (`dl.rank()`, `dl.num_ranks()` and `dl.symm_at` are NVSHMEM calls). The
file holds NVSHMEM's whole device API, 31 MB of bitcode, and Triton parses all of it for each kernel
it compiles, which takes most of the compile (benchmarks/NOTES.md has the figures).

`for_kernels` gives Triton instead a copy that holds only `FUNCTIONS` (the NVSHMEM functions
`tridist.language` emits, which checks that it emits no other) and what they call: about 90
functions, and a compile about a tenth as long, of the same code (tests/test_gpu_compile.py
compares the PTX).

The cut is made by the LLVM that will read it, Triton's own: its linker, asked to link the whole
library into an empty module that declares `FUNCTIONS`, brings exactly those and what they call
(with the global variables they use, NVSHMEM's device state among them), as it does when it links
the library into a kernel. The module is written as LLVM's text, which the same LLVM reads back.
The linker makes every function it brought internal (Triton's backends take an external function
for a kernel); `FUNCTIONS` are made external again in the text, so that a kernel's declarations
find them. Reader and writer being one LLVM, the cut works with whatever Triton is installed and
needs no other package. (An LLVM newer than Triton's writes what Triton's refuses: llvmlite 0.50's
LLVM 22.1 against Triton 3.6's 22.0 pre-release, in bitcode and in text alike.)

The result is kept in Triton's cache folder under a name that hashes the library, `FUNCTIONS` and
Triton's version, after Triton's linker has read it back. Where any of that fails, the whole library
is used, as before: the same kernels, slower to compile, with one warning for the job (said by its
first rank). TRIDIST_DEVICE_LIBRARY=whole asks for the whole library and skips the cut.
"""
import functools
import hashlib
import os
import re
import tempfile
import warnings

from . import config
from .log import first_rank

# The NVSHMEM device functions tridist.language calls (language/_gpu.py refuses any other).
_PLAIN = ("my_pe", "n_pes", "ptr", "quiet", "fence", "putmem", "putmem_nbi", "getmem", "getmem_nbi",
          "putmem_signal", "putmem_signal_nbi")
_EXTENDED = ("barrier_all_block", "sync_all_block", "signal_op", "putmem_block", "putmem_warp",
             "putmem_nbi_block", "putmem_nbi_warp", "getmem_block", "getmem_warp", "getmem_nbi_block",
             "getmem_nbi_warp", "putmem_signal_block", "putmem_signal_nbi_block")
# NVSHMEM's type names: its RMA functions take fixed-width names, its atomics the C names.
RMA_TYPES = {"int32": "int32", "int64": "int64", "uint32": "uint32", "uint64": "uint64", "fp32": "float",
             "fp64": "double"}
ATOMIC_TYPES = {"int32": "int", "int64": "long", "uint32": "uint", "uint64": "ulong"}
ATOMIC_OPS = ("fetch_add", "compare_swap", "inc", "set")
FUNCTIONS = frozenset(
    [f"nvshmem_{name}" for name in _PLAIN] + [f"nvshmemx_{name}" for name in _EXTENDED]
    + [f"nvshmem_{t}_{op}" for t in RMA_TYPES.values() for op in ("p", "g")]
    + [f"nvshmem_{t}_atomic_{op}" for t in ATOMIC_TYPES.values() for op in ATOMIC_OPS])


@functools.lru_cache(maxsize=None)
def for_kernels(whole: str) -> str:
    """The device library Triton should link: the cut copy of `whole`, or `whole` itself (see the
    module docstring for when)."""
    if config.device_library() == "whole":
        return whole
    try:
        return _cut_copy(whole)
    except Exception as error:  # noqa: BLE001 - any failure leaves the whole library, which works
        if first_rank():  # once per job: for_kernels is cached, and the other ranks fail the same way
            warnings.warn(f"tridist: cutting NVSHMEM's device library failed ({type(error).__name__}: {error}), so "
                          "Triton links all of it into each kernel: the same kernels, each about ten times slower "
                          "to compile. TRIDIST_DEVICE_LIBRARY=whole asks for that and silences this.", stacklevel=2)
        return whole


def _cut_copy(whole: str) -> str:
    import triton
    from triton import knobs

    with open(whole, "rb") as f:
        digest = hashlib.sha256(f.read())
    digest.update("\n".join(sorted(FUNCTIONS)).encode())
    digest.update(f"triton {triton.__version__}".encode())  # the LLVM that writes the cut and reads it
    folder = knobs.cache.dir
    path = os.path.join(folder, f"libnvshmem_device-cut-{digest.hexdigest()[:24]}.ll")
    if os.path.exists(path):
        return path
    os.makedirs(folder, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=folder, suffix=".ll.tmp")
    try:
        with os.fdopen(descriptor, "w") as f:
            f.write(cut(whole, FUNCTIONS))
        missing = FUNCTIONS - defined_functions(temporary, FUNCTIONS)
        if missing:
            raise RuntimeError(f"the cut library lacks {', '.join(sorted(missing))}")
        os.replace(temporary, path)  # ranks that cut at once write the same text
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
    return path


def cut(library: str, keep) -> str:
    """The LLVM IR, as text, of the functions named in `keep` and of what they call, from the bitcode
    or text file `library`: linked by Triton's LLVM into a module that declares them, then made
    external (the linker makes what it brings internal)."""
    module = _linked(library, keep)
    names = "|".join(re.escape(name) for name in sorted(keep))
    return re.sub(rf"^define internal (.*?@(?:{names})\()", r"define \1", str(module), flags=re.M)


def defined_functions(library: str, names) -> set[str]:
    """Those of `names` that Triton's LLVM finds defined in `library` when a kernel declares them."""
    return {fn.name for fn in _linked(library, names).get_functions() if not fn.is_declaration()} & set(names)


def _linked(library: str, names):
    """A module of Triton's LLVM declaring `names`, with `library` linked into it (as Triton links a
    device library into a kernel: only what the module needs)."""
    from triton._C.libtriton import ir, llvm

    with tempfile.TemporaryDirectory() as folder:
        declarations = os.path.join(folder, "declarations.mlir")
        with open(declarations, "w") as f:
            # The signatures need not match: the linker replaces a declaration by the definition.
            f.write("module {\n" + "".join(f"  llvm.func @{name}()\n" for name in sorted(names)) + "}\n")
        context = ir.context()
        ir.load_dialects(context)
        module = llvm.to_module(ir.parse_mlir_module(declarations, context), llvm.context())
    llvm.link_extern_libs(module, [library])
    return module
