"""`tridist run` and `tridist info`, as a user runs them (these start their own processes)."""
import os
import subprocess
import sys
import time

import pytest

from .harness import backend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tridist_cli(*args, env=None, timeout=300):
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "tridist", *args], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, **(env or {})}, timeout=timeout)
    return result, time.monotonic() - started


def gpus() -> int:
    import torch

    return torch.cuda.device_count() if backend() == "nvshmem" else 0


def test_example_runs():
    ranks = str(min(2, gpus())) if backend() == "nvshmem" else "3"
    result, _ = tridist_cli("run", "-n", ranks, "examples/allgather.py")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("all-gather correct") == int(ranks)


def test_dead_rank_ends_the_job():
    if backend() == "nvshmem" and gpus() < 2:
        pytest.skip("needs 2 GPUs")
    result, elapsed = tridist_cli("run", "-n", "2", "tests/scripts/rank_dies.py", env={"TRIDIST_WAIT_TIMEOUT": "600"})
    assert result.returncode != 0
    assert elapsed < 120, f"the surviving rank was left waiting for {elapsed:.0f} s"


def test_bounded_wait_names_rank_kernel_and_signal():
    env = {"TRIDIST_DEBUG": "1", "TRIDIST_WAIT_TIMEOUT": "1"}
    result, _ = tridist_cli("run", "-n", "1", "tests/scripts/wait_forever.py", env=env)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    if backend() == "emulator":
        for part in ("WaitTimeoutError", "rank 0", "never_signalled_kernel", "expected == 1", "observed [0]"):
            assert part in output, (part, output[-3000:])
    else:
        for part in ("tridist wait timed out", "never_signalled_kernel"):
            assert part in output, (part, output[-3000:])


def test_more_ranks_than_gpus_is_refused():
    if backend() != "nvshmem":
        pytest.skip("the emulator runs any number of ranks")
    result, _ = tridist_cli("run", "-n", str(gpus() + 1), "examples/allgather.py")
    assert result.returncode != 0 and "GPUs but this host has" in result.stderr


def test_info():
    result, _ = tridist_cli("info")
    assert result.returncode == 0, result.stderr
    assert f"tridist backend: {backend()}" in result.stdout and "to fix:" in result.stdout
