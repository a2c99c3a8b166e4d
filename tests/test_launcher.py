"""`tridist run` and `tridist info`, as a user runs them (these start their own processes), and the
launcher's decisions: GPU sharing, each rank's environment, output prefixing, CUDA MPS."""
import io
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest

from tridist.runtime import info, launcher, mps, sharing

from .harness import backend, gpu_worlds, worlds_not_started

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tridist_cli(*args, env=None, timeout=300):
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "tridist", *args], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, **(env or {})}, timeout=timeout)
    return result, time.monotonic() - started


def gpus() -> int:
    import torch

    return torch.cuda.device_count() if backend() == "nvshmem" else 0


@pytest.fixture
def gpu_recovers():
    """For tests whose job kills a rank or traps a kernel on a GPU: afterwards, wait (up to a minute)
    until a new process can use every GPU again. Under MPS a fault ends every client of the GPU and
    the next client is refused ("busy or unavailable") until the server is back (2026-11-26: the
    test after the killed rank failed that way)."""
    yield
    if backend() != "nvshmem":
        return
    probe = [sys.executable, "-c",
             "import torch; [torch.ones(1, device=i).item() for i in range(torch.cuda.device_count())]"]
    deadline = time.monotonic() + 60
    while subprocess.run(probe, capture_output=True, timeout=60).returncode != 0 and time.monotonic() < deadline:
        time.sleep(2)


def gpu_ranks() -> int:
    """The ranks this GPU box runs at most: TRIDIST_RANKS_PER_GPU (default 1) on each GPU."""
    from tridist.runtime import config

    return gpus() * config.ranks_per_gpu()


def test_example_runs():
    ranks = str(min(2, gpu_ranks())) if backend() == "nvshmem" else "3"
    result, _ = tridist_cli("run", "-n", ranks, "examples/allgather.py")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("all-gather correct") == int(ranks)
    assert all(line.startswith(f"[rank {line[6]}] ") for line in result.stdout.splitlines()), result.stdout


def test_emulator_runs_under_torchrun():
    """torchrun's ranks find each other's heaps (a folder named after their torchrun job) and leave
    nothing behind in /dev/shm."""
    if backend() != "emulator":
        pytest.skip("torchrun on GPUs needs nothing of tridist's")
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "examples/allgather.py"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "TRIDIST_BACKEND": "emulator"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("all-gather correct") == 2
    if before:
        assert not [name for name in set(os.listdir("/dev/shm")) - before if name.startswith("tridist-torchrun-")]


def test_dead_rank_ends_the_job():
    if backend() == "nvshmem" and gpu_ranks() < 2:
        pytest.skip("needs 2 GPUs, or TRIDIST_RANKS_PER_GPU=2 and CUDA MPS")
    result, elapsed = tridist_cli("run", "-n", "2", "tests/scripts/rank_dies.py", env={"TRIDIST_WAIT_TIMEOUT": "600"})
    assert result.returncode != 0
    assert "tridist run: rank 1 exited with code 3; stopping rank 0" in result.stderr, result.stderr[-3000:]
    assert elapsed < 120, f"the surviving rank was left waiting for {elapsed:.0f} s"


def test_the_first_failure_is_named():
    """Rank 2 passes a group it is not a member of (a ValueError) while ranks 0 and 1 wait for it: the
    job's last line names rank 2 and quotes its error's first line, and so does the PeerFailedError of
    every peer that noticed before it was stopped (in the emulator)."""
    if backend() == "nvshmem" and gpu_ranks() < 3:
        pytest.skip("needs 3 GPUs, or TRIDIST_RANKS_PER_GPU and CUDA MPS")
    result, _ = tridist_cli("run", "-n", "3", "tests/scripts/not_a_member.py")
    assert result.returncode != 0
    quoted = "ValueError: rank 2 is not a member of this process group"
    assert result.stderr.splitlines()[-1].startswith(f"tridist run: rank 2 failed first: {quoted}"), result.stderr[-3000:]
    for line in result.stderr.splitlines():
        if "PeerFailedError: " in line:
            assert re.search(rf"PeerFailedError: rank (\d): rank 2 failed while rank \1 waited on it: {quoted}", line), line


