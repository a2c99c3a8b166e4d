"""`tridist.jit`: `triton.jit` plus what a distributed kernel needs on each backend.

On GPUs the kernel is a `JITFunction` that links NVSHMEM's device library and initialises every
module it compiles. In the emulator it is Triton's interpreter, with four changes:
- arguments are used in place: the interpreter would copy each tensor and copy it back after the
  launch, which would overwrite whatever peers wrote into a symmetric buffer meanwhile;
- the programs of a launch run at once (up to TRIDIST_EMU_THREADS of them, like resident blocks on
  a GPU), so a kernel whose programs wait on each other works as it does on a GPU;
- atomics hold a lock shared by all ranks, because the interpreter's are plain read-modify-writes;
- a scalar used as an index is read in a way numpy 2.4 and later accept.

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
import concurrent.futures
import inspect
import math
import sys
import threading

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


def _refuse_grid(kernel: str, grid: tuple, limit: int, why: str) -> None:
    programs = math.prod(grid)
    if programs > limit:
        raise ValueError(f"kernel {kernel}: a co-resident launch of {programs} programs (grid {grid}), but at most "
                         f"{limit} can be resident at once: {why}. Launch at most {limit} programs "
                         "(tridist.coresident_programs gives the number for a kernel and its arguments)")


if backend.is_emulator():
    from triton.runtime import interpreter as _interpreter

    class _ThreadGrid(threading.local):
        idx = None

    _grid = _ThreadGrid()
    # Each program thread has its own program id.
    _interpreter.InterpreterBuilder.grid_idx = property(lambda self: _grid.idx,
                                                        lambda self, value: setattr(_grid, "idx", value))

    def _holding(lock, method):
        def run_holding(*args, **kwargs):
            with lock():
                return method(*args, **kwargs)

        return run_holding

    # The interpreter rewrites a device function the first time it runs and patches triton.language
    # on every call, both through the function's module globals: program threads take turns at it.
    _interpreter_lock = threading.RLock()
    _interpreter._patch_lang = _holding(lambda: _interpreter_lock, _interpreter._patch_lang)
    _interpreter.InterpretedFunction.rewrite = _holding(lambda: _interpreter_lock,
                                                        _interpreter.InterpretedFunction.rewrite)
    class _IndexByItem:
        """The interpreter's patch scope, giving `tl.tensor.__index__` (a scalar used as a loop bound or an
        index) `.item()` of the scalar's one-element array where the interpreter would take `int()` of
        it, which numpy 2.4 and later refuse ("only 0-dimensional arrays can be converted"). Replaced as
        it is set, never after: other program threads may be reading it meanwhile."""

        def __init__(self, scope):
            self._scope = scope

        def set_attr(self, obj, name, value):
            self._scope.set_attr(obj, name, _scalar_index if name == "__index__" else value)

    def _scalar_index(tensor) -> int:
        return tensor.handle.data.item()

    _patch_lang_tensor = _interpreter._patch_lang_tensor
    _interpreter._patch_lang_tensor = lambda tensor, scope: _patch_lang_tensor(tensor, _IndexByItem(scope))
    for _atomic in ("create_atomic_rmw", "create_atomic_cas"):
        setattr(_interpreter.InterpreterBuilder, _atomic,
                _holding(lambda: transport().atomic_lock(), getattr(_interpreter.InterpreterBuilder, _atomic)))

    class EmulatedFunction(_interpreter.InterpretedFunction):
        def run(self, *args, grid, warmup, coresident=False, **kwargs):
            if warmup:
                return None
            return _launch(self, self.rewrite(), grid, args, kwargs, coresident)

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
                    _refuse_grid(self.fn.__name__, _grid_programs(self.signature, grid, args, kwargs),
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


def _launch(kernel, python_fn, grid, args, kwargs, coresident):
    """Run one launch of `kernel` (an `EmulatedFunction`) in the emulator (see the module docstring);
    `python_fn` is its Python function as the interpreter rewrote it, which each program calls.
    Co-resident, every program gets a thread of its own."""
    from . import emulator

    for name, value in list(zip(kernel.arg_names, args)) + list(kwargs.items()):
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            raise ValueError(f"{kernel.__name__}: argument {name} is on {value.device}; the emulator runs on "
                             "CPU tensors (symm_empty gives them)")
    argspec = inspect.getfullargspec(python_fn)
    kwargs = {k: v for k, v in kwargs.items() if k in argspec.args}
    patches = _interpreter._patch_lang(python_fn)
    try:
        bound = inspect.getcallargs(python_fn, *args, **kwargs)
        annotations = {k: triton.runtime.jit._normalize_ty(t) for k, t in python_fn.__annotations__.items()}
        constexprs = {k for k in kernel.arg_names if annotations.get(k) == "constexpr"}
        bound = {k: v if k in constexprs else _interpreter._implicit_cvt(v) for k, v in bound.items()}
        grid = grid(bound) if callable(grid) else grid
        grid = tuple(grid) + (1,) * (3 - len(grid))
        if coresident:
            _refuse_grid(kernel.__name__, grid, config.emulator_coresident(),
                         "the emulator runs every program of a co-resident launch on a thread of its own, and "
                         f"at most TRIDIST_EMU_CORESIDENT={config.emulator_coresident()} of them")
        _interpreter.interpreter_builder.set_grid_dim(*grid)
        programs = [(x, y, z) for x in range(grid[0]) for y in range(grid[1]) for z in range(grid[2])]
        state = emulator._LaunchState(kernel.__name__, coresident)
        if len(programs) == 1:
            _run_program(python_fn, bound, programs[0], state)
        else:
            workers = len(programs) if coresident else min(len(programs), config.emulator_threads())
            with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="tridist-program") as pool:
                for future in [pool.submit(_run_program, python_fn, bound, p, state) for p in programs]:
                    future.result()
    finally:
        patches.restore()


def _run_program(python_fn, bound, program, state) -> None:
    from . import emulator

    emulator._launch.state = state
    emulator._launch.kernel = state.kernel
    _interpreter.interpreter_builder.set_grid_idx(*program)
    try:
        python_fn(**bound)
    except emulator.LaunchAborted:
        return
    except Exception as error:
        state.failed.set()
        raise _tridist_cause(error) from None
    finally:
        emulator._launch.state = None
        emulator._launch.kernel = None


def _tridist_cause(error: BaseException) -> BaseException:
    """The interpreter wraps errors of device functions; surface our own errors unwrapped."""
    seen = error
    while seen is not None:
        if isinstance(seen, TridistError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return error
