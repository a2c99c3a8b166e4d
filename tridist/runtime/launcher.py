"""`tridist run`: start N ranks of a script, on GPUs through torchrun or as emulated CPU ranks.

Emulated ranks are plain processes that share a fresh folder in /dev/shm for their heaps. If any
rank exits with an error, the launcher stops the others at once, so nobody waits for a dead peer.
"""
import os
import shutil
import signal
import subprocess
import sys
import time

from . import backend as _backend
from .emulator import make_shared_folder
from .nvshmem import SAFE_ENVIRONMENT

_GRACE_S = 5.0


def run(nproc: int, script: list[str], nnodes: int | None = None, backend: str | None = None) -> int:
    if nproc < 1:
        raise SystemExit("tridist run: -n must be at least 1")
    if nnodes is not None and (nnodes < 1 or nproc % nnodes):
        raise SystemExit(f"tridist run: --nnodes {nnodes} must divide -n {nproc}")
    backend = backend or _backend.BACKEND
    env = dict(os.environ, TRIDIST_BACKEND=backend, **SAFE_ENVIRONMENT)
    if nnodes is not None:
        env["TRIDIST_NNODES"] = str(nnodes)
    if backend == _backend.EMULATOR:
        return _run_emulated(nproc, script, env)
    return _run_torchrun(nproc, script, env)


def _run_torchrun(nproc: int, script: list[str], env: dict) -> int:
    import torch

    gpus = torch.cuda.device_count()
    if nproc > gpus:
        raise SystemExit(f"tridist run: -n {nproc} needs {nproc} GPUs but this host has {gpus}; use -n {gpus} or "
                         "fewer, or --backend emulator to run on the CPU")
    env.pop("TRITON_INTERPRET", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *script]
    return subprocess.call(command, env=env)


def _run_emulated(nproc: int, script: list[str], env: dict) -> int:
    folder = make_shared_folder("tridist-")
    env.update(TRITON_INTERPRET="1", TRIDIST_EMU_DIR=folder, WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc))
    ranks = []
    try:
        for rank in range(nproc):
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
            ranks.append(subprocess.Popen([sys.executable, *script], env=rank_env))
        return _supervise(ranks)
    except KeyboardInterrupt:
        _stop(ranks)
        return 130
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _supervise(ranks: list) -> int:
    """Wait for every rank; the first that fails takes the others down with it."""
    while True:
        codes = [r.poll() for r in ranks]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank, code = failed[0]
            print(f"tridist run: rank {rank} exited with code {code}; stopping the other ranks", file=sys.stderr)
            _stop(ranks)
            return code
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.05)


def _stop(ranks: list) -> None:
    for r in ranks:
        if r.poll() is None:
            r.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + _GRACE_S
    for r in ranks:
        try:
            r.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            r.kill()
            r.wait()
