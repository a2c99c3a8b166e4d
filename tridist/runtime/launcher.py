"""`tridist run`: start N ranks of a script, on GPUs or as emulated CPU ranks, and watch them.

The launcher starts every rank itself, with the environment torchrun gives its workers (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; on GPUs NVLink multicast off),
so that one supervisor serves both backends, and a script that starts torch.distributed itself
(`dist.init_process_group`, a DeviceMesh) before `tridist.init()` runs as under torchrun. (torchrun's own output options write the ranks'
output to files, and its exits name no rank we could print; piping the ranks ourselves gives both.)
- Output: each line a rank writes, on stdout or stderr, is passed on whole with the rank in front,
  `[rank 3] ...`, so that ranks printing at once never mix within a line; a last line without its
  newline is passed on when the rank ends. `prefix=False` (`--no-prefix`) lets the ranks write to
  the terminal directly.
- Failures: the first rank that fails or dies (a signal, SIGKILL included) is named, and the others
  are stopped (SIGTERM, then SIGKILL after a grace period), so that nobody waits for a dead peer
  and no rank process outlives the job. A rank that fails with an exception leaves its first line in
  a folder of the job's (TRIDIST_FAILURES, `world.mark_failed`), with the peer whose failure it
  followed, if any; the job's last line names the first rank that failed and quotes that line,
  which the tracebacks of the ranks that failed in turn would otherwise bury. Ctrl-C and SIGTERM to the launcher stop them the same way,
  naming the ranks stopped, with no traceback: the ranks ignore Ctrl-C (the terminal sends it to
  every process of the job), and a second signal while they stop is ignored.
- Sharing GPUs (`ranks_per_gpu` K, `runtime/sharing.py`): K ranks on each GPU, each with its MPS
  share of the SMs; CUDA MPS must run, and `start_mps` starts a daemon for the job and quits it
  however the job ends. For correctness and debugging, not speed (docs/guide/one-gpu.md).
Emulated ranks share a fresh folder in /dev/shm for their heaps; `ranks_per_gpu` and `start_mps`
change nothing there.
"""
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from . import backend as _backend
from . import config, mps, sharing
from .emulator import make_shared_folder
from .log import logger
from .nvshmem import SAFE_ENVIRONMENT

_GRACE_S = 5.0  # a stopped rank's time to exit after SIGTERM, before SIGKILL
_KILLED_S = 30.0  # how long a rank may take to vanish after SIGKILL (it may be inside the driver)
_DRAIN_S = 2.0  # how long the output of a finished rank may take to arrive


class _Terminated(BaseException):
    """The launcher got SIGTERM: it stops the ranks as for Ctrl-C."""


def run(nproc: int, script: list[str], nnodes: int | None = None, backend: str | None = None,
        ranks_per_gpu: int | None = None, start_mps: bool = False, prefix: bool = True, module: bool = False) -> int:
    """Start `nproc` ranks of `python *script` (`python -m *script` with `module`) and return the job's
    exit code (see the module docstring). `ranks_per_gpu` defaults to TRIDIST_RANKS_PER_GPU, else 1."""
    if nproc < 1:
        raise SystemExit("tridist run: -n must be at least 1")
    if nnodes is not None and (nnodes < 1 or nproc % nnodes):
        raise SystemExit(f"tridist run: --nnodes {nnodes} must divide -n {nproc}")
    if ranks_per_gpu is not None and ranks_per_gpu < 1:
        raise SystemExit(f"tridist run: --ranks-per-gpu must be at least 1, got {ranks_per_gpu}")
    backend = backend or _backend.BACKEND
    env = dict(os.environ, TRIDIST_BACKEND=backend, **SAFE_ENVIRONMENT)
    if nnodes is not None:
        env["TRIDIST_NNODES"] = str(nnodes)
    if prefix:
        env.setdefault("PYTHONUNBUFFERED", "1")  # lines arrive as they are printed, and none is lost to a kill
    command = [sys.executable, *(["-m"] if module else []), *script]
    if backend == _backend.EMULATOR:
        folder = make_shared_folder("tridist-")
        env.update(TRITON_INTERPRET="1", TRIDIST_EMU_DIR=folder)
        try:
            return launch([command] * nproc, rank_environments(nproc, env, _free_port()), prefix)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    return _run_on_gpus(nproc, command, env, ranks_per_gpu, start_mps, prefix)


def gpu_problem(nproc: int, gpus: int, ranks_per_gpu: int) -> str | None:
    """Why `nproc` ranks, `ranks_per_gpu` to a GPU, cannot run on `gpus` GPUs; None when they can."""
    needed = sharing.gpus_needed(nproc, ranks_per_gpu)
    if needed <= gpus:
        return None
    if gpus == 0:
        return f"-n {nproc} needs GPUs but this host has none; use --backend emulator to run on the CPU"
    if ranks_per_gpu == 1:
        return (f"-n {nproc} needs {nproc} GPUs but this host has {gpus}; use -n {gpus} or fewer, "
                f"--ranks-per-gpu {-(-nproc // gpus)} to share each GPU between ranks (CUDA MPS: for "
                "correctness and debugging, not speed), or --backend emulator to run on the CPU")
    return (f"-n {nproc} with --ranks-per-gpu {ranks_per_gpu} needs {needed} GPUs but this host has {gpus}; use "
            f"-n {gpus * ranks_per_gpu} or fewer, or more ranks per GPU")


