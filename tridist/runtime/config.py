"""tridist's own settings (TRIDIST_*): each is read from the environment through an accessor here
and listed in SETTINGS, which `tridist info` prints with the value each has and where it came from.
Variables of other programs (torchrun's RANK and WORLD_SIZE, TRITON_INTERPRET, NVSHMEM_LIB_DIR)
are read where they are used.

Three settings are fixed when tridist is imported, because kernels are defined or compiled with
them: TRIDIST_BACKEND, TRIDIST_DEBUG and TRIDIST_WAIT_TIMEOUT (on GPUs). The others are read when
they are used.
"""
import os

_SUFFIXES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bytes(text: str) -> int:
    """'256M' -> 268435456; a plain number is bytes."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = _SUFFIXES.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in _SUFFIXES else text
    try:
        return int(float(number) * scale)
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a size; write bytes or a number with K, M or G") from None


def _setting(name: str, default: str, parse, expected: str):
    """`parse(value)` of the environment variable `name` (`default` when unset or empty). A value that
    `parse` refuses, or that parses to 0 or less, raises a ValueError naming the variable: these are
    read deep inside init or a launch, where the traceback alone does not say which setting is wrong."""
    value = os.environ.get(name) or default
    try:
        parsed = parse(value)
    except ValueError:
        parsed = None
    if parsed is None or not parsed > 0:
        raise ValueError(f"{name}={value!r}: expected {expected}")
    return parsed


def requested_backend() -> str:
    """TRIDIST_BACKEND as given, lower case; empty when unset (`runtime/backend.py` then chooses)."""
    return os.environ.get("TRIDIST_BACKEND", "").strip().lower()


def virtual_nodes() -> int | None:
    """TRIDIST_NNODES: split the ranks of one host into this many nodes; None when unset."""
    if not os.environ.get("TRIDIST_NNODES"):
        return None
    return _setting("TRIDIST_NNODES", "", int, "a positive integer, the number of virtual nodes")


def heap_bytes(backend: str) -> int:
    """Size of each rank's symmetric heap (TRIDIST_HEAP_SIZE)."""
    default = "4G" if backend == "nvshmem" else "256M"
    return _setting("TRIDIST_HEAP_SIZE", default, parse_bytes, "bytes, or a number with K, M or G (e.g. 256M)")


def wait_timeout_s() -> float:
    """How long a bounded wait spins before it reports (TRIDIST_WAIT_TIMEOUT, seconds). GPU kernels
    take it when tridist is imported; the emulator reads it again at every wait."""
    return _setting("TRIDIST_WAIT_TIMEOUT", "60", float, "a number of seconds above 0")


# Read once: GPU kernels compile their waits bounded or not when tridist is imported, and the host
# side must agree with them for the life of the process.
_DEBUG = os.environ.get("TRIDIST_DEBUG", "0") not in ("", "0")


def debug() -> bool:
    """TRIDIST_DEBUG=1 bounds device waits on the GPU and checks allocations across ranks."""
    return _DEBUG


def registered_only() -> bool:
    """TRIDIST_REGISTERED_ONLY (default 1): the emulator refuses a put or get to a rank on another
    node whose local side lies outside the symmetric heap, as a network transport (InfiniBand, UCX)
    refuses memory NVSHMEM never registered; 0 allows it, as NVLink between virtual nodes does. Read
    at each transfer."""
    return os.environ.get("TRIDIST_REGISTERED_ONLY", "1") not in ("", "0")


def ranks_per_gpu() -> int:
    """TRIDIST_RANKS_PER_GPU: how many ranks share each GPU (default 1; see `runtime/sharing.py`)."""
    return _setting("TRIDIST_RANKS_PER_GPU", "1", int, "a positive integer, the ranks that share each GPU")


def emulator_threads() -> int:
    """Programs of one launch that the emulator runs at once, like resident blocks on a GPU."""
    return _setting("TRIDIST_EMU_THREADS", "64", int, "a positive integer")


def emulator_coresident() -> int:
    """The most programs of a co-resident launch the emulator runs, each on a thread of its own
    (TRIDIST_EMU_CORESIDENT); a larger grid is refused, as one too large for the SMs is on a GPU."""
    return _setting("TRIDIST_EMU_CORESIDENT", "256", int, "a positive integer")


def emulator_folder() -> str | None:
    """TRIDIST_EMU_DIR: the folder the emulated ranks of one job share; None when unset."""
    return os.environ.get("TRIDIST_EMU_DIR") or None


def failure_folder() -> str | None:
    """TRIDIST_FAILURES: set by `tridist run`, the folder where a rank that fails leaves its error's
    first line for the launcher's summary; None when unset."""
    return os.environ.get("TRIDIST_FAILURES") or None


