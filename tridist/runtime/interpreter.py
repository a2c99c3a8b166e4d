"""Triton's interpreter as the emulator runs kernels: every change tridist makes to its private
parts, and the launch that replaces its own.

In the emulator, `tridist.jit` gives an `EmulatedFunction`: Triton's `InterpretedFunction`, whose
launch (`_launch`) uses the arguments in place and runs the programs at once, on an interpreter
changed four ways by `install`:
- each program thread has its own program id (`InterpreterBuilder.grid_idx`, one value per thread),
  so that the programs of a launch can run at once, up to TRIDIST_EMU_THREADS of them, like
  resident blocks on a GPU, and a kernel whose programs wait on each other works as on a GPU;
- the interpreter rewrites a device function the first time it runs and patches triton.language
  on every call, both through the function's module globals: program threads take turns at it;
- atomics hold a lock shared by all ranks, because the interpreter's are plain read-modify-writes;
- a scalar used as an index is read in a way numpy 2.4 and later accept.
The launch: the interpreter would copy each tensor argument and copy it back after the launch,
which would overwrite whatever peers wrote into a symmetric buffer meanwhile; `_launch` passes
them in place.

Versions. These reach into `triton.runtime.interpreter`'s private parts, which change between
Triton releases without notice. They are written for Triton TESTED_TRITON: `RELIED_ON` names each
private part they patch, replace or call, with a hash of its source there, and
tests/test_interpreter.py fails when the installed Triton's differ. `check_triton` runs before the
changes are made: on a Triton that lacks one of those parts the emulator refuses to start; on
another version than TESTED_TRITON it warns once per job.
"""
import concurrent.futures
import functools
import hashlib
import importlib
import inspect
import threading
import warnings

import torch
import triton
from triton.runtime import interpreter as _interpreter

from . import config, emulator, occupancy
from .errors import TridistError
from .log import first_rank
from .world import transport

TESTED_TRITON = "3.6"  # major.minor: the releases whose interpreter the changes below were checked on

# Every private part of Triton the emulator relies on -> sha256 (first 16 hex digits) of its source
# in Triton 3.6.0 (`source_hash`); None: no Python source (a compiled function), only its presence.
RELIED_ON = {
    # patched by `install`
    "triton.runtime.interpreter.InterpreterBuilder.set_grid_idx": "22f3c9f5b2d6036c",
    "triton.runtime.interpreter.InterpreterBuilder.create_get_program_id": "68f774e36d751365",
    "triton.runtime.interpreter._patch_lang": "e5beeba74ada4829",
    "triton.runtime.interpreter.InterpretedFunction.rewrite": "f2ae55f6534f18a1",
    "triton.runtime.interpreter._patch_lang_tensor": "efc91e4a5c969e2c",
    "triton.runtime.interpreter._LangPatchScope.set_attr": "6b243fcb465a6939",
    "triton.runtime.interpreter.InterpreterBuilder.create_atomic_rmw": "439de2147dca19c9",
    "triton.runtime.interpreter.InterpreterBuilder.create_atomic_cas": "b7c0e3f0b15d0c0a",
    # replaced by `EmulatedFunction.run` and `_launch`, or called by them
    "triton.runtime.interpreter.InterpretedFunction.run": "80a1f5dae367a548",
    "triton.runtime.interpreter.GridExecutor.__call__": "a8a9450a0a0406a3",
    "triton.runtime.interpreter._implicit_cvt": "d1b53b293c6d4129",
    "triton.runtime.interpreter.InterpreterBuilder.set_grid_dim": "14210f867193be1e",
    "triton.runtime.jit._normalize_ty": "c5855b24524b7b59",
    # called by the emulated device functions (tridist/language/_emulated.py)
    "triton.runtime.interpreter.TensorHandle": "3202e4a6ff09b717",
    "triton.runtime.interpreter._get_np_dtype": "8f20d41e3207891a",
    "triton.runtime.interpreter._interpreter.load": None,
    "triton.runtime.interpreter.interpreter_builder": None,
}