@pytest.mark.parametrize("order", ["before", "after"])
def test_torch_distributed_before_or_after_init(order):
    """A DeviceMesh built before `tridist.init()` starts torch.distributed from MASTER_ADDR and
    MASTER_PORT, which `tridist run` gives every rank as torchrun does; built after, it takes the one
    tridist started. Either way the mesh's group runs tridist's ops."""
    if backend() == "nvshmem" and gpu_ranks() < 2:
        pytest.skip("needs 2 GPUs, or TRIDIST_RANKS_PER_GPU=2 and CUDA MPS")
    result, _ = tridist_cli("run", "-n", "2", "tests/scripts/mesh_before_init.py", order)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count(f"mesh {order} tridist.init, all-gather correct") == 2, result.stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_rank_killed_in_a_collective_on_the_gpu(tmp_path, gpu_recovers):
    """SIGKILL to rank 1 while rank 0 waits for it inside an all-reduce kernel: the job ends, names
    rank 1, and no rank process is left. Two ranks share one GPU where there is one (CUDA MPS)."""
    if backend() != "nvshmem":
        pytest.skip("on the GPU: the emulator's supervisor is checked by test_killed_rank_is_named_and_reaped")
    # A second MPS daemon for a GPU whose daemon is running (the suite's, with RANKS_PER_GPU) left
    # that GPU's MPS server refusing clients ("not ready", 2026-11-26): use the running one.
    sharing_flags = [] if gpus() >= 2 else ["--ranks-per-gpu", "2"] + ([] if mps.status().running else ["--start-mps"])
    result, elapsed = tridist_cli("run", "-n", "2", *sharing_flags, "tests/scripts/rank_killed_in_collective.py",
                                  env={"TRIDIST_WAIT_TIMEOUT": "600", "TRIDIST_TEST_PIDS": str(tmp_path)})
    assert result.returncode != 0
    assert "rank 1 was killed by SIGKILL" in result.stderr, result.stderr[-3000:]
    assert elapsed < 120, f"the surviving rank was left waiting for {elapsed:.0f} s"
    pids = [int((tmp_path / str(rank)).read_text()) for rank in range(2)]
    assert not [pid for pid in pids if _alive(pid)], f"rank processes {pids} outlived the job"


def test_bounded_wait_names_rank_kernel_and_signal(gpu_recovers):
    """One line, the same on GPUs and in the emulator, naming the rank, kernel, program, the
    allocation (by the name its creator gave) and index, and the values; the job ends with a
    WaitTimeoutError saying it, and nothing else: no line per thread and operand (Triton's device
    print, which GPUs used to give), no CUDA error with PyTorch's advice, no second traceback from the
    exit's `finalize`."""
    env = {"TRIDIST_DEBUG": "1", "TRIDIST_WAIT_TIMEOUT": "1"}
    result, _ = tridist_cli("run", "-n", "1", "tests/scripts/wait_forever.py", env=env)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    line = re.compile(r"tridist: rank 0 kernel never_signalled_kernel program 0: wait on flags\[0\] \(int64\[1\] at "
                      r"heap offset 0x[0-9a-f]+\) expected == 1, observed 0 after [0-9.]+ s")
    assert line.search(output), output[-3000:]
    assert re.search(r"WaitTimeoutError: " + line.pattern, output), output[-3000:]
    for noise in ("operand", "atexit", "CUDA_LAUNCH_BLOCKING"):  # the last: PyTorch's advice on a CUDA error
        assert noise not in output, (noise, output[-3000:])
    assert output.count("Traceback") == 1, output[-3000:]


def test_more_ranks_than_gpus_is_refused():
    if backend() != "nvshmem":
        pytest.skip("the emulator runs any number of ranks")
    result, _ = tridist_cli("run", "-n", str(gpu_ranks() + 1), "examples/allgather.py")
    assert result.returncode != 0 and "GPUs but this host has" in result.stderr
    assert "--ranks-per-gpu" in result.stderr


