"""Runs test bodies on every rank of a world that is started once per test session.

Starting Python, torch and Triton costs seconds per process, so each world size gets one pool of
rank processes for the whole session, and a test hands it a body: a module-level function
`body(world, **kwargs)` that every rank runs at once. A body that fails on any rank fails the test
with every rank's traceback; the pool is then thrown away (a failed rank may leave peers waiting)
and the next test starts a fresh one.

Worlds are named "N" (N ranks, one node) or "KxL" (K virtual nodes of L ranks each).

On GPUs, TRIDIST_RANKS_PER_GPU=K puts K ranks on each GPU as `tridist run --ranks-per-gpu K` does
(rank r on GPU r // K, a gloo host group, each rank 100 // (ranks on its GPU) percent of the SMs
through CUDA MPS, which must be running: scripts/gpu_suite.sh starts it with RANKS_PER_GPU=K), so
that a machine with one GPU runs the suite with peers; under pytest-xdist each worker takes a GPU
of its own (`pin_worker_gpu`). TRIDIST_COMPILE_LOG=path makes the ranks
record the kernels they compile, for `tridist precompile` (tridist/runtime/compiles.py).
"""
import importlib.util
import multiprocessing
import multiprocessing.connection
import os
import shutil
import socket
import traceback

_BODY_TIMEOUT_S = float(os.environ.get("TRIDIST_TEST_TIMEOUT", "300"))


