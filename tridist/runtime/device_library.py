"""NVSHMEM's device library cut down to the functions tridist's kernels call.

Triton links `libnvshmem_device.bc` into every kernel that calls an NVSHMEM function, and nearly
every tridist kernel does (`dl.rank()`, `dl.num_ranks()` and `dl.symm_at` are NVSHMEM calls). The
file holds NVSHMEM's whole device API, 31 MB of bitcode, and Triton parses all of it for each kernel
it compiles: 6.65 s of a 7.73 s compile on our 2-core CPU machines (2026-11-26, benchmarks/results).
On the H100 machines a kernel took about 3.5 s to compile (2026-11-24), and the GPU test suite
compiles hundreds.

`for_kernels` gives Triton instead a copy that holds only `FUNCTIONS` (the NVSHMEM functions
`tridist.language` emits, which checks that it emits no other) and what they call: about 90
functions, 80 KB, and a compile a tenth as long. Cutting keeps every function body and every global
variable (NVSHMEM's host side finds its device state by name in each module), so a kernel links
the same code: tests/test_gpu_compile.py compares the PTX.

The cut needs an LLVM that reads NVSHMEM's bitcode (clang 18's) and writes bitcode that Triton's
LLVM reads: llvmlite (`pip install llvmlite`; the `gpu` and `test` extras bring it). The result is
kept in Triton's cache folder under a name that hashes the library, `FUNCTIONS` and the versions
of llvmlite and Triton, after Triton's own linker has read it back. Where any of that fails (no
llvmlite, one whose LLVM is newer than Triton's, an unusual library) the whole library is used, as
before, with a warning: slower to compile, the same kernels. TRIDIST_DEVICE_LIBRARY=whole skips
the cut.
"""
import functools
import hashlib
import os
import tempfile
import warnings

from . import config

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
        # once per library and process: for_kernels is cached
        warnings.warn(f"tridist: Triton links NVSHMEM's whole device library into each kernel (parsing it takes "
                      f"most of each compile) because cutting it failed: {type(error).__name__}: {error}. With "
                      f"llvmlite installed (`pip install llvmlite`) and an LLVM no newer than Triton's it is cut; "
                      "TRIDIST_DEVICE_LIBRARY=whole silences this.", stacklevel=2)
        return whole


def _cut_copy(whole: str) -> str:
    import llvmlite
    import triton
    from triton import knobs

    with open(whole, "rb") as f:
        data = f.read()
    versions = f"llvmlite {llvmlite.__version__} triton {triton.__version__}"  # the writer's LLVM, the reader's
    key = hashlib.sha256(data + "\n".join(sorted(FUNCTIONS)).encode() + versions.encode()).hexdigest()
    folder = knobs.cache.dir
    path = os.path.join(folder, f"libnvshmem_device-cut-{key[:24]}.bc")
    if os.path.exists(path):
        return path
    os.makedirs(folder, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=folder, suffix=".bc.tmp")
    try:
        with os.fdopen(descriptor, "wb") as f:
            f.write(cut(data, FUNCTIONS))
        _check_triton_reads(temporary)
        os.replace(temporary, path)  # ranks that cut at once write the same bytes
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
    return path


def cut(bitcode: bytes, keep) -> bytes:
    """LLVM bitcode with only the functions named in `keep` and those they call: every other
    function made internal, then LLVM's global dead-code elimination, which deletes internal
    functions nothing calls. Global variables keep their external linkage and stay."""
    import llvmlite.binding as llvm

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    module = llvm.parse_bitcode(bitcode)
    for function in module.functions:
        if not function.is_declaration and function.name not in keep:
            function.linkage = "internal"
    # A pass builder needs a target machine; the pass itself does not depend on the target.
    machine = llvm.Target.from_default_triple().create_target_machine()
    passes = llvm.create_new_module_pass_manager()
    passes.add_global_dead_code_eliminate_pass()
    passes.run(module, llvm.create_pass_builder(machine, llvm.create_pipeline_tuning_options()))
    module.verify()
    return module.as_bitcode()


def _check_triton_reads(path: str) -> None:
    """Raises unless Triton's own LLVM parses `path` (bitcode of a newer LLVM than Triton's does not)."""
    from triton._C.libtriton import ir, llvm

    with tempfile.TemporaryDirectory() as folder:
        empty = os.path.join(folder, "empty.mlir")
        with open(empty, "w") as f:
            f.write("module {}\n")
        context = ir.context()
        ir.load_dialects(context)
        module = llvm.to_module(ir.parse_mlir_module(empty, context), llvm.context())
        llvm.link_extern_libs(module, [path])