def test_info():
    result, _ = tridist_cli("info", env={"TRIDIST_EMU_THREADS": "8", "TRIDIST_EMU_CORESIDENT": ""})
    assert result.returncode == 0, result.stderr
    assert f"tridist backend: {backend()}" in result.stdout and "to fix:" in result.stdout
    # each setting on a line: its value and where it came from, or that it is unset and its default
    assert re.search(r"^  TRIDIST_EMU_THREADS +8  \(from the environment\)$", result.stdout, re.M), result.stdout
    assert re.search(r"^  TRIDIST_EMU_CORESIDENT +unset: default 256$", result.stdout, re.M), result.stdout
    sharing_line = "CUDA MPS control daemon: " if backend() == "nvshmem" else "--ranks-per-gpu changes nothing"
    assert sharing_line in result.stdout


# The launcher's own logic, with ranks that are plain Python scripts (no tridist: quick to start).

CHATTY = os.path.join(ROOT, "tests", "scripts", "chatty_rank.py")


def test_precompile_needs_a_gpu_and_a_log():
    result, _ = tridist_cli("precompile", "no-such-log.jsonl")
    assert result.returncode == 2
    if backend() == "emulator":
        assert "the emulator compiles nothing" in result.stderr, result.stderr
    else:
        assert "no compile log no-such-log.jsonl; record one with tridist run --record-compiles" in result.stderr


def test_sharing_decisions():
    """Rank r of a host on GPU r // K; MPS percentages of a GPU's ranks add up to at most 100; gloo
    wherever two ranks share a GPU; how many GPUs a job needs."""
    assert [sharing.gpu_of(r, 2) for r in range(5)] == [0, 0, 1, 1, 2]
    assert [sharing.gpu_of(r, 1) for r in range(3)] == [0, 1, 2]
    assert sharing.mps_percentage(4, 4) == 25 and sharing.mps_percentage(2, 4) == 50  # 2 ranks need only half each
    assert sharing.mps_percentage(3, 4) == 33 and sharing.mps_percentage(6, 4) == 25
    assert sharing.process_group_backend(2, 2) == "gloo" and sharing.process_group_backend(4, 1) == "nccl"
    assert sharing.process_group_backend(1, 4) == "nccl"  # one rank shares with nobody
    assert sharing.gpus_needed(5, 2) == 3 and sharing.gpus_needed(4, 4) == 1
    assert sharing.rank_environment(4, 1) == {}
    assert sharing.rank_environment(4, 2) == {"TRIDIST_RANKS_PER_GPU": "2", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}
    assert launcher.gpu_problem(4, 4, 1) is None and launcher.gpu_problem(4, 1, 4) is None
    refused = launcher.gpu_problem(4, 1, 1)
    assert "needs 4 GPUs but this host has 1" in refused and "--ranks-per-gpu 4" in refused
    assert "needs 3 GPUs but this host has 2" in launcher.gpu_problem(5, 2, 2)
    assert "--backend emulator" in launcher.gpu_problem(2, 0, 1)


