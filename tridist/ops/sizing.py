"""How the ops size their work: steps, slices and warps of the SM kernels, programs per call, and
the pieces of copy-engine transfers (`pieces`, which `piece_sizes` changes while testing)."""
import contextlib
import dataclasses

import torch
import triton

import tridist
from tridist.runtime import occupancy

from .checks import check_programs


def row_stride(numel: int) -> int:
    """Staging rows start at multiples of 64 elements (64 bytes for 1-byte types), so that every row
    admits 16-byte vector accesses."""
    return triton.cdiv(numel, 64) * 64


def splits_for(numel: int, block: int, programs: int) -> int:
    """Programs per destination: a block or more each, at most `programs`."""
    return max(1, min(programs, triton.cdiv(numel, block)))


SMALLEST_STEP = 2048  # elements


STEP_BYTES = 16 << 10


def steps_for(numel: int, itemsize: int, programs: int, step_bytes: int = STEP_BYTES) -> tuple[int, int, int]:
    """(BLOCK, splits, num_warps) for the SM kernels that move or sum `numel` elements: the elements
    a program handles per loop step, the programs that share the work (at most `programs`), and the
    warps of each (`warps_for`).

    A step's loads complete before its stores are issued, so a program moves about one step per
    memory latency, and large messages need large steps (4 KB steps held a copy to far below what
    16 KB steps reached: benchmarks/NOTES.md, "Moved from the code's docstrings (issue 41)").
    Steps grow from SMALLEST_STEP elements to `step_bytes` as long as every one of the programs
    still gets a whole step, so small messages keep their programs."""
    block = SMALLEST_STEP
    while 2 * block * itemsize <= step_bytes and numel >= 2 * block * programs:
        block *= 2
    return block, splits_for(numel, block, programs), warps_for(block, itemsize)


def slices_for(numel: int, itemsize: int, splits: int) -> int:
    """Slices of `numel` elements for kernels whose `splits` programs take them in turn (program s:
    slices s, s + splits, ...), each slice with its own flag, so that its consumer starts on it while
    later slices are still on the wire. About `pieces.slice_bytes` each: large enough that the release after
    each slice (which waits until its remote stores have landed) costs little next to sending it,
    small enough that the last slice, which nothing overlaps, is short."""
    return max(splits, triton.cdiv(numel * itemsize, pieces.slice_bytes))


def warps_for(block: int, itemsize: int) -> int:
    """Warps for a step of `block` elements: 64 bytes or fewer per thread. More, and Triton's
    per-element offsets and masks run out of registers (16 KB of bf16 on 4 warps: 255 and spills)."""
    return max(4, block * itemsize // 2048)


def programs_for(device: torch.device) -> int:
    """One program per SM this process may use: what the ops launch at most by default. Under CUDA MPS
    (ranks sharing a GPU) that is this rank's share (`occupancy.available_sms`)."""
    if device.type == "cuda":
        return occupancy.available_sms(device)[0]
    return 4  # the emulator: a few programs keep the threads busy without slowing tests down


def fit_coresident(kernel, wanted: int, per_unit: int, *args, **kwargs) -> int:
    """How many units (programs, or splits of `per_unit` programs each) a persistent kernel whose
    programs wait on each other launches: `wanted`, or fewer if not all of them could be resident at
    once (`tridist.coresident_programs` for the launch's arguments `args`, `kwargs`). Such kernels
    shrink to fit rather than refuse: with ranks sharing a GPU, each has only part of its SMs. Ops
    ask at their first call and keep the answer, since a call's programs count its epoch
    (`call_epoch`). At least 1; where even that does not fit, the co-resident launch refuses."""
    return max(1, min(wanted, tridist.coresident_programs(kernel, *args, **kwargs) // per_unit))


def programs_limit(programs: int | None, world) -> int:
    """The programs an op may launch: `programs` if given (an op's argument), else one per SM."""
    if programs is None:
        return programs_for(world.device)
    check_programs(programs)
    return programs


# Steps of the kernels that wait for copy-engine flags: 8 KB keeps them on 4 warps (at most 255
# registers a thread, half an SM's register file), so an SM they wait on has room left for the
# flags' memset; 16 KB steps take 8 warps and the whole register file.
CE_STEP_BYTES = 8 << 10


@dataclasses.dataclass
class Pieces:
    """The pieces ops built from now on cut their work in: `slice_bytes` per slice of the sliced
    kernels (`slices_for`), `chunk_bytes` per copy-engine transfer (`CopyEnginePush`; the copy-out
    of the last chunk is what shows)."""

    slice_bytes: int = 128 << 10
    chunk_bytes: int = 8 << 20


pieces = Pieces()


@contextlib.contextmanager
def piece_sizes(slice_bytes: int | None = None, chunk_bytes: int | None = None):
    """Ops built inside cut their sliced kernels' work in slices of `slice_bytes` (`slices_for`) and
    their copy-engine transfers in chunks of `chunk_bytes` (`CopyEnginePush`; rounded up to whole
    rows, `row_stride`); None keeps the default. For tests, which want small data in many pieces,
    and for the benchmark's `--slice-bytes` sweep. Sizes are read when an op is built."""
    saved = dataclasses.replace(pieces)
    pieces.slice_bytes = saved.slice_bytes if slice_bytes is None else slice_bytes
    pieces.chunk_bytes = saved.chunk_bytes if chunk_bytes is None else chunk_bytes
    try:
        yield
    finally:
        pieces.slice_bytes, pieces.chunk_bytes = saved.slice_bytes, saved.chunk_bytes
