"""`tridist.jit`: `triton.jit` plus what a distributed kernel needs on each backend.

On GPUs the kernel is a `JITFunction` that links NVSHMEM's device library and initialises every
module it compiles. In the emulator it is Triton's interpreter, with three changes:
- arguments are used in place: the interpreter would copy each tensor and copy it back after the
  launch, which would overwrite whatever peers wrote into a symmetric buffer meanwhile;
- the programs of a launch run at once (up to TRIDIST_EMU_THREADS of them, like resident blocks on
  a GPU), so a kernel whose programs wait on each other works as it does on a GPU;
- atomics hold a lock shared by all ranks, because the interpreter's are plain read-modify-writes.
"""
import concurrent.futures
import inspect
import threading

import torch
import triton

from . import backend, config
from .errors import TridistError
from .world import transport, world


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
    for _atomic in ("create_atomic_rmw", "create_atomic_cas"):
        setattr(_interpreter.InterpreterBuilder, _atomic,
                _holding(lambda: transport().atomic_lock(), getattr(_interpreter.InterpreterBuilder, _atomic)))

    class EmulatedFunction(_interpreter.InterpretedFunction):
        def run(self, *args, grid, warmup, **kwargs):
            if warmup:
                return None
            return _launch(self, self.rewrite(), grid, args, kwargs)

else:

    class NvshmemFunction(triton.runtime.jit.JITFunction):
        def run(self, *args, grid, warmup, **kwargs):
            kwargs.setdefault("extern_libs", {"libnvshmem_device": transport().device_library})
            kernel = super().run(*args, grid=grid, warmup=warmup, **kwargs)
            # A launch being captured into a CUDA graph has not run, and synchronising would end the
            # capture; a wait that expires there traps at replay, and the replay's error names no kernel.
            if config.debug() and not warmup and not torch.cuda.is_current_stream_capturing():
                _synchronize_and_name(self.fn.__name__)
            return kernel

        def _do_compile(self, *args, **kwargs):
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
    try:
        torch.cuda.synchronize()
    except RuntimeError as error:
        raise TridistError(f"rank {world().rank}: kernel {kernel} failed: {error}. A bounded wait that expired "
                           "printed its signal, expected and observed values above.") from error


def _launch(kernel, python_fn, grid, args, kwargs):
    """Run one launch of `kernel` (an `EmulatedFunction`) in the emulator (see the module docstring);
    `python_fn` is its Python function as the interpreter rewrote it, which each program calls."""
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
        _interpreter.interpreter_builder.set_grid_dim(*grid)
        programs = [(x, y, z) for x in range(grid[0]) for y in range(grid[1]) for z in range(grid[2])]
        state = emulator._LaunchState(kernel.__name__)
        if len(programs) == 1:
            _run_program(python_fn, bound, programs[0], state)
        else:
            workers = min(len(programs), config.emulator_threads())
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
