"""One line for a bounded wait that expired, the same on GPUs and in the emulator:

    tridist: rank R kernel K program P: wait on <allocation>[i] expected <cmp> V, observed W after T s

`<allocation>[i]` is the symmetric tensor the waited-on word belongs to, by the name its creator
gave (`symm_empty(..., name=...)`) or by its number, with its dtype and shape, and the word's index
in it (`SymmetricHeap.name_of`). In the emulator the wait raises `WaitTimeoutError` with the line.

On GPUs (TRIDIST_DEBUG=1) no thread prints (Triton's device print gives a line per thread and
operand). The first thread of the waiting program writes what it knows into a slot of the report
page, a page of pinned host memory that the GPU writes over PCIe or NVLink-C2C, and traps. The page
lies at a fixed address, `REPORT_ADDRESS`, in every process, compiled into the kernels as a
constant so that their cache keys do not change from one process to the next; a slot per program
(modulo `SLOTS`), its magic word written last. The host's synchronisation after the launch (debug
mode synchronises after each) then fails; the page is plain host memory, readable although the CUDA
context is lost, so the host turns the slot into the line, prints it, and raises `WaitTimeoutError`
with it (`take`).
"""
import ctypes
import mmap

import torch

REPORT_ADDRESS = 0x5A5A_0000_0000  # far from where Linux and CUDA place mappings on x86-64
SLOTS = 64
# The int64 words of a slot, in order; the device writes MAGIC last.
FIELDS = ("magic", "kind", "program", "address", "comparison", "expected", "observed", "elapsed_ns", "stale")
WORDS = 16
MAGIC = int.from_bytes(b"tridist!", "little")
KIND_SIGNAL, KIND_PACKETS = 1, 2
PAGE = SLOTS * WORDS * 8
# NVSHMEM's comparison codes (`tridist.language.shmem.CMP_*`), as the line writes them.
COMPARISONS = {0: "==", 1: "!=", 2: ">", 3: "<=", 4: "<", 5: ">="}

_MAP_PRIVATE, _MAP_ANONYMOUS, _MAP_FIXED_NOREPLACE = 0x02, 0x20, 0x100000
_state = {"mapped": False, "registered": False, "problem": None}


def line(rank: int, kernel: str, program: int, where: str, comparison: str, expected, observed,
         seconds: float, stale: int | None = None) -> str:
    """The report of one expired wait; `where` from `SymmetricHeap.name_of`. For a wait on a block
    of LL packets (`dl.ll`), `where` is the first stale packet, the values are its flag, and `stale`
    says how many of the block were."""
    text = (f"tridist: rank {rank} kernel {kernel} program {program}: wait on {where} expected {comparison} "
            f"{expected}, observed {observed} after {seconds:.1f} s")
    return text if stale is None else text + f" (the flag of an LL packet; {stale} packets stale)"


def map_page() -> None:
    """Map the report page at REPORT_ADDRESS, before CUDA reserves its address ranges (at import,
    with TRIDIST_DEBUG=1 on GPUs). Where the address is taken, `problem()` says so and an expired
    wait's write faults instead (the host then names the kernel alone)."""
    if _state["mapped"]:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    flags = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_FIXED_NOREPLACE
    address = libc.mmap(REPORT_ADDRESS, PAGE, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if address != REPORT_ADDRESS:
        if address not in (None, ctypes.c_void_p(-1).value):
            libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            libc.munmap(address, PAGE)  # an old kernel took the address as a hint and mapped elsewhere
        _state["problem"] = f"the wait report page could not be mapped at {REPORT_ADDRESS:#x}"
        return
    _state["mapped"] = True
    clear()


def register_page() -> None:
    """Pin the page and map it for the GPUs (at `tridist.init()`): with unified addressing the
    device reaches it at the host's address."""
    if not _state["mapped"] or _state["registered"]:
        return
    cuda_host_register_portable_mapped = 3
    status = torch.cuda.cudart().cudaHostRegister(REPORT_ADDRESS, PAGE, cuda_host_register_portable_mapped)
    if int(status) != 0:
        _state["problem"] = f"cudaHostRegister of the wait report page failed ({status})"
        return
    _state["registered"] = True


def problem() -> str | None:
    """Why expired waits on GPUs cannot be reported in a line, or None."""
    return _state["problem"]


def _words() -> ctypes.Array:
    return (ctypes.c_int64 * (SLOTS * WORDS)).from_address(REPORT_ADDRESS)


def clear() -> None:
    ctypes.memset(REPORT_ADDRESS, 0, PAGE)


def read() -> list[dict]:
    """The slots written since the last `clear`, in slot order."""
    if not _state["mapped"]:
        return []
    words = list(_words())
    slots = [dict(zip(FIELDS, words[slot * WORDS:slot * WORDS + len(FIELDS)])) for slot in range(SLOTS)]
    return [slot for slot in slots if slot["magic"] == MAGIC]


def describe(slot: dict, rank: int, kernel: str, name_of) -> str:
    """The line for a slot of the page; `name_of(address)` names the waited-on word (for an LL
    wait, which watches a block of packets, the first stale packet, whose flag it compares)."""
    comparison = COMPARISONS.get(slot["comparison"], f"<comparison {slot['comparison']}>")
    return line(rank, kernel, slot["program"], name_of(slot["address"] % 2 ** 64), comparison, slot["expected"],
                slot["observed"], slot["elapsed_ns"] / 1e9, slot["stale"] if slot["kind"] == KIND_PACKETS else None)


def take(rank: int, kernel: str, name_of) -> str | None:
    """After `kernel` failed on the GPU: the line of the first slot written, or None (a trap that
    was no wait's, or a page that could not be mapped); clears the page."""
    slots = read()
    if not slots:
        return None
    clear()
    return describe(slots[0], rank, kernel, name_of)
