"""CUDA MPS (Multi-Process Service), which ranks sharing a GPU need (see `sharing.py`).

Without MPS, NVSHMEM runs several PEs on one GPU in "limited MPG" mode, and PyTorch's NVSHMEM backend
dies at init. Here: whether a control daemon answers, and starting and stopping one for a job. The
daemon and its clients meet in a pipe directory (CUDA_MPS_PIPE_DIRECTORY, default /tmp/nvidia-mps),
so a daemon started with its own directory serves only the processes given that directory.
"""
import dataclasses
import os
import shutil
import subprocess
import tempfile
import time

CONTROL = "nvidia-cuda-mps-control"
DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"
_ANSWER_S = 10.0  # a daemon that answers at all answers at once; this only bounds a stuck one


@dataclasses.dataclass(frozen=True)
class Status:
    """installed: the control program is on PATH; running: a daemon answers in `pipe_directory`."""

    installed: bool
    running: bool
    pipe_directory: str

    def describe(self) -> str:
        if not self.installed:
            return f"not installed ({CONTROL} is not on PATH)"
        if self.running:
            return f"running (pipe directory {self.pipe_directory})"
        return f"not running (none answers in pipe directory {self.pipe_directory})"


def pipe_directory(env: dict | None = None) -> str:
    env = os.environ if env is None else env
    return env.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIRECTORY


def _control(command: str, env: dict) -> subprocess.CompletedProcess | None:
    """`echo command | nvidia-cuda-mps-control`, or None when it does not answer in time."""
    try:
        return subprocess.run([CONTROL], input=command + "\n", env=env, capture_output=True, text=True,
                              timeout=_ANSWER_S)
    except subprocess.TimeoutExpired:
        return None


def status(env: dict | None = None) -> Status:
    """Whether an MPS control daemon answers for the pipe directory of `env` (default: this process's)."""
    env = dict(os.environ if env is None else env)
    folder = pipe_directory(env)
    if shutil.which(CONTROL, path=env.get("PATH")) is None:
        return Status(False, False, folder)
    # Without a daemon the control program says it cannot find one and fails.
    answer = _control("get_server_list", env)
    said = "" if answer is None else (answer.stdout + answer.stderr).lower()
    running = answer is not None and answer.returncode == 0 and "cannot find" not in said
    return Status(True, running, folder)


def start_hint() -> str:
    """How to start a daemon by hand, and stop it (DESIGN.md's recipe)."""
    return ("start one with `tridist run --start-mps ...` (for that job only), or by hand: "
            "`export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log; "
            "mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY; nvidia-cuda-mps-control -d` "
            "(the same exports in the shell that runs the job; stop it with `echo quit | nvidia-cuda-mps-control`)")


def missing_message(found: Status) -> str:
    if not found.installed:
        return (f"CUDA MPS is not installed here ({CONTROL} is not on PATH); it comes with the NVIDIA driver's "
                "compute utilities (e.g. the nvidia-compute-utils package)")
    return f"no MPS control daemon answers in {found.pipe_directory}; {start_hint()}"


class Daemon:
    """An MPS control daemon started for one job, in a pipe directory of its own: `env` holds what the
    job's processes need to find it. `stop()` quits it (call it however the job ends)."""

    def __init__(self, env: dict):
        self.folder = tempfile.mkdtemp(prefix="tridist-mps-")
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(self.folder, "pipe"),
                    "CUDA_MPS_LOG_DIRECTORY": os.path.join(self.folder, "log")}
        for folder in self.env.values():
            os.makedirs(folder)
        self._env = {**env, **self.env}
        started = subprocess.run([CONTROL, "-d"], env=self._env, capture_output=True, text=True, timeout=60)
        deadline = time.monotonic() + _ANSWER_S
        while started.returncode == 0 and not status(self._env).running and time.monotonic() < deadline:
            time.sleep(0.1)
        if started.returncode != 0 or not status(self._env).running:
            shutil.rmtree(self.folder, ignore_errors=True)
            raise RuntimeError(f"`{CONTROL} -d` did not start a daemon (exit code {started.returncode}): "
                               f"{(started.stdout + started.stderr).strip() or 'no output'}")

    @property
    def pipe_directory(self) -> str:
        return self.env["CUDA_MPS_PIPE_DIRECTORY"]

    def stop(self) -> str | None:
        """Quit the daemon and remove its folder; None, or what went wrong and how to stop it by hand."""
        answer = _control("quit", self._env)
        if answer is None or answer.returncode != 0:
            return (f"the MPS control daemon in {self.pipe_directory} did not quit; stop it with "
                    f"`echo quit | CUDA_MPS_PIPE_DIRECTORY={self.pipe_directory} {CONTROL}`")
        shutil.rmtree(self.folder, ignore_errors=True)
        return None
