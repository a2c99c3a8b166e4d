"""Every GPU kernel compiles for Hopper (sm_90) with NVSHMEM linked, checked on any machine."""
import json
import os
import re
import subprocess
import sys
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("debug", ["0", "1"])
def test_kernels_compile_for_hopper(debug):
    pytest.importorskip("nvidia.nvshmem", reason="the NVSHMEM wheel (pip install -e .[test]) holds the device library")
    env = {**os.environ, "TRIDIST_DEBUG": debug}
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, "-m", "tests.gpu_compile"], cwd=ROOT, capture_output=True, text=True,
                            env=env, timeout=1200)
    failures = [line for line in result.stdout.splitlines() if line.startswith("FAIL")]
    assert result.returncode == 0 and not failures, "\n".join(failures) or result.stderr[-3000:]


def test_compile_log_records_each_compile_once(tmp_path, monkeypatch):
    """The compile log (TRIDIST_COMPILE_LOG, runtime/compiles.py): one JSON line per compile Triton
    announces, read back once each, lines cut short by a killed run skipped. (That `preload` of a
    logged compile gives the launch's own Triton cache key was checked with a faked driver: the same
    cache entries for two kernels, each in two specialisations.)"""
    from triton import knobs
    from triton.runtime.jit import JitFunctionInfo

    from tridist.runtime import compiles

    log = tmp_path / "compile-log.jsonl"
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    compiles.record(str(log))

    def kernel():
        pass

    jitted = types.SimpleNamespace(fn=kernel)  # what the hook reads of a JITFunction

    for data in ('{"name": "a"}', '{"name": "b"}', '{"name": "a"}'):
        compiled = {"key": "k", "specialization_data": data}
        assert not knobs.runtime.jit_cache_hook(key="k", repr="r", fn=JitFunctionInfo(__name__, "kernel", jitted),
                                                 compile=compiled, is_manual_warmup=False, already_compiled=False)
    with open(log, "a") as f:
        f.write('{"mode": "debug=0", "module": "cut sh')
    entries = compiles.read(str(log))
    assert [json.loads(e["specialization"])["name"] for e in entries] == ["a", "b"]
    assert entries[0]["module"] == __name__ and entries[0]["name"] == "kernel" and entries[0]["file"] == __file__
    assert entries[0]["mode"] == compiles.mode()


def fake_compile(entry: dict) -> str | None:
    """`compiles.compile_entry` for test_precompile_compiles_this_mode_and_drops_failures (in a worker)."""
    return "it broke" if entry["name"] == "broken" else None


def test_precompile_compiles_this_mode_and_drops_failures(tmp_path, monkeypatch, caplog):
    """`tridist precompile LOG` compiles the entries of this process's mode (on a process each) and
    rewrites the log without the duplicates and the failures; the compiles themselves are Triton's
    `preload`, which needs a GPU driver (checked on GPUs by scripts/gpu_suite.sh)."""
    from tridist.runtime import compiles, device_library

    monkeypatch.setattr(compiles, "compile_entry", fake_compile)
    monkeypatch.setattr(device_library, "for_kernels", lambda whole: whole)
    monkeypatch.setattr("tridist.runtime.nvshmem.find_device_library", lambda: "libnvshmem_device.bc")
    log = tmp_path / "log.jsonl"
    other = "debug=1 timeout=1"
    lines = [{"mode": compiles.mode(), "module": "json", "name": name, "file": "", "specialization": name}
             for name in ("loads", "broken", "loads", "dumps")]
    lines.append({"mode": other, "module": "json", "name": "broken", "file": "", "specialization": "x"})
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with caplog.at_level("INFO", logger="tridist"):
        compiled, failures = compiles.precompile(str(log), workers=2)
    assert (compiled, failures) == (2, ["it broke"])
    assert "compiling 3 kernels of" in caplog.text
    assert [(e["mode"], e["name"]) for e in compiles.read(str(log))] == [(compiles.mode(), "loads"),
                                                                       (compiles.mode(), "dumps"), (other, "broken")]