def rank_environments(nproc: int, env: dict, master_port: int | None = None) -> list[dict]:
    """Each rank's environment: `env` and what torchrun would set for one host of `nproc` ranks."""
    common = dict(env, WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", ROLE_WORLD_SIZE=str(nproc))
    if master_port is not None:
        common.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port))
    return [dict(common, RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank)) for rank in range(nproc)]


def _run_on_gpus(nproc: int, command: list[str], env: dict, ranks_per_gpu: int | None, start_mps: bool,
                 prefix: bool) -> int:
    import torch

    per_gpu = ranks_per_gpu or config.ranks_per_gpu()
    gpus = torch.cuda.device_count()
    problem = gpu_problem(nproc, gpus, per_gpu)
    if problem:
        raise SystemExit(f"tridist run: {problem}")
    env.pop("TRITON_INTERPRET", None)
    env.pop("TRIDIST_RANKS_PER_GPU", None)
    env.update(sharing.rank_environment(nproc, per_gpu))
    env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: N ranks of one host must not each take every core
    daemon = None
    if sharing.shares_gpu(nproc, per_gpu):
        found = mps.status(env)
        share = (f"{nproc} ranks on {sharing.gpus_needed(nproc, per_gpu)} GPU(s), "
                 f"{sharing.mps_percentage(nproc, per_gpu)}% of the SMs each")
        if not found.running and not (start_mps and found.installed):
            raise SystemExit(f"tridist run: {share} need CUDA MPS (NVSHMEM refuses ranks that share a GPU "
                             f"without it): {mps.missing_message(found)}")
        if found.running:
            logger.info(f"{share}, through the MPS control daemon in {found.pipe_directory}")
        else:
            try:
                daemon = mps.Daemon(env)
            except (OSError, RuntimeError, subprocess.TimeoutExpired) as error:
                raise SystemExit(f"tridist run: --start-mps: {error}") from None
            env.update(daemon.env)
            logger.info(f"{share}; started an MPS control daemon for this job ({daemon.pipe_directory})")
    try:
        return launch([command] * nproc, rank_environments(nproc, env, _free_port()), prefix)
    finally:
        if daemon is not None:
            trouble = daemon.stop()
            if trouble:
                logger.warning(trouble)
            else:
                logger.info("stopped the MPS control daemon")


def _free_port() -> int:
    """A free port for rank 0's TCP store, drawn at random below the range the system hands out
    to sockets that ask for any port. A port from that range, free when checked here, can be taken
    before rank 0 binds it by any socket another job opens meanwhile (NCCL's and NVSHMEM's
    bootstraps open several): two test jobs at once failed so, with EADDRINUSE."""
    first_ephemeral = _first_ephemeral_port()
    draw = random.SystemRandom()
    tries = [draw.randrange(10000, first_ephemeral) for _ in range(64)] if first_ephemeral > 10000 else []
    for port in tries + [0]:  # 0: any port, as a last resort
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise SystemExit("tridist run: no TCP port could be bound on 127.0.0.1 for the ranks' rendezvous")


def _first_ephemeral_port() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def launch(commands: list[list[str]], envs: list[dict], prefix: bool = True, out=None, err=None) -> int:
    """Start rank i as `commands[i]` with `envs[i]`, pass its output on (prefixed) to the binary
    streams `out` and `err` (default this process's stdout and stderr), and supervise the ranks."""
    sys.stdout.flush()
    sys.stderr.flush()
    output = _Output(out or sys.stdout.buffer, err or sys.stderr.buffer, prefix)
    failures = tempfile.mkdtemp(prefix="tridist-failures-")
    envs = [dict(env, TRIDIST_FAILURES=failures) for env in envs]
    ranks = []
    code = 0
    previous = _on_sigterm()
    try:
        # The ranks start with Ctrl-C ignored (an ignored signal stays ignored in a child): the
        # terminal sends it to every process of the job, and each rank would print a traceback of
        # its own. The launcher gets it and stops them.
        with _ignoring(signal.SIGINT):
            for rank, (command, env) in enumerate(zip(commands, envs)):
                pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE} if prefix else {}
                ranks.append(subprocess.Popen(command, env=env, **pipes))
                output.follow(rank, ranks[-1])
        code = _supervise(ranks, output)
        return code
    except KeyboardInterrupt:
        output.say(f"tridist run: interrupted (Ctrl-C){_stopping(ranks)}")
        return 128 + signal.SIGINT
    except _Terminated:
        output.say(f"tridist run: terminated (SIGTERM){_stopping(ranks)}")
        return 128 + signal.SIGTERM
    finally:
        with _ignoring(signal.SIGINT, signal.SIGTERM):  # a second one would cut the stopping short
            _stop(ranks, output)
            output.drain()
            first = first_failure(failures) if code else None
            if first is not None:
                output.say(f"tridist run: rank {first[0]} failed first: {first[1]}")
            shutil.rmtree(failures, ignore_errors=True)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def first_failure(folder: str) -> tuple[int, str] | None:
    """The first rank that failed of its own and its error's first line, from the ranks' records in
    `folder` (`world.mark_failed`); None where every record is of a rank that failed because a peer
    had (that peer died without one: killed by a signal, say, which the job's verdict names first),
    or there is none."""
    own = []
    for name in os.listdir(folder):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            with open(os.path.join(folder, name)) as f:
                record = json.load(f)
            if record["after"] is None:
                own.append((int(record["failed_at"]), int(name), str(record["error"])))
    return min(own)[1:] if own else None


