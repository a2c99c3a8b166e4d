"""Settings read from the environment, in one place so that `tridist info` can list them."""
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


def heap_bytes(backend: str) -> int:
    """Size of each rank's symmetric heap (TRIDIST_HEAP_SIZE)."""
    default = "4G" if backend == "nvshmem" else "256M"
    return parse_bytes(os.environ.get("TRIDIST_HEAP_SIZE", default))


def wait_timeout_s() -> float:
    """How long a bounded wait spins before it reports (TRIDIST_WAIT_TIMEOUT, seconds)."""
    return float(os.environ.get("TRIDIST_WAIT_TIMEOUT", "60"))


def debug() -> bool:
    """TRIDIST_DEBUG=1 bounds every device wait on the GPU and checks allocations across ranks."""
    return os.environ.get("TRIDIST_DEBUG", "0") not in ("", "0")


def emulator_threads() -> int:
    """Programs of one launch that the emulator runs at once, like resident blocks on a GPU."""
    return int(os.environ.get("TRIDIST_EMU_THREADS", "64"))


SETTINGS = {
    "TRIDIST_BACKEND": "nvshmem on CUDA GPUs, emulator elsewhere; set before importing tridist",
    "TRIDIST_NNODES": "virtual nodes: split the ranks of one host into this many nodes",
    "TRIDIST_HEAP_SIZE": "symmetric heap per rank (default 4G on GPU, 256M in the emulator)",
    "TRIDIST_WAIT_TIMEOUT": "seconds a bounded wait spins before it reports (default 60)",
    "TRIDIST_DEBUG": "1: bound every GPU wait, check allocations across ranks, sync after launches",
    "TRIDIST_EMU_THREADS": "programs of one launch the emulator runs at once (default 64)",
    "TRIDIST_TUNE_CACHE": "folder of tridist.tune's cache, tune.json (default ~/.cache/tridist)",
    "TRIDIST_TUNE_VERBOSE": "1: tridist.tune prints each config's slowest-rank time on rank 0",
}