def test_a_long_compile_is_said_once_on_the_first_rank(monkeypatch, caplog):
    import time

    from tridist.runtime import compiles

    monkeypatch.setenv("RANK", "0")
    watch = compiles.CompileWatch(say_after_s=0.3)
    with caplog.at_level("INFO", logger="tridist"):
        with watch:
            pass  # quick: a kernel found in Triton's cache
        with watch:
            time.sleep(0.6)
        with watch:
            time.sleep(0.4)
    said = [r.getMessage() for r in caplog.records if "compiling kernels" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("compiling kernels for the GPU: 0 s so far, 1 done, one under way"), said
    monkeypatch.setenv("RANK", "1")
    caplog.clear()
    watch = compiles.CompileWatch(say_after_s=0.1)
    with caplog.at_level("INFO", logger="tridist"):
        with watch:
            time.sleep(0.3)
    assert not caplog.records


def _library():
    pytest.importorskip("nvidia.nvshmem", reason="the NVSHMEM wheel (pip install -e .[test]) holds the device library")
    from tridist.runtime.nvshmem import find_device_library

    return find_device_library()


def test_cut_device_library_links_the_same_code():
    """A kernel compiled against the cut library has the same PTX as against the whole one, in far
    less time (runtime/device_library.py); `tests.gpu_compile` then compiles every case against it."""
    _library()
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, "-m", "tests.gpu_compile", "--compare", "all_gather_push_kernel",
                             "ll_ping_pong_kernel"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    lines = result.stdout.splitlines()
    assert result.returncode == 0 and len(lines) == 2 and all(line.startswith("same PTX") for line in lines), \
        result.stdout + result.stderr[-3000:]
    for line in lines:  # "... whole library W s, cut C s"
        whole, cut = (float(word) for word in re.findall(r"([0-9.]+) s", line))
        assert cut < whole / 2, line


def test_cut_device_library_keeps_what_the_language_calls():
    from triton import knobs

    from tridist.runtime import device_library

    whole = _library()
    cut = device_library.for_kernels.__wrapped__(whole)  # in Triton's cache, where the compiles above left it
    assert cut.startswith(knobs.cache.dir) and os.path.getsize(cut) < os.path.getsize(whole) // 20
    assert device_library.defined_functions(cut, device_library.FUNCTIONS) == device_library.FUNCTIONS
    assert device_library.for_kernels.__wrapped__(whole) == cut  # cut once, then found in the cache


def test_device_library_falls_back_to_the_whole_one(tmp_path, monkeypatch):
    """A cut that fails leaves the whole library, with one warning for the job (its first rank says
    it); TRIDIST_DEVICE_LIBRARY=whole asks for the whole library and skips the cut."""
    import warnings

    from tridist.runtime import device_library

    whole = _library()
    monkeypatch.setattr("triton.knobs.cache.dir", str(tmp_path))

    def unreadable(*_):
        raise ValueError(f"Failed to parse library at {whole}")

    monkeypatch.setattr(device_library, "cut", unreadable)
    monkeypatch.setenv("RANK", "0")
    with pytest.warns(UserWarning, match=r"cutting NVSHMEM's device library failed \(ValueError: Failed to parse.*"
                                         r"TRIDIST_DEVICE_LIBRARY=whole"):
        assert device_library.for_kernels.__wrapped__(whole) == whole
    monkeypatch.setenv("RANK", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert device_library.for_kernels.__wrapped__(whole) == whole
    monkeypatch.setenv("TRIDIST_DEVICE_LIBRARY", "whole")
    assert device_library.for_kernels.__wrapped__(whole) == whole
    monkeypatch.setenv("TRIDIST_DEVICE_LIBRARY", "small")
    with pytest.raises(ValueError, match="TRIDIST_DEVICE_LIBRARY='small': expected cut or whole"):
        device_library.for_kernels.__wrapped__(whole)


def test_the_language_calls_only_listed_functions():
    """Every NVSHMEM function named in the GPU lowering is one the cut library keeps."""
    from tridist.runtime.device_library import FUNCTIONS

    with open(os.path.join(ROOT, "tridist", "language", "_gpu.py")) as f:
        named = set(re.findall(r'"(nvshmemx?_[a-z0-9_]+)"', f.read()))
    assert named and named <= FUNCTIONS, sorted(named - FUNCTIONS)