def _stopping(ranks: list) -> str:
    """'; stopping ranks 0, 2': those of `ranks` still running."""
    running = [str(rank) for rank, r in enumerate(ranks) if r.poll() is None]
    return f"; stopping rank{'s' if len(running) > 1 else ''} {', '.join(running)}" if running else ""


@contextlib.contextmanager
def _ignoring(*signals):
    """Ignore `signals` in this process for the block (only the main thread may change handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {number: signal.signal(number, signal.SIG_IGN) for number in signals}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _on_sigterm():
    """Make SIGTERM stop the ranks as Ctrl-C does; the previous handler (None off the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def terminate(signum, frame):
        raise _Terminated()

    return signal.signal(signal.SIGTERM, terminate)


def describe_exit(code: int) -> str:
    """'exited with code 3', 'was killed by SIGKILL' (Popen's negative codes are signals)."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"was killed by {name}"


def _supervise(ranks: list, output: "_Output") -> int:
    """Wait for every rank; the first that fails takes the others down with it."""
    while True:
        codes = [r.poll() for r in ranks]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            # A rank killed by a signal first: its peers may fail in turn as they notice, at the same poll.
            failed.sort(key=lambda entry: (entry[1] > 0, entry[0]))
            output.drain([rank for rank, _ in failed])  # their last words (a traceback) before the verdict
            verdicts = ", ".join(f"rank {rank} {describe_exit(code)}" for rank, code in failed)
            output.say(f"tridist run: {verdicts}{_stopping(ranks)}")
            code = failed[0][1]
            return code if code > 0 else 128 - code
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.05)


def _stop(ranks: list, output: "_Output") -> None:
    """SIGTERM every rank still running, SIGKILL those alive after the grace period, and reap them all."""
    for r in ranks:
        if r.poll() is None:
            r.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + _GRACE_S
    for r in ranks:
        try:
            r.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            r.kill()
    for rank, r in enumerate(ranks):
        try:
            r.wait(timeout=_KILLED_S)
        except subprocess.TimeoutExpired:
            output.say(f"tridist run: rank {rank} (pid {r.pid}) is still there {_KILLED_S:.0f} s after SIGKILL")


class _Output:
    """Passes each rank's output on in whole lines, its rank in front; one lock, so that lines of
    different ranks (and the launcher's own messages) never mix within a line."""

    def __init__(self, out, err, prefix: bool):
        self._out, self._err, self._prefix = out, err, prefix
        self._lock = threading.Lock()
        self._threads: dict[int, list[threading.Thread]] = {}

    def follow(self, rank: int, process: subprocess.Popen) -> None:
        if not self._prefix:
            return
        tag = f"[rank {rank}] ".encode()
        for pipe, stream in ((process.stdout, self._out), (process.stderr, self._err)):
            thread = threading.Thread(target=self._relay, args=(pipe, stream, tag), daemon=True,
                                      name=f"tridist-rank-{rank}-output")
            thread.start()
            self._threads.setdefault(rank, []).append(thread)

    def _relay(self, pipe, stream, tag: bytes) -> None:
        with pipe:
            for line in iter(pipe.readline, b""):
                self._write(stream, tag + (line if line.endswith(b"\n") else line + b"\n"))

    def _write(self, stream, data: bytes) -> None:
        with self._lock:
            try:
                stream.write(data)
                stream.flush()
            except (OSError, ValueError):
                pass  # our own output is gone (`tridist run ... | head`): keep draining the ranks' pipes

    def say(self, message: str) -> None:
        """A line of the launcher's own, on stderr."""
        self._write(self._err, message.encode() + b"\n")

    def drain(self, ranks=None) -> None:
        """Wait (briefly: a rank's children may hold its pipes open) for the output of `ranks` (default all)."""
        deadline = time.monotonic() + _DRAIN_S
        for rank in self._threads if ranks is None else ranks:
            for thread in self._threads.get(rank, []):
                thread.join(max(0.0, deadline - time.monotonic()))
