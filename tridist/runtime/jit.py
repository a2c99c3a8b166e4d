"""`tridist.jit`: `triton.jit` plus what a distributed kernel needs on each backend.

On GPUs the kernel is a `JITFunction` that links NVSHMEM's device library and initialises every
module it compiles. In the emulator it is Triton's interpreter as `interpreter.py` changes it
(arguments used in place, the programs of a launch run at once, atomics locked across ranks),
every change to the interpreter's private parts being there, checked against Triton's version.

Co-resident launches. `kernel[grid](..., coresident=True)` launches a grid whose programs may wait
on each other (a persistent kernel with `dl.grid_barrier`, or programs that wait for signals other
programs of the same launch raise): all of them must be running at once, or a waiting program
holds the SM that the program it waits for needs. It is Triton's own launch with one more keyword,
in the spirit of CUDA's cooperative launch and NVSHMEM's collective launch. Before launching, the
grid is checked against what the compiled kernel allows (`coresident_programs`): on GPUs the
programs that fit on an SM (registers, shared memory, warps: `occupancy.py`) times the SMs this
process may use (fewer under CUDA MPS, when ranks share a GPU); in the emulator, where every
program of a co-resident launch runs on a thread of its own, TRIDIST_EMU_CORESIDENT. A grid that
does not fit raises a ValueError naming the numbers, before anything runs. On GPUs the launch is
also cooperative (Triton's `launch_cooperative_grid`), so the driver refuses rather than queues a
grid it cannot make resident.
"""
import inspect
import sys

import torch
import triton

from . import backend, config, occupancy, wait_report
from .errors import TridistError, WaitTimeoutError
from .world import heap, mark_failed, transport, world


def jit(fn=None, **kwargs):
    """Decorator for distributed kernels; takes what `triton.jit` takes (e.g.
    `@tridist.jit(do_not_specialize=["epoch"])`).

    The kernel is launched as any Triton kernel, `kernel[grid](*args)`, and may call
    `tridist.language` functions. On GPUs it links NVSHMEM's device library and initialises
    every module it compiles; with TRIDIST_DEBUG=1 each launch is followed by a synchronisation
    that names the kernel if it failed (not while a CUDA graph is captured). In the emulator it
    runs under Triton's interpreter with the arguments used in place (peers' writes into
    symmetric tensors are not copied over) and the programs of a launch running at once
    (TRIDIST_EMU_THREADS), so programs that wait on each other work as on a GPU. Device
    functions called from a kernel take plain `triton.jit`.
    """

    def decorate(f):
        if backend.is_emulator():
            return EmulatedFunction(f, **kwargs)
        return NvshmemFunction(f, **kwargs)

    return decorate(fn) if fn is not None else decorate


def coresident_programs(kernel, *args, **kwargs) -> int:
    """The most programs a co-resident launch of `kernel` with these arguments (those of the launch:
    tensors, scalars, constexprs, `num_warps`...) may have. On GPUs, the programs of the compiled
    kernel that fit on one SM times the SMs this process may use (`occupancy.coresident_limit`); the
    kernel is compiled if it was not, and nothing is launched. In the emulator,
    TRIDIST_EMU_CORESIDENT. A persistent kernel launches min(its work items, this)."""
    if backend.is_emulator():
        return config.emulator_coresident()
    compiled = kernel.run(*args, grid=(1,), warmup=True, coresident=True, **kwargs)
    return occupancy.coresident_limit(compiled, _current_device())[0]


def _current_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _grid_programs(signature: inspect.Signature, grid, args, kwargs) -> tuple[int, ...]:
    """The launch's grid as three numbers; a callable grid gets the bound arguments, as Triton gives them."""
    if callable(grid):
        bound = signature.bind(*args, **{k: v for k, v in kwargs.items() if k in signature.parameters})
        bound.apply_defaults()
        grid = grid(dict(bound.arguments))
    return tuple(grid) + (1,) * (3 - len(grid))


if backend.is_emulator():
    from .interpreter import EmulatedFunction, install

    install()

else:
    from .compiles import CompileWatch, record

    _compiles = CompileWatch()
    if config.compile_log():
        record(config.compile_log())

    class NvshmemFunction(triton.runtime.jit.JITFunction):
        def run(self, *args, grid, warmup, coresident=False, **kwargs):
            kwargs.setdefault("extern_libs", {"libnvshmem_device": transport().device_library})
            if coresident:
                kwargs["launch_cooperative_grid"] = True
                if not warmup:
                    compiled = super().run(*args, grid=grid, warmup=True, **kwargs)
                    occupancy.refuse_grid(self.fn.__name__, _grid_programs(self.signature, grid, args, kwargs),
                                          *occupancy.coresident_limit(compiled, _current_device()))
            kernel = super().run(*args, grid=grid, warmup=warmup, **kwargs)
            # A launch being captured into a CUDA graph has not run, and synchronising would end the
            # capture; a wait that expires there traps at replay, and the replay's error names no kernel.
            if config.debug() and not warmup and not torch.cuda.is_current_stream_capturing():
                _synchronize_and_name(self.fn.__name__)
            return kernel

        def _do_compile(self, *args, **kwargs):
            with _compiles:  # a job that compiles for long says so
                kernel = super()._do_compile(*args, **kwargs)
            if kernel is not None:
                _init_module(kernel)
            return kernel


def _init_module(kernel) -> None:
    """Point the module's NVSHMEM device state at this process's NVSHMEM instance."""
    if "nvshmem" not in kernel.asm.get("ptx", ""):
        return
    from torch._C._distributed_c10d import _nvshmemx_cumodule_init

    kernel._init_handles()
    _nvshmemx_cumodule_init(kernel.module)


def _synchronize_and_name(kernel: str) -> None:
    """Debug mode, after each launch on a GPU: a kernel that failed is named here. If a bounded wait
    of it expired, its report (`wait_report`) is printed, one line, and raised as WaitTimeoutError;
    else (`dl.check`, or another fault) the CUDA error is. The CUDA context is lost either way, so
    this rank is marked failed: `finalize` then leaves the GPU alone."""
    try:
        torch.cuda.synchronize()
    except RuntimeError as error:
        rank = world().rank
        mark_failed()
        report = wait_report.take(rank, kernel, heap().name_of)
        if report is None:
            problem = wait_report.problem()
            raise TridistError(f"rank {rank}: kernel {kernel} failed on the GPU: {error}"
                               + (f" ({problem}: an expired wait could not be reported)" if problem else "")) from None
        print(report, file=sys.stderr, flush=True)
        raise WaitTimeoutError(report) from None
