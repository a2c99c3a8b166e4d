"""Kernel compiles on GPUs: a log of what a job compiled, `tridist precompile` to compile it again on
every core, and one message when a job stalls compiling.

Kernels with NVSHMEM linked take seconds each to compile, and Triton compiles a kernel's
specialisations one by one as they are first launched: a job's first run can spend most of its time
compiling, with nothing to show for it. Triton's cache key covers a kernel's source and what only a
launch knows: its argument types, the arguments Triton specialised (ints equal to 1, sizes and
pointers divisible by 16), constexprs and options. So with TRIDIST_COMPILE_LOG=FILE (`tridist run
--record-compiles FILE`) every rank appends each compile, as Triton describes it to its
`jit_cache_hook`, to FILE (`record`), and `tridist precompile FILE` (`precompile`) compiles those
descriptions again through Triton's own `JITFunction.preload`, a process per core, into the Triton
cache, where the next launches find them. A kernel whose source changed since the log was written is
compiled anew, in parallel, with the specialisations it had; an entry that no longer fits its kernel
(renamed, other arguments) is dropped from the log.

Entries are kept per mode (TRIDIST_DEBUG and TRIDIST_WAIT_TIMEOUT are constexprs of the kernels):
only those of this process's mode are compiled.

`CompileWatch` is the message: a job whose compiles have gone on for a few seconds says so once, on
its first rank, with how many kernels it has compiled.
"""
import concurrent.futures
import json
import multiprocessing
import os
import sys
import threading
import time

from . import config
from .log import first_rank, logger

SAY_AFTER_S = 5.0  # how long a job compiles before it says so


def mode() -> str:
    """The settings compiled into the kernels, which a logged entry must match to be of use."""
    return f"debug={int(config.debug())} timeout={config.wait_timeout_s():g}"


def record(path: str) -> None:
    """Append each kernel this process compiles (or finds in Triton's cache) to `path`, one JSON line
    each; ranks of one job append to the same file (each line is one write)."""
    from triton import knobs

    current = mode()

    def hook(*, fn, compile, **_):
        line = json.dumps({"mode": current, "module": fn.module, "name": fn.name,
                           "file": fn.jit_function.fn.__code__.co_filename,
                           "specialization": compile["specialization_data"]}) + "\n"
        descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(descriptor, line.encode())
        finally:
            os.close(descriptor)
        return False  # compile as usual

    knobs.runtime.jit_cache_hook = hook


def read(path: str) -> list[dict]:
    """The log's entries, each once (ranks and runs record the same compiles again)."""
    entries = {}
    try:
        with open(path) as f:
            for line in f:
                try:
                    entry = json.loads(line)
                    entries.setdefault((entry["mode"], entry["specialization"]), entry)
                except (ValueError, KeyError):
                    continue  # a line cut short by a killed run
    except FileNotFoundError:
        return []
    return list(entries.values())


def precompile(path: str, workers: int | None = None) -> tuple[int, list[str]]:
    """Compile the entries of `path` of this process's mode on `workers` processes (default: a core
    each); rewrite the log without duplicates and without the entries that failed. Returns (entries
    compiled, why each failure failed)."""
    entries = read(path)
    mine = [e for e in entries if e["mode"] == mode()]
    workers = workers or os.cpu_count()
    logger.info(f"compiling {len(mine)} kernels of {path} on {workers} processes...")
    for entry in mine:  # once here, so that the forked workers inherit the modules
        try:
            _module(entry)
        except Exception:  # noqa: BLE001 - the worker says why
            pass
    # The cut device library once, here, before the workers fork (runtime/device_library.py).
    from .device_library import for_kernels
    from .nvshmem import find_device_library

    for_kernels(find_device_library())
    # None of the workers has started CUDA before it forks: the parent never does.
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        outcomes = list(pool.map(compile_entry, mine))
    failed = {id(e) for e, outcome in zip(mine, outcomes) if outcome}
    kept = [e for e in entries if id(e) not in failed]
    temporary = path + ".tmp"
    with open(temporary, "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in kept)
    os.replace(temporary, path)
    return len(mine) - len(failed), [outcome for outcome in outcomes if outcome]


def _module(entry: dict):
    """The kernel's module: imported by name, or loaded from its file under the name it had (a script
    run as `__main__`, an example or benchmark the tests load with `harness.load_script`)."""
    import importlib
    import importlib.util

    try:
        return importlib.import_module(entry["module"])
    except ModuleNotFoundError:
        if entry["module"] in sys.modules:
            return sys.modules[entry["module"]]
        spec = importlib.util.spec_from_file_location(entry["module"], entry["file"])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[entry["module"]] = module
        return module


def compile_entry(entry: dict) -> str | None:
    """Compile one entry into Triton's cache (in a worker process); None, or why it could not."""
    import types

    from triton.runtime.jit import JITFunction

    from .device_library import for_kernels
    from .nvshmem import find_device_library

    try:
        kernel = _module(entry)
        for part in entry["name"].split("."):
            kernel = getattr(kernel, part)
        data = json.loads(entry["specialization"])
        # The device library the ranks link on this machine: Triton keys it by its contents, not its
        # path. (libdevice is Triton's own and added back by Triton.)
        recorded = dict(data["options"].get("extern_libs") or ())
        data["options"]["extern_libs"] = [[name, for_kernels(find_device_library())] for name in recorded
                                          if name == "libnvshmem_device"]
        # Triton's compile alone: tridist's `_do_compile` also loads the module for NVSHMEM, which needs
        # a running world.
        kernel._do_compile = types.MethodType(JITFunction._do_compile, kernel)
        kernel.preload(json.dumps(data))
        return None
    except Exception as error:  # noqa: BLE001 - listed, and the entry dropped
        return f"{entry['module']}.{entry['name']}: {type(error).__name__}: {str(error).splitlines()[0][:200]}"


class CompileWatch:
    """Counts this process's compiles (`with watch:` around each); once they have taken `say_after_s`
    in all, says so while one is under way: once, on the job's first rank, with the count."""

    def __init__(self, say_after_s: float = SAY_AFTER_S):
        self._say_after_s = say_after_s
        self._lock = threading.Lock()
        self._compiled = 0
        self._spent = 0.0  # seconds of the finished compiles
        self._since = None  # when the compile under way started
        self._timer = None
        self._said = not first_rank()

    def __enter__(self):
        with self._lock:
            self._since = time.monotonic()
            if not self._said:
                self._timer = threading.Timer(max(0.0, self._say_after_s - self._spent), self._say)
                self._timer.daemon = True
                self._timer.start()
        return self

    def __exit__(self, *exc):
        with self._lock:
            self._spent += time.monotonic() - self._since
            self._since = None
            self._compiled += 1
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _say(self) -> None:
        with self._lock:
            if self._said or self._since is None:
                return
            self._said = True
            compiled, seconds = self._compiled, self._spent + time.monotonic() - self._since
        logger.info(f"compiling kernels for the GPU: {seconds:.0f} s so far, {compiled} done, one under way. Triton "
                    "caches them for the next runs, and `tridist precompile` compiles a job's kernels on every core "
                    "at once (docs/guide/running.md)")