def load_script(folder: str, name: str):
    """The repository's `folder`/`name`.py (an example, a benchmark script) imported as a module, so
    that tests run what users run rather than a copy of it."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), folder, f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"{folder}_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Where the ops' tests run them within process groups (issue 42): layout -> (the groups, as lists of
# world ranks covering the world, and the worlds the layout is run in).
GROUP_LAYOUTS = {
    "pairs": ([[0, 1], [2, 3]], ("4",)),  # disjoint groups at once, on different data
    "strided": ([[0, 2], [1, 3]], ("4", "2x2")),  # strided; in 2x2 each group spans both nodes
    "beside": ([[0, 2], [1]], ("3",)),  # a group while rank 1 works alone
}


def group_layouts() -> list:
    """The names of GROUP_LAYOUTS as pytest parameters, each marked with its worlds."""
    import pytest

    return [pytest.param(name, marks=pytest.mark.worlds(*worlds)) for name, (_, worlds) in GROUP_LAYOUTS.items()]


def join_groups(layout: str) -> tuple[int, list, list]:
    """Every group of the layout made on this rank (torch.distributed's rule: every rank makes every
    group, in the same order): (the index of this rank's group, its members' world ranks, every
    group's process group)."""
    import torch.distributed as dist

    import tridist

    partition = GROUP_LAYOUTS[layout][0]
    made = [dist.new_group(ranks) for ranks in partition]
    index = next(i for i, ranks in enumerate(partition) if tridist.world().rank in ranks)
    return index, partition[index], made


def parse_world(name: str) -> tuple[int, int | None]:
    if "x" in name:
        nodes, per_node = (int(v) for v in name.split("x"))
        return nodes * per_node, nodes
    return int(name), None


def backend() -> str:
    name = os.environ.get("TRIDIST_BACKEND")
    if name:
        return name
    import torch

    return "nvshmem" if torch.cuda.is_available() else "emulator"


def ranks_per_gpu() -> int:
    """TRIDIST_RANKS_PER_GPU (1 when unset): the ranks each GPU takes."""
    from tridist.runtime import config  # not at the top: see `_worker`

    return config.ranks_per_gpu()


def gpu_worlds(gpus: int, per_gpu: int) -> list[str]:
    """The worlds that `gpus` GPUs of `per_gpu` ranks each hold; world 1 only without sharing, where
    the point is peers (tests for world 1 alone are then listed as skipped: conftest.py)."""
    ranks = gpus * per_gpu
    return ((["1"] if per_gpu == 1 else []) + (["2", "2x1"] if ranks >= 2 else [])
            + (["4", "2x2"] if ranks >= 4 else []) + (["8", "2x4", "4x2"] if ranks >= 8 else []))


def worlds_not_started(marked) -> str:
    """Why a test marked for `marked` worlds is skipped where this run starts none of them."""
    started = default_worlds()
    why = " (ranks share a GPU: no world 1, whose point is peers)" if "1" not in started and ranks_per_gpu() > 1 else ""
    return (f"runs in worlds {', '.join(marked)}; this run starts {', '.join(started)}{why}; "
            "TRIDIST_TEST_WORLDS picks them")


def default_worlds() -> list[str]:
    spec = os.environ.get("TRIDIST_TEST_WORLDS")
    if spec:
        return [w.strip() for w in spec.split(",") if w.strip()]
    if backend() == "nvshmem":
        import torch

        return gpu_worlds(torch.cuda.device_count(), ranks_per_gpu())
    # Worlds of 8 ranks are left to TRIDIST_TEST_WORLDS (8, 2x4, 4x2): on CI's two cores each took
    # about 5 minutes of a budget of 20, which the expert-parallel and attention families used up
    # (2026-11-25: 24 minutes in all with 2x4). 2x2 runs every kernel across nodes with several
    # ranks a node; 3 runs the paths whose sizes are not powers of two.
    return ["1", "2", "3", "4", "2x2"]


def pin_worker_gpu() -> None:
    """Under pytest-xdist (`pytest -n P`, as `PARALLEL=P scripts/gpu_suite.sh` runs it), worker i
    takes the i-th GPU of CUDA_VISIBLE_DEVICES alone, before anything starts CUDA, so that no two
    workers' kernels share a GPU: on one GPU shared through MPS a co-resident grid of one worker's
    ranks was not resident beside another worker's (2026-11-26: grid barriers and the fused Jacobi
    solver hung). Called by conftest.py; does nothing outside xdist or on the emulator."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or os.environ.get("TRIDIST_BACKEND") == "emulator":
        return  # (not `backend()`: asking torch would start CUDA before the GPU is chosen)
    visible = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > len(visible):
        raise RuntimeError(f"{workers} pytest-xdist workers need a GPU each: list them in CUDA_VISIBLE_DEVICES "
                           f"(it lists {len(visible)}); scripts/gpu_suite.sh with PARALLEL does")
    os.environ["CUDA_VISIBLE_DEVICES"] = visible[int(worker[2:])]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, env: dict, conn) -> None:
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    import importlib

    import tridist

    world = tridist.init()
    conn.send(("ready", None))
    while True:
        message = conn.recv()
        if message is None:
            break
        module, name, kwargs = message
        try:
            result = getattr(importlib.import_module(module), name)(world, **kwargs)
        except BaseException:  # noqa: BLE001 - reported to the parent, then this rank leaves
            conn.send(("error", traceback.format_exc()))
            from tridist.runtime.world import transport

            transport().close(failed=True)
            os._exit(1)
        conn.send(("ok", result))
    tridist.finalize()


class WorldPool:
    def __init__(self, name: str):
        self.name = name
        self.size, self.nnodes = parse_world(name)
        self.backend = backend()
        self._processes, self._conns, self._folder = [], [], None

    def _start(self) -> None:
        env = {"TRIDIST_BACKEND": self.backend, "WORLD_SIZE": str(self.size), "LOCAL_WORLD_SIZE": str(self.size),
               "TRIDIST_WAIT_TIMEOUT": os.environ.get("TRIDIST_WAIT_TIMEOUT", "60"),
               # The host's cores shared among the ranks, as `tridist run` does: ranks that each take
               # every core for torch's CPU work (the tests' references) slow each other down.
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.size)))}
        if self.nnodes:
            env["TRIDIST_NNODES"] = str(self.nnodes)
        if self.backend == "emulator":
            from tridist.runtime.emulator import make_shared_folder  # not at the top: see SAFE_ENVIRONMENT

            self._folder = make_shared_folder("tridist-test-")
            env.update(TRITON_INTERPRET="1", TRIDIST_EMU_DIR=self._folder,
                       TRIDIST_HEAP_SIZE=os.environ.get("TRIDIST_HEAP_SIZE", "64M"))
        else:
            # Here, not at the top: spawned ranks import this module, and must not import tridist
            # before `_worker` has set their environment.
            import torch

            from tridist.runtime import sharing
            from tridist.runtime.nvshmem import SAFE_ENVIRONMENT

            per_gpu, gpus = ranks_per_gpu(), torch.cuda.device_count()
            if sharing.gpus_needed(self.size, per_gpu) > gpus:
                raise AssertionError(f"world {self.name}: {self.size} ranks at {per_gpu} per GPU need "
                                     f"{sharing.gpus_needed(self.size, per_gpu)} GPUs, this host has {gpus}; set "
                                     "TRIDIST_RANKS_PER_GPU (and run CUDA MPS: scripts/gpu_suite.sh with "
                                     "RANKS_PER_GPU)")
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), **SAFE_ENVIRONMENT,
                       **sharing.rank_environment(self.size, per_gpu))
        context = multiprocessing.get_context("spawn")
        for rank in range(self.size):
            parent, child = context.Pipe()
            process = context.Process(target=_worker, args=(rank, env, child), daemon=True)
            process.start()
            child.close()  # so that a rank that dies shows up here as end-of-file
            self._processes.append(process)
            self._conns.append(parent)
        self._collect("start")

    def run(self, body, **kwargs) -> list:
        """Run `body(world, **kwargs)` on every rank; returns the ranks' results in rank order."""
        if not self._processes:
            self._start()
        for conn in self._conns:
            conn.send((body.__module__, body.__name__, kwargs))
        return self._collect(body.__name__)

    def _collect(self, what: str) -> list:
        results, errors = [None] * self.size, []
        pending = dict(enumerate(self._conns))
        while pending:
            ready = multiprocessing.connection.wait(list(pending.values()), timeout=_BODY_TIMEOUT_S)
            if not ready:
                errors.append(f"ranks {sorted(pending)} did not finish {what} within {_BODY_TIMEOUT_S:.0f} s")
                break
            for rank, conn in list(pending.items()):
                if conn in ready:
                    del pending[rank]
                    try:
                        status, value = conn.recv()
                    except EOFError:
                        errors.append(f"rank {rank} died during {what}")
                        continue
                    if status == "error":
                        errors.append(f"rank {rank}:\n{value}")
                    else:
                        results[rank] = value
            if errors:
                break
        if errors:
            self.close()
            raise AssertionError(f"world {self.name}, {what}:\n" + "\n".join(errors))
        return results

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for process in self._processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
        self._processes, self._conns = [], []
        if self._folder:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None
