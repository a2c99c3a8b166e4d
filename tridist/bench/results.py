"""Benchmark results: printed as a table, saved as JSON with the device, the date and the versions."""
import datetime
import glob
import json
import os
import platform

import torch
import triton

from . import shared_gpu

RUN_VARIABLE = "TRIDIST_BENCH_RUN"  # an id of one benchmark run, recorded in every JSON it saves


def environment() -> dict:
    """Date, versions, device, and the run id (RUN_VARIABLE) where one is set: benchmarks that read
    another's JSON (ag_gemm and gemm_rs read torch_fused's) take only that of the same run."""
    info = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version()}
    if os.environ.get(RUN_VARIABLE):
        info["run"] = os.environ[RUN_VARIABLE]
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
        info["gpus"] = torch.cuda.device_count()
        # ranks that ran the benchmark; name the file after them, not after the GPUs the machine has
        info["ranks"] = int(os.environ.get("WORLD_SIZE", info["gpus"]))
        info["cuda"] = torch.version.cuda
    return info


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest |actual - expected| over largest |expected|, in fp32 on `expected`'s device: rounding
    to 16 or 8 bits errs in proportion to the values, so the largest one sets the scale."""
    expected = expected.float()
    return ((actual.float().to(expected.device) - expected).abs().max() / expected.abs().max()).item()


def table(rows: list[dict], columns: list[str]) -> str:
    def cell(value):
        return f"{value:.2f}" if isinstance(value, float) else str(value)

    widths = [max(len(c), *(len(cell(r.get(c, ""))) for r in rows)) for c in columns]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(cell(r.get(c, "")).rjust(w) for c, w in zip(columns, widths)) for r in rows]
    return "\n".join(lines)


def file_name(name: str, env: dict, ranks: int | None = None) -> str:
    """`<name>-<device>x<ranks>-<date>.json` for results measured in `env` (`environment()`), with
    `-shared<K>` before the date where K ranks share each GPU (`shared_gpu.fields`)."""
    device = env.get("device", "cpu").replace(" ", "-").lower()
    sharing = shared_gpu.fields()
    shared = f"-shared{sharing['ranks_per_gpu']}" if sharing else ""
    return f"{name}-{device}x{ranks or env.get('ranks', 1)}{shared}-{env['date']}.json"


def save(name: str, rows: list[dict], folder: str, extra: dict | None = None) -> str:
    """Writes the JSON; where ranks share a GPU it records so (`shared_gpu.fields`) and its name says
    "shared", so that it never replaces a result measured on GPUs of their own."""
    env = environment()
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, file_name(name, env))
    with open(path, "w") as f:
        json.dump({"benchmark": name, **env, **shared_gpu.fields(), **(extra or {}), "rows": rows}, f, indent=1)
    return path


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
