"""Benchmark results: printed as a table, saved as JSON with the device, the date and the versions."""
import datetime
import json
import os
import platform

import torch
import triton


def environment() -> dict:
    info = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version()}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
        info["gpus"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
    return info


def table(rows: list[dict], columns: list[str]) -> str:
    def cell(value):
        return f"{value:.2f}" if isinstance(value, float) else str(value)

    widths = [max(len(c), *(len(cell(r.get(c, ""))) for r in rows)) for c in columns]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(cell(r.get(c, "")).rjust(w) for c, w in zip(columns, widths)) for r in rows]
    return "\n".join(lines)


def save(name: str, rows: list[dict], folder: str, extra: dict | None = None) -> str:
    env = environment()
    os.makedirs(folder, exist_ok=True)
    device = env.get("device", "cpu").replace(" ", "-").lower()
    path = os.path.join(folder, f"{name}-{device}x{env.get('gpus', 1)}-{env['date']}.json")
    with open(path, "w") as f:
        json.dump({"benchmark": name, **env, **(extra or {}), "rows": rows}, f, indent=1)
    return path