def test_sharing_settings(monkeypatch):
    """TRIDIST_RANKS_PER_GPU as the harness and the runtime read it, and the worlds a GPU box runs."""
    from tridist.runtime import config

    from .harness import ranks_per_gpu

    monkeypatch.delenv("TRIDIST_RANKS_PER_GPU", raising=False)
    assert config.ranks_per_gpu() == 1 == ranks_per_gpu()
    monkeypatch.setenv("TRIDIST_RANKS_PER_GPU", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert ranks_per_gpu() == 4 and sharing.ranks_per_gpu_here() == 2
    monkeypatch.setenv("TRIDIST_RANKS_PER_GPU", "two")
    with pytest.raises(ValueError, match="TRIDIST_RANKS_PER_GPU='two': expected a positive integer"):
        config.ranks_per_gpu()
    assert gpu_worlds(1, 1) == ["1"] and gpu_worlds(2, 1) == ["1", "2", "2x1"]
    assert gpu_worlds(1, 2) == ["2", "2x1"] and gpu_worlds(1, 4) == ["2", "2x1", "4", "2x2"]
    monkeypatch.setenv("TRIDIST_RANKS_PER_GPU", "4")
    monkeypatch.setenv("TRIDIST_TEST_WORLDS", "2,2x1")
    assert worlds_not_started(("1",)) == ("runs in worlds 1; this run starts 2, 2x1 (ranks share a GPU: no world 1, "
                                          "whose point is peers); TRIDIST_TEST_WORLDS picks them")


def test_tests_of_worlds_not_started_are_skipped_not_dropped():
    """Where none of a test's worlds starts (world 1 with ranks sharing a GPU), pytest lists it as
    skipped, once for each of its other parameters, and starts no world for it."""
    result = subprocess.run([sys.executable, "-m", "pytest", "tests/test_expert_parallel.py", "-q", "-rs", "-p",
                             "no:cacheprovider", "-k", "test_low_latency_placement"],
                            env={**os.environ, "TRIDIST_TEST_WORLDS": "2"}, capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=120)
    assert "4 skipped" in result.stdout and "runs in worlds 1; this run starts 2" in result.stdout, result.stdout


def test_rank_environments():
    envs = launcher.rank_environments(3, {"KEEP": "1"}, master_port=1234)
    assert [(e["RANK"], e["LOCAL_RANK"]) for e in envs] == [("0", "0"), ("1", "1"), ("2", "2")]
    assert all(e["WORLD_SIZE"] == e["LOCAL_WORLD_SIZE"] == "3" and e["KEEP"] == "1" for e in envs)
    assert all(e["MASTER_ADDR"] == "127.0.0.1" and e["MASTER_PORT"] == "1234" for e in envs)
    assert "MASTER_PORT" not in launcher.rank_environments(1, {})[0]


def test_first_failure_of_the_records(tmp_path):
    """The job's summary names the earliest of the ranks that failed of their own; records of ranks that
    failed because a peer had, and unreadable ones, are passed over."""
    assert launcher.first_failure(str(tmp_path)) is None
    records = {0: {"error": "PeerFailedError: rank 0: ...", "after": 2, "failed_at": 1},
               1: {"error": "ValueError: late", "after": None, "failed_at": 30},
               2: {"error": "ValueError: first", "after": None, "failed_at": 20}}
    for rank, record in records.items():
        (tmp_path / str(rank)).write_text(json.dumps(record))
    (tmp_path / "3").write_text("{cut sh")
    assert launcher.first_failure(str(tmp_path)) == (2, "ValueError: first")
    for rank in (1, 2):
        (tmp_path / str(rank)).unlink()
    assert launcher.first_failure(str(tmp_path)) is None  # rank 2 left no record: a signal, say


def test_peers_quote_the_first_failure(tmp_path):
    """In the emulator, a rank that finds a failed peer names the first rank that failed of its own and
    quotes its error's first line (cut to 512 bytes), also where the peer it finds failed because of
    that one; a process that is gone is said to have died."""
    from concurrent.futures import ThreadPoolExecutor

    from tridist.runtime import emulator
    from tridist.runtime.errors import PeerFailedError

    with ThreadPoolExecutor(3) as pool:  # each waits for the others' control blocks
        ranks = list(pool.map(lambda rank: emulator.EmulatorTransport(str(tmp_path), rank, 3, 4096), range(3)))
    ranks[2].close(failed=True, error="ValueError: " + "x" * 600)
    with pytest.raises(PeerFailedError, match=r"^rank 0: rank 2 failed while rank 0 waited on it: ValueError: x+\.\.\.$"
                       ) as caught:
        ranks[0].check_peers()
    assert len(str(caught.value).split(": ", 2)[2].encode()) == 511
    ranks[0].close(failed=True, error=f"PeerFailedError: {caught.value}")
    with pytest.raises(PeerFailedError, match="^rank 1: rank 2 failed while rank 1 waited on it: ValueError: x"):
        ranks[1].check_peers()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    control = ranks[1]._ctl  # every rank's control block, as rank 1 maps it
    control[2][emulator._PID] = int(dead.stdout)  # rank 2 now a process that is gone, without a word:
    control[2][emulator._STATE] = emulator._READY
    control[0][emulator._AFTER] = -1  # and rank 0 failed of its own, later
    with pytest.raises(PeerFailedError, match=rf"^rank 1: rank 2 \(pid {int(dead.stdout)}\) died$"):
        ranks[1].check_peers()


def test_output_lines_are_whole_and_prefixed():
    """Four ranks print long lines (longer than a pipe's atomic write) at once on stdout and stderr:
    every line arrives whole, behind its rank, and a last line without its newline still arrives."""
    lines = 60
    envs = launcher.rank_environments(4, dict(os.environ, LINES=str(lines), PYTHONUNBUFFERED="1"))
    out, err = io.BytesIO(), io.BytesIO()
    assert launcher.launch([[sys.executable, CHATTY]] * 4, envs, out=out, err=err) == 0
    seen = {rank: [] for rank in range(4)}
    for stream in (out, err):
        for line in stream.getvalue().decode().splitlines():
            match = re.fullmatch(r"\[rank (\d)\] (rank (\d) (line (\d+) (\d{5000})|last words))", line)
            assert match and match[1] == match[3], f"a mixed or cut line: {line[:80]}...{line[-40:]}"
            assert match[6] is None or match[6] == match[1] * 5000
            seen[int(match[1])].append(match[2])
    for rank, got in seen.items():
        expected = {f"rank {rank} line {i} " + str(rank) * 5000 for i in range(lines)} | {f"rank {rank} last words"}
        assert set(got) == expected and len(got) == len(expected)


def test_no_prefix(capfd):
    envs = launcher.rank_environments(2, dict(os.environ, LINES="2"))
    assert launcher.launch([[sys.executable, CHATTY]] * 2, envs, prefix=False) == 0
    out, err = capfd.readouterr()
    assert "[rank" not in out + err and out.count("last words") == 2 and err.count(" line 0 ") == 2


def test_killed_rank_is_named_and_reaped(tmp_path):
    """Rank 1 kills itself (SIGKILL) while rank 0 sleeps: the job ends at once, says which rank died,
    and stops rank 0; no rank process is left."""
    envs = launcher.rank_environments(3, dict(os.environ, PIDS=str(tmp_path), SLEEP_RANK="0", KILL_RANK="1"))
    err = io.BytesIO()
    started = time.monotonic()
    code = launcher.launch([[sys.executable, CHATTY]] * 3, envs, out=io.BytesIO(), err=err)
    assert code == 128 + 9 and time.monotonic() - started < 30
    assert re.search(r"tridist run: rank 1 was killed by SIGKILL; stopping ranks? 0\b", err.getvalue().decode())
    pids = [int((tmp_path / str(rank)).read_text()) for rank in range(3)]
    assert not [pid for pid in pids if _alive(pid)]


@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm", "sigterm to the job"])
def test_stopped_job_names_the_stopped_ranks(tmp_path, stop):
    """Ctrl-C (SIGINT to every process of the job, as a terminal sends it), SIGTERM to the launcher, or
    SIGTERM to every process of the job: no traceback, the ranks that were stopped named, none left."""
    job = subprocess.Popen([sys.executable, "-m", "tridist", "run", "-n", "2", "--backend", "emulator", CHATTY],
                           cwd=ROOT, env={**os.environ, "PIDS": str(tmp_path), "SLEEP_RANK": "all"}, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 120
    while not all((tmp_path / str(rank)).exists() for rank in range(2)) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # each rank's pid is written before it sleeps
    if stop == "ctrl-c":
        os.killpg(job.pid, signal.SIGINT)
    elif stop == "sigterm":
        job.send_signal(signal.SIGTERM)
    else:
        os.killpg(job.pid, signal.SIGTERM)
    out, err = job.communicate(timeout=60)
    assert "Traceback" not in out + err, err
    if stop == "ctrl-c":
        assert job.returncode == 130 and "tridist run: interrupted (Ctrl-C); stopping ranks 0, 1" in err, err
    elif stop == "sigterm":
        assert job.returncode == 143 and "tridist run: terminated (SIGTERM); stopping ranks 0, 1" in err, err
    else:  # the launcher may see its ranks die first
        assert job.returncode == 143 and re.search(r"tridist run: (terminated \(SIGTERM\)|rank \d was killed by SIGTERM)",
                                                   err), err
    pids = [int((tmp_path / str(rank)).read_text()) for rank in range(2)]
    assert not [pid for pid in pids if _alive(pid)]


def _fake_mps(folder) -> str:
    """A fake nvidia-cuda-mps-control in `folder`, whose daemon "runs" while a file does in its pipe
    directory; it logs its commands. Returns a PATH that finds it first."""
    script = folder / mps.CONTROL
    script.write_text(f"""#!/bin/sh
state="${{CUDA_MPS_PIPE_DIRECTORY:-{folder}}}/fake-daemon"
if [ "$1" = -d ]; then touch "$state"; echo start >> {folder}/log; exit 0; fi
read command
echo "$command" >> {folder}/log
if [ ! -e "$state" ]; then echo "Cannot find MPS control daemon process"; exit 1; fi
[ "$command" = quit ] && rm "$state"
exit 0
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return f"{folder}:{os.environ.get('PATH', '')}"


def test_mps_status_and_the_missing_daemon(tmp_path, monkeypatch):
    """Without a daemon `tridist run --ranks-per-gpu` says so and how to start one, before any rank
    starts; without the program, that MPS is not installed."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.delenv("TRIDIST_RANKS_PER_GPU", raising=False)  # set where the suite runs with sharing
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-cuda-mps-control
    assert mps.status() == mps.Status(False, False, mps.DEFAULT_PIPE_DIRECTORY)
    with pytest.raises(SystemExit, match="CUDA MPS is not installed here"):
        launcher.run(2, [CHATTY], backend="nvshmem", ranks_per_gpu=2, start_mps=True)
    monkeypatch.setenv("PATH", _fake_mps(tmp_path))
    found = mps.status()
    assert found.installed and not found.running and "not running" in found.describe()
    with pytest.raises(SystemExit) as stop:
        launcher.run(2, [CHATTY], backend="nvshmem", ranks_per_gpu=2)
    assert "need CUDA MPS" in str(stop.value) and "--start-mps" in str(stop.value)
    assert "nvidia-cuda-mps-control -d" in str(stop.value)
    with pytest.raises(SystemExit, match=r"GPUs but this host has 1.*--ranks-per-gpu 2"):
        launcher.run(2, [CHATTY], backend="nvshmem")
    report = "\n".join(info.sharing_report(1, found))
    assert "--ranks-per-gpu 4: 4 ranks at 25% of the SMs each" in report and "needs CUDA MPS" in report
    report = "\n".join(info.sharing_report(2, mps.Status(True, True, "/p")))
    assert "CUDA MPS control daemon: running (pipe directory /p)" in report and "up to 8 ranks on 2 GPU(s)" in report
    assert "needs CUDA MPS" not in report


def test_start_mps_for_the_job(tmp_path, monkeypatch, capfd, caplog):
    """`--start-mps` starts a daemon in a folder of its own, hands the ranks its pipe directory and
    their MPS percentage, and quits it when the job ends, a failed job too; it says so through the
    `tridist` logger."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.delenv("TRIDIST_RANKS_PER_GPU", raising=False)  # set where the suite runs with sharing
    monkeypatch.setenv("PATH", _fake_mps(tmp_path))
    show = tmp_path / "show.py"
    show.write_text("import json, os\nprint(json.dumps({k: os.environ.get(k) for k in ('RANK', 'LOCAL_RANK', "
                    "'TRIDIST_RANKS_PER_GPU', 'CUDA_MPS_ACTIVE_THREAD_PERCENTAGE', 'CUDA_MPS_PIPE_DIRECTORY', "
                    "'TRIDIST_BACKEND', 'NVSHMEM_DISABLE_NVLS', 'MASTER_PORT')}))\n"
                    "raise SystemExit(int(os.environ['RANK']) == int(os.environ.get('FAIL_RANK', -1)))\n")
    assert launcher.run(4, [str(show)], backend="nvshmem", ranks_per_gpu=4, start_mps=True) == 0
    out, _ = capfd.readouterr()
    seen = [json.loads(line.split("] ", 1)[1]) for line in out.splitlines()]
    assert sorted(s["RANK"] for s in seen) == ["0", "1", "2", "3"]
    assert all(s["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25" and s["TRIDIST_RANKS_PER_GPU"] == "4" for s in seen)
    assert all(s["NVSHMEM_DISABLE_NVLS"] == "1" and s["MASTER_PORT"] for s in seen)
    pipe = seen[0]["CUDA_MPS_PIPE_DIRECTORY"]
    assert "tridist-mps-" in pipe and all(s["CUDA_MPS_PIPE_DIRECTORY"] == pipe for s in seen)
    assert "started an MPS control daemon" in caplog.text and "stopped the MPS control daemon" in caplog.text
    assert not os.path.exists(pipe), "the daemon's folder is removed"
    monkeypatch.setenv("FAIL_RANK", "1")
    assert launcher.run(2, [str(show)], backend="nvshmem", ranks_per_gpu=2, start_mps=True) == 1
    assert (tmp_path / "log").read_text().split().count("quit") == 2
    assert "rank 1 exited with code 1" in capfd.readouterr().err
    # A daemon that already answers is used, and left running.
    (tmp_path / "existing").mkdir()
    (tmp_path / "existing" / "fake-daemon").touch()
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "existing"))
    monkeypatch.delenv("FAIL_RANK")
    assert launcher.run(2, [str(show)], backend="nvshmem", ranks_per_gpu=2, start_mps=True) == 0
    assert f"through the MPS control daemon in {tmp_path / 'existing'}" in caplog.text
    assert (tmp_path / "log").read_text().split().count("start") == 2
    assert (tmp_path / "existing" / "fake-daemon").exists()


def test_emulator_ignores_gpu_sharing(capfd, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no MPS either: the emulator needs none
    script = os.path.join(ROOT, "tests", "scripts", "chatty_rank.py")
    assert launcher.run(2, [script], backend="emulator", ranks_per_gpu=4, start_mps=True) == 0
    out, err = capfd.readouterr()
    assert out.count("last words") == 2 and "MPS" not in err


def test_xdist_workers_take_a_gpu_each(monkeypatch):
    """Under pytest-xdist on GPUs, worker i keeps the i-th GPU of CUDA_VISIBLE_DEVICES alone (two
    workers' worlds on one GPU hung each other's co-resident kernels); too few GPUs is refused."""
    from .harness import pin_worker_gpu

    monkeypatch.setenv("TRIDIST_BACKEND", "nvshmem")
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    pin_worker_gpu()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(RuntimeError, match="3 pytest-xdist workers need a GPU each"):
        pin_worker_gpu()
    monkeypatch.setenv("TRIDIST_BACKEND", "emulator")
    pin_worker_gpu()  # the emulator has no GPUs to share out
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_rendezvous_port_is_outside_the_ephemeral_range():
    """Rank 0's store port is drawn below the ports the system hands out to other sockets, which
    another job's bootstraps could take between the draw and rank 0's bind."""
    from tridist.runtime.launcher import _first_ephemeral_port, _free_port

    for _ in range(20):
        port = _free_port()
        assert 10000 <= port < _first_ephemeral_port()
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
