"""How many programs of a compiled kernel can be resident on the GPU at once, for co-resident
launches (`kernel[grid](..., coresident=True)`, `tridist.coresident_programs`).

A GPU runs a block (a Triton program) on one SM from its start to its end, and starts a block only
where the SM has room for all of it: registers, shared memory, threads and a block slot. A program
that spins until another program of the same launch signals it therefore waits forever if that
program never got an SM: the launch needs every program resident at once. The number that fit is
(blocks per SM) x (SMs this process may use):

- blocks per SM: the driver's answer (`cuOccupancyMaxActiveBlocksPerMultiprocessor` on the kernel's
  function, through libcuda) where it can be asked, else `blocks_per_sm`, the rules of CUDA's
  occupancy calculator for Hopper written out (`HOPPER`);
- SMs: the device's count, which under CUDA MPS is already this client's share of the GPU
  (`available_sms`).

Ranks sharing a GPU (CUDA MPS) need more: a rank's programs that wait for a peer's wait for
programs of another client, which must find room too. MPS caps how many SMs a client's blocks use,
but nothing we know of says the clients get different SMs. So there a rank counts its share
divided by the ranks sharing the GPU (`available_sms`) and a co-resident launch takes one program
an SM (`coresident_limit`): all the ranks' grids then fit even on the SMs of one share.
"""
import ctypes
import dataclasses
import functools
import math

import torch

from . import sharing


@dataclasses.dataclass(frozen=True)
class SMLimits:
    """What one SM holds, and how its resources are handed out (sm_90: H100, H200)."""

    registers: int = 65536           # 32-bit registers in the register file
    sub_partitions: int = 4          # the file is split into 4 quarters; a warp's registers come from one
    register_unit: int = 256         # registers are given to a warp in multiples of 256
    registers_per_block: int = 65536
    shared_bytes: int = 228 << 10    # shared memory, with the whole unified L1 carved out as shared
    shared_per_block: int = 227 << 10
    shared_reserved: int = 1 << 10   # the driver keeps 1 KB of every block's shared memory for itself
    shared_unit: int = 128           # shared memory is given to a block in multiples of 128 bytes
    threads: int = 2048
    blocks: int = 32
    warp_size: int = 32


