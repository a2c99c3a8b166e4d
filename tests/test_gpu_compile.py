"""Every GPU kernel compiles for Hopper (sm_90) with NVSHMEM linked, checked on any machine."""
import json
import os
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
    """tests.precompile's log (kept by the GPU test ranks): one JSON line per compile Triton announces,
    read back once each, lines cut short by a killed run skipped. (That `preload` of a logged compile
    gives the launch's own Triton cache key was checked on this machine with a faked driver: the same
    cache entries for two kernels, each in two specialisations.)"""
    from triton import knobs
    from triton.runtime.jit import JitFunctionInfo

    from . import precompile

    log = tmp_path / "compile-log.jsonl"
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    precompile.record(str(log))

    def kernel():
        pass

    jitted = types.SimpleNamespace(fn=kernel)  # what the hook reads of a JITFunction

    for data in ('{"name": "a"}', '{"name": "b"}', '{"name": "a"}'):
        compiled = {"key": "k", "specialization_data": data}
        assert not knobs.runtime.jit_cache_hook(key="k", repr="r", fn=JitFunctionInfo(__name__, "kernel", jitted),
                                                 compile=compiled, is_manual_warmup=False, already_compiled=False)
    with open(log, "a") as f:
        f.write('{"mode": "debug=0", "module": "cut sh')
    entries = precompile.read(str(log))
    assert [json.loads(e["specialization"])["name"] for e in entries] == ["a", "b"]
    assert entries[0]["module"] == __name__ and entries[0]["name"] == "kernel" and entries[0]["file"] == __file__
    assert entries[0]["mode"] == precompile._mode()
