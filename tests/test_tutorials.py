"""Every tutorial runs as its `Run:` line says, as a user would start it, and checks its own result
(the tutorials' format: docs/tutorials/index.md). These start their own processes, so they take
no world of the test pool: in the emulator each costs the start-up of its ranks, seconds each."""
import glob
import os
import re
import subprocess
import sys

import pytest

from .harness import backend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TUTORIALS = sorted(glob.glob(os.path.join(ROOT, "tutorials", "[0-9][0-9]-*.py")))
RUN = re.compile(r"^Run: `tridist run -n (\d+)(?: --nnodes (\d+))? (tutorials/[\w.-]+\.py)`$", re.MULTILINE)


def command(path: str) -> list[str]:
    """`tridist run` arguments of the tutorial's `Run:` line."""
    with open(path) as f:
        text = f.read()
    match = RUN.search(text)
    assert match, f"{os.path.basename(path)} needs a line 'Run: `tridist run -n N [--nnodes K] tutorials/...py`'"
    ranks, nodes, script = match.groups()
    assert script == os.path.relpath(path, ROOT), f"its Run: line names {script}"
    return ["run", "-n", ranks, *(["--nnodes", nodes] if nodes else []), script]


def run(args: list[str]) -> subprocess.CompletedProcess:
    ranks = int(args[2])
    if backend() == "nvshmem":
        import torch

        if torch.cuda.device_count() < ranks:
            pytest.skip(f"needs {ranks} GPUs")
    return subprocess.run([sys.executable, "-m", "tridist", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("path", TUTORIALS, ids=[os.path.basename(p)[:2] for p in TUTORIALS])
def test_tutorial_runs_and_checks_itself(path):
    result = run(command(path))
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]


def test_a_wrong_result_fails_the_tutorial(tmp_path):
    """Tutorial 01 with a producer that sends wrong data: its check must stop the run."""
    path = os.path.join(ROOT, "tutorials", "01-signals-and-waits.py")
    with open(path) as f:
        source = f.read()
    correct = "item = (1000 * i + offsets).to(tl.float32)"
    assert source.count(correct) == 1, "the line this test breaks has changed"
    broken = tmp_path / "01-broken.py"
    broken.write_text(source.replace(correct, "item = (1000 * i + offsets + 1).to(tl.float32)"))
    result = run(["run", "-n", "2", str(broken)])
    assert result.returncode != 0, "a tutorial whose result is wrong exited 0"
    assert "the items that arrived are not the items sent" in result.stdout + result.stderr
