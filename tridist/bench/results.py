"""Benchmark results: printed as a table, saved as JSON named after the benchmark, the device and
the date, recording the code and the versions that ran.

Files are named `<benchmark>-<device>x<ranks>-<date>.json`, the date as YEAR-MONTH-DAY (an
all-reduce on two H200s: `allreduce-h200x2-<date>.json`), with `-shared<K>` before the date where K ranks share each GPU; a second run of the same benchmark
on the same device and day adds `-2` (then `-3`, ...) instead of replacing the first, so that a
figure once cited keeps its file. Plots take the JSON's name with `.png`.
"""
import datetime
import glob
import importlib.metadata
import itertools
import json
import os
import pathlib
import platform
import re
import subprocess

import torch
import torch.distributed as dist
import triton

from .. import __version__
from ..runtime import config
from . import shared_gpu

CHECKOUT = pathlib.Path(__file__).resolve().parents[2]  # the repository root when tridist runs from a clone
NVSHMEM_WHEELS = ("nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12")
RUN_VARIABLE = "TRIDIST_BENCH_RUN"  # an id of one benchmark run, recorded in every JSON it saves


def tridist_commit() -> str | None:
    """The commit tridist runs from, with `-dirty` where tracked files differ from it; None outside a
    git checkout (an installed wheel: `environment()` records the version then)."""
    if not (CHECKOUT / ".git").exists():
        return None
    try:
        def git(*args):
            return subprocess.run(["git", "-C", str(CHECKOUT), *args], capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()

        commit = git("rev-parse", "HEAD")
        return commit + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _nvshmem_version() -> str | None:
    for wheel in NVSHMEM_WHEELS:
        try:
            return f"{wheel} {importlib.metadata.version(wheel)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def environment() -> dict:
    """Where and with what a benchmark ran: date, tridist (its commit in a checkout), torch, triton,
    python; the run id (RUN_VARIABLE) where one is set: benchmarks that read another's JSON (ag_gemm
    and gemm_rs read torch_fused's) take only that of the same run; on GPUs also the device, the GPUs
    and ranks, CUDA, NCCL and the NVSHMEM wheel."""
    info = {"date": datetime.date.today().isoformat(), "tridist": __version__}
    commit = tridist_commit()
    if commit:
        info["tridist_commit"] = commit
    info.update({"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()})
    if os.environ.get(RUN_VARIABLE):
        info["run"] = os.environ[RUN_VARIABLE]
    if (config.virtual_nodes() or 1) > 1:  # the ranks of one host split into nodes (TRIDIST_NNODES)
        info["virtual_nodes"] = config.virtual_nodes()
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
        info["gpus"] = torch.cuda.device_count()
        # ranks that ran the benchmark; name the file after them, not after the GPUs the machine has
        info["ranks"] = int(os.environ.get("WORLD_SIZE", info["gpus"]))
        info["cuda"] = torch.version.cuda
        if dist.is_nccl_available():
            info["nccl"] = ".".join(str(part) for part in torch.cuda.nccl.version())
        nvshmem = _nvshmem_version()
        if nvshmem:
            info["nvshmem"] = nvshmem
    return info


def device_tag(device: str | None) -> str:
    """The device's short name in file names: its name's first word that holds a digit, up to a dash
    ("NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA A100-SXM4-80GB" -> "a100"); "cpu" without a GPU."""
    if not device:
        return "cpu"
    words = [word for word in device.split() if re.search(r"\d", word)] or device.split()[-1:]
    return words[0].split("-")[0].lower()


def title(what: str, env: dict | None = None) -> str:
    """A plot's title: what it shows, then the device and the date it was measured on."""
    env = env or environment()
    return f"{what}: {env.get('device', 'CPU')}, {env['date']}"


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest |actual - expected| over largest |expected|, in fp32 on `expected`'s device: rounding
    to 16 or 8 bits errs in proportion to the values, so the largest one sets the scale."""
    expected = expected.float()
    return ((actual.float().to(expected.device) - expected).abs().max() / expected.abs().max()).item()


def print_row(row: dict) -> None:
    """One result as it is made: `key value` pairs on one line, floats to three digits."""
    print("  " + ", ".join(f"{key} {value:.3g}" if isinstance(value, float) else f"{key} {value}"
                           for key, value in row.items()), flush=True)


def error_line(error: BaseException) -> str:
    """An error in one line, for a result's row or a skipped baseline's report (a tile config this
    GPU cannot compile, launch or get right; a PyTorch op it lacks): its type and the first line of
    its message, at most 160 characters of it."""
    return f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"


def table(rows: list[dict], columns: list[str]) -> str:
    def cell(value):
        return f"{value:.2f}" if isinstance(value, float) else str(value)

    widths = [max(len(c), *(len(cell(r.get(c, ""))) for r in rows)) for c in columns]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(cell(r.get(c, "")).rjust(w) for c, w in zip(columns, widths)) for r in rows]
    return "\n".join(lines)


def file_name(name: str, env: dict, ranks: int | None = None, repeat: int = 1,
              ranks_per_gpu: int | None = None) -> str:
    """`<name>-<device>x<ranks>-<date>.json` for results measured in `env` (`environment()`), with
    `-<N>nodes` before the date where the ranks were split into N virtual nodes, `-shared<K>` where K
    ranks shared each GPU (`ranks_per_gpu`; None: as this process's environment says,
    `shared_gpu.fields`), and `-<repeat>` after it for the day's second and later runs."""
    if ranks_per_gpu is None:
        ranks_per_gpu = shared_gpu.fields().get("ranks_per_gpu", 1)
    nodes = f"-{env['virtual_nodes']}nodes" if "virtual_nodes" in env else ""
    shared = f"-shared{ranks_per_gpu}" if ranks_per_gpu > 1 else ""
    again = f"-{repeat}" if repeat > 1 else ""
    return (f"{name}-{device_tag(env.get('device'))}x{ranks or env.get('ranks', 1)}{nodes}{shared}-{env['date']}"
            f"{again}.json")


def save(name: str, rows: list[dict], folder: str, extra: dict | None = None) -> str:
    """Writes the JSON under the first name of `file_name`'s that is free in `folder`, and returns its
    path. Where ranks share a GPU it records so (`shared_gpu.fields`) and its name says "shared", so
    that it is never taken for a result measured on GPUs of their own."""
    env = environment()
    payload = {"benchmark": name, **env, **shared_gpu.fields(), **(extra or {}), "rows": rows}
    return write_new(folder, name, env, payload)


def write_new(folder: str, name: str, env: dict, payload: dict, ranks: int | None = None,
              ranks_per_gpu: int | None = None) -> str:
    """Writes `payload` as JSON under the first of `file_name`'s names (repeat 1, 2, ...) that no file
    in `folder` has, and returns its path. The file is created exclusively, so two runs that end at
    once on one machine (a job per GPU pair) each keep their own file."""
    os.makedirs(folder, exist_ok=True)
    for repeat in itertools.count(1):
        path = os.path.join(folder, file_name(name, env, ranks=ranks, repeat=repeat, ranks_per_gpu=ranks_per_gpu))
        try:
            with open(path, "x") as f:
                json.dump(payload, f, indent=1)
            return path
        except FileExistsError:
            continue


def latest(name: str, folder: str, **fields) -> tuple[str, dict] | None:
    """(path, contents) of the newest JSON that `save(name, ...)` left in `folder` in this run (the
    same RUN_VARIABLE, which must be set) on this device today with these `fields` (e.g.
    world_size=2), or None: numbers measured in another run, elsewhere, another day or on other
    ranks are not comparable with this run's."""
    env = environment()
    if "run" not in env:
        return None
    wanted = {"benchmark": name, "run": env["run"], "date": env["date"], "device": env.get("device"),
              "gpus": env.get("gpus"), **fields}
    found = []
    for path in glob.glob(os.path.join(folder, f"{name}-*.json")):
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue  # a file being written, or not ours: not a result to compare with
        if all(data.get(key) == value for key, value in wanted.items()):
            found.append((os.path.getmtime(path), path, data))
    if not found:
        return None
    _, path, data = max(found, key=lambda entry: entry[0])
    return path, data
