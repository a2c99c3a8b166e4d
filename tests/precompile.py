"""Compiles, on every core at once, the GPU kernels an earlier run of the test suite compiled one by
one: `python -m tests.precompile LOG`.

Kernels with NVSHMEM linked take seconds each to compile, and the GPU test suite launches a few
hundred specialisations of them, one after the other: compilation took most of every GPU run.
Triton's cache key covers a kernel's source and what only a launch knows: its argument types, the
arguments Triton specialised (ints equal to 1, sizes and pointers divisible by 16), constexprs and
options. So the test ranks record each compile as Triton describes it to its `jit_cache_hook`
(`record`, switched on by TRIDIST_COMPILE_LOG in tests/harness.py, which scripts/gpu_suite.sh sets),
and this module compiles those descriptions again through Triton's own `JITFunction.preload`, a
process per core, into the Triton cache, where the next launches find them. A kernel whose source
changed since the log was written is compiled anew, in parallel, with the specialisations it had;
an entry that no longer fits its kernel (renamed, other arguments) is dropped from the log.

Entries are kept per mode (TRIDIST_DEBUG and TRIDIST_WAIT_TIMEOUT are constexprs of the kernels):
only those of this process's mode are compiled. `tests.gpu_compile`, by contrast, compiles
hand-written cases on any machine to catch compile errors; its keys are not the launches' keys.
"""
import concurrent.futures
import json
import multiprocessing
import os
import sys
import time

LOG = "TRIDIST_COMPILE_LOG"


def _mode() -> str:
    from tridist.runtime import config

    return f"debug={int(config.debug())} timeout={config.wait_timeout_s():g}"


def record(path: str) -> None:
    """Append each kernel this process compiles (or finds in Triton's cache) to `path`, one JSON line
    each; ranks of one world append to the same file (each line is one write)."""
    from triton import knobs

    mode = _mode()

    def hook(*, fn, compile, **_):
        line = json.dumps({"mode": mode, "module": fn.module, "name": fn.name,
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


def _module(entry: dict):
    """The kernel's module: imported by name, or loaded from its file under the name it had (an
    example or benchmark script the tests load with `harness.load_script`)."""
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


def _compile(entry: dict) -> str | None:
    """Compile one entry into Triton's cache (in a worker process); None, or why it could not."""
    import types

    from triton.runtime.jit import JITFunction

    from tridist.runtime.device_library import for_kernels
    from tridist.runtime.nvshmem import find_device_library

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


def precompile(path: str, workers: int | None = None) -> tuple[int, list[str]]:
    """Compile the entries of `path` of this process's mode; rewrite the log without duplicates and
    without the entries that failed. Returns (entries compiled, failures)."""
    entries = read(path)
    mode = _mode()
    mine = [e for e in entries if e["mode"] == mode]
    for entry in mine:  # once here, so that the forked workers inherit the modules
        try:
            _module(entry)
        except Exception:  # noqa: BLE001 - the worker says why
            pass
    # The cut device library once, here, before the workers fork (runtime/device_library.py).
    from tridist.runtime.device_library import for_kernels
    from tridist.runtime.nvshmem import find_device_library

    for_kernels(find_device_library())
    # None of the workers has started CUDA before it forks: the parent never does.
    with concurrent.futures.ProcessPoolExecutor(workers or os.cpu_count(),
                                                mp_context=multiprocessing.get_context("fork")) as pool:
        outcomes = list(pool.map(_compile, mine))
    failed = {id(e) for e, outcome in zip(mine, outcomes) if outcome}
    kept = [e for e in entries if id(e) not in failed]
    temporary = path + ".tmp"
    with open(temporary, "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in kept)
    os.replace(temporary, path)
    return len(mine) - len(failed), [outcome for outcome in outcomes if outcome]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(f"usage: python -m tests.precompile LOG   (the file {LOG} named in a test run)", file=sys.stderr)
        return 2
    os.environ.setdefault("TRIDIST_BACKEND", "nvshmem")
    started = time.monotonic()
    compiled, failures = precompile(argv[0])
    for failure in failures:
        print(f"dropped {failure}")
    print(f"precompiled {compiled} kernel specialisations on {os.cpu_count()} cores in "
          f"{time.monotonic() - started:.0f} s ({_mode()}; {len(failures)} dropped)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