def resolve(name: str):
    """The object a dotted name in `RELIED_ON` names, or None where it does not exist."""
    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for part in parts[split:]:
            value = getattr(value, part, None)
            if value is None:
                return None
        return value
    return None


def source_hash(name: str) -> str | None:
    """sha256 of the source of what `name` names (first 16 hex digits); None where it has none."""
    try:
        source = inspect.getsource(resolve(name))
    except (OSError, TypeError):
        return None
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def check_triton(version: str = triton.__version__, relied_on=RELIED_ON) -> None:
    """Refuses (TridistError) a Triton that lacks a part the emulator relies on; warns, once per
    job, on a Triton version other than TESTED_TRITON. Both say what to do."""
    fix = (f"install the Triton the emulator was tested with (pip install -e '.[emulator]', or "
           f"'triton=={TESTED_TRITON}.*'), or run tests/test_interpreter.py to see which parts changed "
           "(tridist/runtime/interpreter.py says what each change does)")
    missing = [name for name in relied_on if resolve(name) is None]
    if missing:
        raise TridistError(f"the emulator changes private parts of Triton's interpreter, and Triton {version} lacks "
                           f"{', '.join(missing)}: {fix}")
    if not version.startswith(TESTED_TRITON + ".") and first_rank():
        warnings.warn(f"tridist: the emulator changes private parts of Triton {TESTED_TRITON}'s interpreter, and "
                      f"Triton {version} is untested there: if emulated kernels fail or hang, {fix}", stacklevel=2)


class _ThreadGrid(threading.local):
    idx = None


def _holding(lock, method):
    @functools.wraps(method)  # `source_hash` reads the source of what it wraps
    def run_holding(*args, **kwargs):
        with lock():
            return method(*args, **kwargs)

    return run_holding


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


_installed = False


def install() -> None:
    """Make the four changes of the module docstring to Triton's interpreter, once per process."""
    global _installed
    if _installed:
        return
    check_triton()
    grid = _ThreadGrid()
    _interpreter.InterpreterBuilder.grid_idx = property(lambda self: grid.idx,
                                                        lambda self, value: setattr(grid, "idx", value))
    lock = threading.RLock()
    _interpreter._patch_lang = _holding(lambda: lock, _interpreter._patch_lang)
    _interpreter.InterpretedFunction.rewrite = _holding(lambda: lock, _interpreter.InterpretedFunction.rewrite)
    patch_lang_tensor = _interpreter._patch_lang_tensor

    @functools.wraps(patch_lang_tensor)
    def patch_lang_tensor_by_item(tensor, scope):
        return patch_lang_tensor(tensor, _IndexByItem(scope))

    _interpreter._patch_lang_tensor = patch_lang_tensor_by_item
    for atomic in ("create_atomic_rmw", "create_atomic_cas"):
        setattr(_interpreter.InterpreterBuilder, atomic,
                _holding(lambda: transport().atomic_lock(), getattr(_interpreter.InterpreterBuilder, atomic)))
    _installed = True


class EmulatedFunction(_interpreter.InterpretedFunction):
    """A kernel of the emulator: `kernel[grid](...)` runs `_launch`; `coresident=True` as on GPUs."""

    def run(self, *args, grid, warmup, coresident=False, **kwargs):
        if warmup:
            return None
        return _launch(self, self.rewrite(), grid, args, kwargs, coresident)


def _launch(kernel, python_fn, grid, args, kwargs, coresident):
    """Run one launch of `kernel` (see the module docstring); `python_fn` is its Python function as
    the interpreter rewrote it, which each program calls. Co-resident, every program gets a thread
    of its own."""
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
            occupancy.refuse_grid(kernel.__name__, grid, config.emulator_coresident(),
                                  "the emulator runs every program of a co-resident launch on a thread of its own, "
                                  f"and at most TRIDIST_EMU_CORESIDENT={config.emulator_coresident()} of them")
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