HOPPER = SMLimits()


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def blocks_per_sm(registers: int, shared: int, num_warps: int, limits: SMLimits = HOPPER) -> tuple[int, str]:
    """(blocks of a kernel that fit on one SM, what limits them) for `registers` per thread, `shared`
    bytes of shared memory per block (Triton's `metadata.shared`) and `num_warps` warps per block.

    Rounded as CUDA's occupancy calculator rounds for compute capability 9.0: a warp's registers are
    registers x 32 rounded up to a multiple of 256, and each quarter of the register file holds
    whole warps (so the warps that fit are 4 x floor(16384 / registers per warp)); a block's shared
    memory is its own plus the 1 KB the driver reserves, rounded up to 128 bytes. Shared memory is
    counted against the whole 228 KB an SM can give it; the driver's answer, used instead wherever
    it can be asked, knows the carve-out it will actually choose."""
    warps_per_block = num_warps
    threads_per_block = warps_per_block * limits.warp_size
    registers_per_warp = _round_up(max(registers, 1) * limits.warp_size, limits.register_unit)
    if registers_per_warp * _round_up(warps_per_block, limits.sub_partitions) > limits.registers_per_block:
        return 0, f"{registers} registers a thread x {threads_per_block} threads: more than a block may have"
    shared_per_block = _round_up(shared + limits.shared_reserved, limits.shared_unit)
    if shared > limits.shared_per_block:
        return 0, f"{shared} bytes of shared memory: more than a block may have ({limits.shared_per_block})"
    warps_by_registers = (limits.registers // limits.sub_partitions // registers_per_warp) * limits.sub_partitions
    candidates = [
        (limits.blocks, f"at most {limits.blocks} blocks an SM"),
        (limits.threads // threads_per_block, f"{threads_per_block} threads a block, {limits.threads} an SM"),
        (warps_by_registers // warps_per_block,
         f"{registers} registers a thread ({registers_per_warp} a warp), {limits.registers} an SM"),
        (limits.shared_bytes // shared_per_block,
         f"{shared_per_block} bytes of shared memory a block (with the driver's reserve), {limits.shared_bytes} an SM"),
    ]
    return min(candidates, key=lambda candidate: candidate[0])


@functools.cache
def _libcuda():
    """The CUDA driver library, or None where it cannot be loaded."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


class _ExecAffinity(ctypes.Structure):  # CUexecAffinityParam with its SM-count member
    _fields_ = [("type", ctypes.c_int), ("sm_count", ctypes.c_uint)]


def _driver_sms() -> int | None:
    """The SMs the driver says the current context may use (`cuCtxGetExecAffinity`, SM count), or
    None where it does not say."""
    cuda = _libcuda()
    if cuda is None or not hasattr(cuda, "cuCtxGetExecAffinity"):
        return None
    affinity = _ExecAffinity()
    if cuda.cuCtxGetExecAffinity(ctypes.byref(affinity), 0) != 0:  # 0: CU_EXEC_AFFINITY_TYPE_SM_COUNT
        return None
    return int(affinity.sm_count) or None


@functools.cache
def available_sms(device: torch.device) -> tuple[int, str]:
    """(SMs this process sizes its grids for, where the number comes from): the smaller of the
    device's SM count and what the driver reports for this context, divided by the ranks sharing
    the GPU. Under CUDA MPS with a thread percentage the driver already counts this client's share
    (rounded down to whole 2-SM TPCs). Should a driver ever report the whole GPU there, the
    co-resident launch is also cooperative (see `runtime/jit.py`), so the driver refuses a grid it
    cannot hold instead of leaving it to wait.

    The division guards against the ranks' blocks being given the same SMs, which hangs of
    co-resident grids of one program an SM of each rank's share suggested (not proven; benchmarks/
    NOTES.md, "Moved from the code's docstrings (issue 41)"), at the price of speed, which sharing a
    GPU does not promise."""
    total = torch.cuda.get_device_properties(device).multi_processor_count
    torch.cuda.init()
    with torch.cuda.device(device):
        driver = _driver_sms()
    sms, where = total, f"{total} on the device"
    if driver is not None and driver < total:
        sms, where = driver, f"{total} on the device, {driver} for this context (cuCtxGetExecAffinity)"
    ranks = sharing.ranks_per_gpu_here()
    if ranks > 1:
        sms, where = max(1, sms // ranks), f"{where}, / {ranks} ranks sharing the GPU"
    return sms, where


def _driver_blocks_per_sm(compiled) -> int | None:
    """`cuOccupancyMaxActiveBlocksPerMultiprocessor` for a Triton CompiledKernel, or None."""
    cuda = _libcuda()
    if cuda is None:
        return None
    compiled._init_handles()
    blocks = ctypes.c_int(0)
    threads = compiled.metadata.num_warps * HOPPER.warp_size
    error = cuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(blocks), ctypes.c_void_p(compiled.function), ctypes.c_int(threads),
        ctypes.c_size_t(compiled.metadata.shared))
    return blocks.value if error == 0 else None


_limits: dict = {}


def coresident_limit(compiled, device: torch.device) -> tuple[int, str]:
    """(the most programs of `compiled` that can all be resident at once on the SMs this process may
    use, a sentence saying how that number comes about). Cached per compiled kernel."""
    if compiled in _limits:
        return _limits[compiled]
    compiled._init_handles()
    registers, shared, warps = compiled.n_regs, compiled.metadata.shared, compiled.metadata.num_warps
    counted, limited_by = blocks_per_sm(registers, shared, warps)
    per_sm, limited_by = counted, f"counted: {limited_by}"
    driver = _driver_blocks_per_sm(compiled)
    if driver is not None:
        per_sm, limited_by = driver, f"the driver's answer; counted {counted}: {limited_by}"
    if sharing.ranks_per_gpu_here() > 1:
        # Another rank's blocks may hold part of each SM this rank's blocks land on (see the module
        # docstring); one program an SM fits beside whatever they hold, where grids of several an SM
        # hung (benchmarks/NOTES.md, "Moved from the code's docstrings (issue 41)").
        per_sm, limited_by = 1, f"one, as ranks share this GPU; {limited_by}"
    sms, where = available_sms(device)
    why = (f"{per_sm} program(s) an SM ({registers} registers a thread, {shared} bytes of shared memory, "
           f"{warps} warps; {limited_by}) x {sms} SMs ({where})")
    _limits[compiled] = (per_sm * sms, why)
    return _limits[compiled]


def refuse_grid(kernel: str, grid: tuple, limit: int, why: str) -> None:
    """Raises ValueError, before anything runs, where a co-resident launch of `kernel` with `grid`
    has more programs than `limit`, the most that can be resident at once (`why` says how that
    number comes about)."""
    programs = math.prod(grid)
    if programs > limit:
        raise ValueError(f"kernel {kernel}: a co-resident launch of {programs} programs (grid {grid}), but at most "
                         f"{limit} can be resident at once: {why}. Launch at most {limit} programs "
                         "(tridist.coresident_programs gives the number for a kernel and its arguments)")