def tune_cache_folder() -> str:
    """TRIDIST_TUNE_CACHE: where `tridist.tune` keeps tune.json (default ~/.cache/tridist)."""
    return os.path.expanduser(os.environ.get("TRIDIST_TUNE_CACHE") or "~/.cache/tridist")


def device_library() -> str:
    """TRIDIST_DEVICE_LIBRARY: `cut` (default), NVSHMEM's device library cut to the functions tridist
    calls before Triton links it, or `whole` (see `runtime/device_library.py`)."""
    value = os.environ.get("TRIDIST_DEVICE_LIBRARY", "") or "cut"
    if value not in ("cut", "whole"):
        raise ValueError(f"TRIDIST_DEVICE_LIBRARY={value!r}: expected cut or whole")
    return value


def compile_log() -> str | None:
    """TRIDIST_COMPILE_LOG: the file where GPU ranks log each kernel they compile, for `tridist
    precompile` (see `runtime/compiles.py`); None when unset."""
    return os.environ.get("TRIDIST_COMPILE_LOG") or None


def tune_verbose() -> bool:
    """TRIDIST_TUNE_VERBOSE=1: `tridist.tune` prints each configuration's time on rank 0."""
    return os.environ.get("TRIDIST_TUNE_VERBOSE", "0") not in ("", "0")


# Each setting: its default, as words, and what it does. `tridist info` prints each with its value and
# where the value came from; docs/hooks/settings.py makes the table of docs/guide/settings.md.
SETTINGS = {
    "TRIDIST_BACKEND": ("nvshmem with CUDA GPUs, else emulator (also under TRITON_INTERPRET=1)",
                        "nvshmem or emulator; set before importing tridist"),
    "TRIDIST_NNODES": ("the real nodes", "virtual nodes: split the ranks of one host into this many nodes"),
    "TRIDIST_HEAP_SIZE": ("4G on GPUs, 256M in the emulator", "symmetric heap per rank"),
    "TRIDIST_WAIT_TIMEOUT": ("60", "seconds a bounded wait spins before it reports; set before importing tridist"),
    "TRIDIST_DEBUG": ("0", "1: bound GPU waits, check allocations across ranks, synchronise after each launch "
                           "(not while a CUDA graph is captured); set before importing tridist"),
    "TRIDIST_RANKS_PER_GPU": ("1", "ranks per GPU; set by `tridist run --ranks-per-gpu K`, or by hand for torchrun: "
                                   "rank r uses GPU LOCAL_RANK // K, the host group is gloo where ranks share a GPU, "
                                   "and each rank gets CUDA_MPS_ACTIVE_THREAD_PERCENTAGE 100 // K (CUDA MPS "
                                   "needed); ignored by the emulator"),
    "TRIDIST_REGISTERED_ONLY": ("1", "the emulator refuses a put or get to another node whose local side is not in "
                                     "the symmetric heap, as a network transport would; 0 allows it "
                                     "(docs/guide/virtual-nodes.md)"),
    "TRIDIST_EMU_THREADS": ("64", "programs of one launch the emulator runs at once"),
    "TRIDIST_EMU_CORESIDENT": ("256", "programs of a co-resident launch the emulator runs at most, a thread each"),
    "TRIDIST_EMU_DIR": ("a folder of the job's (under torchrun, named after the job)",
                        "set by `tridist run`: the folder where the emulated ranks share their heaps"),
    "TRIDIST_FAILURES": ("no folder", "set by `tridist run`: the folder where a rank that fails leaves its error's "
                                      "first line, for the job's summary"),
    "TRIDIST_DEVICE_LIBRARY": ("cut", "cut: Triton links NVSHMEM's device library cut to the functions tridist "
                                      "calls (kernels compile about ten times faster), or whole"),
    "TRIDIST_COMPILE_LOG": ("no log", "a file where GPU ranks log each kernel they compile, for `tridist precompile "
                                      "FILE` to compile them all on every core; set by `tridist run "
                                      "--record-compiles FILE`"),
    "TRIDIST_TUNE_CACHE": ("~/.cache/tridist", "folder of tridist.tune's cache, tune.json"),
    "TRIDIST_TUNE_VERBOSE": ("0", "1: tridist.tune logs each config's slowest-rank time on rank 0"),
    "TRIDIST_BENCH_RUN": ("no id", "an id of one benchmark run, recorded in each JSON `tridist bench` saves: ag_gemm "
                                   "and gemm_rs take PyTorch's fused times only from torch_fused's JSON of the same run "
                                   "(scripts/gpu_suite.sh sets one)"),
}


def describe_settings() -> list[str]:
    """One line per setting: its value and where it came from (the environment), or that it is unset
    and what its default is."""
    width = max(map(len, SETTINGS))
    lines = []
    for name, (default, _) in SETTINGS.items():
        value = os.environ.get(name)
        if value:
            lines.append(f"{name:<{width}}  {value}  (from the environment)")
        else:
            lines.append(f"{name:<{width}}  unset: default {default}")
    return lines
