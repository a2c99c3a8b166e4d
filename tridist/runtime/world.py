"""The world: who this rank is, how ranks group into (possibly virtual) nodes, and its heap.

`init()` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), starts the
backend chosen at import (see `backend.py`) and allocates the symmetric heap. With `nnodes` (or
TRIDIST_NNODES) the ranks of one host are split into that many virtual nodes: peers on another
virtual node are treated as remote (reached with put/get, never through a pointer), so the
inter-node code paths run on a single machine. With TRIDIST_RANKS_PER_GPU=K several ranks share a
GPU (`sharing.py`): the host's rank LOCAL_RANK runs on GPU LOCAL_RANK // K, with a gloo host group.

torch.distributed is started by `init()` where the job has not started it (NCCL on GPUs, gloo in the
emulator), or joined where it has (any backend), so that process groups (`dist.new_group`, a
DeviceMesh) work alike under `tridist run` and torchrun, on both backends (`groups.py`).
"""
import atexit
import contextlib
import dataclasses
import json
import os
import shutil
import sys
import time

import torch

from . import backend as _backend
from . import config, sharing, wait_report
from .errors import NotInitializedError, TridistError
from .heap import SymmetricHeap


@dataclasses.dataclass(frozen=True)
class World:
    """Who this rank is and where it stands, as `tridist.init()` and `tridist.world()` return it.

    Ranks are numbered node by node: rank r is on node r // local_world_size.

    Attributes:
        rank: this rank, as torchrun's RANK.
        world_size: the number of ranks, as torchrun's WORLD_SIZE.
        local_rank: this rank's index on its node, where a node is a *virtual* one when
            TRIDIST_NNODES (or `init(nnodes=...)`) splits a host; not torchrun's LOCAL_RANK,
            which counts ranks on the host and picks the GPU.
        local_world_size: the ranks per node.
        node: this rank's node.
        nnodes: the number of nodes. Ranks on one node reach each other's symmetric memory
            through pointers (`dl.symm_at`, `tridist.peer_tensor`), others only through puts
            and gets (`dl.shmem`).
        backend: `"emulator"` or `"nvshmem"` (`tridist.BACKEND`).
        device: this rank's device: its GPU, or the CPU in the emulator.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node: int
    nnodes: int
    backend: str
    device: torch.device

    def node_of(self, rank: int) -> int:
        """The node of `rank`."""
        return rank // self.local_world_size

    def same_node(self, rank: int) -> bool:
        """Whether `rank` is on this rank's node (load/store reachable)."""
        return self.node_of(rank) == self.node


class _State:
    world: World | None = None
    transport = None
    heap: SymmetricHeap | None = None
    bounded_barrier: tuple[torch.Tensor, torch.Tensor] | None = None
    failed = False  # this rank failed: its GPU context may be lost, so it is left alone
    finalized = False


_state = _State()


def _env_int(name: str, default: int) -> int:
    """A launcher's integer setting (RANK, WORLD_SIZE, ...), `default` when unset."""
    value = os.environ.get(name)
    if value in (None, ""):
        return default
    try:
        return int(value)
    except ValueError:
        raise TridistError(f"{name}={value!r}: expected an integer, as torchrun or `tridist run` sets it") from None


def _layout(nnodes: int | None) -> tuple[int, int, int, int, int, int]:
    rank = _env_int("RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    host_world = _env_int("LOCAL_WORLD_SIZE", world_size)
    if not 0 <= rank < world_size:
        raise TridistError(f"RANK={rank} is outside WORLD_SIZE={world_size}")
    if world_size % host_world:
        raise TridistError(f"WORLD_SIZE={world_size} is not a multiple of LOCAL_WORLD_SIZE={host_world}")
    if nnodes is None:
        nnodes = config.virtual_nodes()
    if nnodes is None:
        nnodes = world_size // host_world
    if nnodes < 1 or world_size % nnodes:
        raise TridistError(f"nnodes={nnodes} must divide the world size {world_size}")
    per_node = world_size // nnodes
    if host_world % per_node:
        raise TridistError(
            f"nnodes={nnodes} gives {per_node} ranks per node, which does not split the {host_world} ranks of a "
            "host evenly; choose nnodes so that ranks per host is a multiple of ranks per node"
        )
    return rank, world_size, rank % per_node, per_node, rank // per_node, nnodes


def init(backend: str | None = None, nnodes: int | None = None) -> World:
    """Join the world: every rank calls it once, before any other tridist function.

    Reads the launcher's RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE (set by torchrun or
    `tridist run`; a process started alone is rank 0 of a world of 1), starts the backend chosen
    when tridist was imported and allocates this rank's symmetric heap (TRIDIST_HEAP_SIZE). On
    GPUs rank r takes GPU LOCAL_RANK. Starts torch.distributed where the job has not (NCCL on
    GPUs, gloo in the emulator) and joins it where it has (any backend), so that process groups
    (`dist.new_group`, a DeviceMesh) work alike on both backends: see
    [`tridist.group`][tridist.group]. Idempotent: a second call returns the same world.

    Args:
        backend: `"nvshmem"` or `"emulator"`; must be the backend tridist was imported with
            (None: that one). To choose, set TRIDIST_BACKEND before importing tridist.
        nnodes: split the ranks of one host into this many virtual nodes (default:
            TRIDIST_NNODES, else the real nodes, WORLD_SIZE / LOCAL_WORLD_SIZE).

    Returns:
        This rank's [`World`][tridist.World].

    Raises:
        TridistError: a backend other than the imported one; already initialised with other
            arguments; called after `finalize()`; `nnodes` that does not divide the world or
            split a host evenly; more ranks on a host than GPUs; on GPUs, ranks that may use
            different numbers of SMs (`same_sms`); in the emulator, a world of more than one rank
            started by neither `tridist run` nor torchrun, or on several hosts, or a
            torch.distributed started with other ranks than RANK and WORLD_SIZE say.
    """
    if _state.world is not None:
        w = _state.world
        if (backend not in (None, w.backend)) or (nnodes not in (None, w.nnodes)):
            raise TridistError(f"tridist is already initialised with backend={w.backend}, nnodes={w.nnodes}")
        return w
    if _state.finalized:
        raise TridistError("tridist.init() after tridist.finalize() is not supported; start a new process")
    if backend is not None and backend != _backend.BACKEND:
        raise TridistError(
            f"backend={backend!r} but this process imported tridist with the {_backend.BACKEND!r} backend; "
            f"set TRIDIST_BACKEND={backend} before importing tridist (kernels are defined at import)"
        )
    rank, world_size, local_rank, local_world_size, node, nnodes = _layout(nnodes)
    heap_bytes = config.heap_bytes(_backend.BACKEND)
    if _backend.BACKEND == _backend.EMULATOR:
        from .emulator import EmulatorTransport

        device = torch.device("cpu")
        folder, torchrun = _emulator_folder(world_size)
        transport = EmulatorTransport(folder, rank, world_size, heap_bytes)
        _join_torch_distributed(rank, world_size, folder, torchrun)
        if torchrun:
            # Every rank has mapped every file and opened the lock: the folder can go now, so that a job
            # that is killed leaves nothing behind in /dev/shm (nobody else would remove it).
            transport.barrier()
            if rank == 0:
                shutil.rmtree(folder, ignore_errors=True)
    else:
        from .nvshmem import NvshmemTransport

        host_world = _env_int("LOCAL_WORLD_SIZE", world_size)
        host_rank = _env_int("LOCAL_RANK", rank % host_world)
        per_gpu = config.ranks_per_gpu()
        gpu, gpus = sharing.gpu_of(host_rank, per_gpu), torch.cuda.device_count()
        if gpu >= gpus:
            raise TridistError(
                f"rank {rank} wants GPU {gpu} but this host has {gpus}; start at most {gpus * per_gpu} ranks per "
                f"host, or share GPUs: `tridist run --ranks-per-gpu K` (TRIDIST_RANKS_PER_GPU=K) puts K ranks on each"
            )
        device = torch.device("cuda", gpu)
        per_node = world_size // nnodes
        reachable = [peer // per_node == node for peer in range(world_size)]
        transport = NvshmemTransport(rank, world_size, device, heap_bytes, reachable,
                                     sharing.process_group_backend(host_world, per_gpu))
        if config.debug():
            wait_report.register_page()
    world = World(rank, world_size, local_rank, local_world_size, node, nnodes, _backend.BACKEND, device)
    _state.transport = transport
    _state.heap = SymmetricHeap(transport, rank, checked=_backend.is_emulator() or config.debug())
    _state.world = world
    if _backend.is_emulator():
        transport.attach_device_barrier(_state.heap.allocate((world_size,), torch.int64))
    elif config.debug():
        from .tensors import signals

        # A slot per rank and a count of the barriers passed, for `ops.sync`'s bounded barrier:
        # allocated here, where every rank is, rather than at a first barrier, perhaps inside a
        # CUDA-graph capture.
        _state.bounded_barrier = (signals(world_size), torch.zeros(1, dtype=torch.int64, device=device))
    if not _backend.is_emulator():
        from .occupancy import available_sms

        same_sms([sms for (sms,) in transport.allgather_ints((available_sms(device)[0],))])
    _install_failure_hook()
    atexit.register(finalize)
    return world


def same_sms(sms: list[int]) -> None:
    """Raises TridistError (on every rank: each has every rank's count) unless every rank may use as
    many SMs (`sms[r]`, `occupancy.available_sms`): the ops size the pieces of their exchanges by
    it, so ranks that counted differently would lay out one exchange two ways."""
    if len(set(sms)) > 1:
        counts = ", ".join(f"rank {rank}: {count}" for rank, count in enumerate(sms))
        raise TridistError(f"the ranks may use different numbers of SMs ({counts}); tridist's ops size their "
                           "exchanges by it on every rank alike: give every rank the same GPU model and the same "
                           "share of it (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, TRIDIST_RANKS_PER_GPU)")


def _emulator_folder(world_size: int) -> tuple[str, bool]:
    """The folder the emulated ranks share, and whether torchrun's ranks made it (see `init`)."""
    from .emulator import make_shared_folder, torchrun_folder

    folder = config.emulator_folder()
    if folder:
        return folder, False
    if world_size == 1:
        folder = make_shared_folder("tridist-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        return folder, False
    host_world = _env_int("LOCAL_WORLD_SIZE", world_size)
    if host_world != world_size:
        raise TridistError(f"the emulator runs the ranks of one host, but WORLD_SIZE={world_size} with "
                           f"LOCAL_WORLD_SIZE={host_world}; start all of them on one host (virtual nodes: "
                           "TRIDIST_NNODES)")
    folder = torchrun_folder()
    if folder is None:
        raise TridistError(
            f"WORLD_SIZE={world_size} in the emulator needs the ranks' shared folder; start the job with "
            f"`tridist run -n {world_size} script.py` or `torchrun --nproc-per-node {world_size} script.py`"
        )
    return folder, True


def _join_torch_distributed(rank: int, world_size: int, folder: str, torchrun: bool) -> None:
    """The emulator's torch.distributed, for process groups: the job's own if it started one (it must
    number the ranks as RANK does), else gloo, through torchrun's store or a file in the ranks' shared
    folder. (On GPUs `NvshmemTransport` does the same with NCCL.)"""
    import torch.distributed as dist

    if dist.is_initialized():
        if (dist.get_world_size(), dist.get_rank()) != (world_size, rank):
            raise TridistError(f"torch.distributed has rank {dist.get_rank()} of {dist.get_world_size()}, but tridist "
                               f"has RANK={rank} of WORLD_SIZE={world_size}: start both from the same launcher")
        return
    if torchrun:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    else:
        store = dist.FileStore(os.path.join(folder, "torch-distributed-store"), world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)


def _install_failure_hook() -> None:
    previous = sys.excepthook

    def fail(kind, value, traceback):
        mark_failed(value)
        previous(kind, value, traceback)

    sys.excepthook = fail


def mark_failed(error: BaseException | None = None) -> None:
    """This rank failed (an uncaught exception, or a kernel that failed on the GPU, whose context is
    then lost): tell the peers (the emulator's waits end at once, quoting `error`'s first line) and
    `tridist run` (its summary names the first rank that failed, and why), and leave the device
    alone from here on, `finalize` at exit included."""
    _state.failed = True
    if _state.transport is None:
        return
    line = None if error is None else (f"{type(error).__name__}: {error}".splitlines() or [""])[0]
    now = time.time_ns()
    if _backend.is_emulator():
        _state.transport.close(failed=True, error=line, failed_at=now)
        after = _state.transport.first_failed
    else:
        _state.transport.close(failed=True)
        after = -1
    folder = config.failure_folder()
    if folder and line is not None:
        with contextlib.suppress(OSError):
            with open(os.path.join(folder, str(_env_int("RANK", 0))), "w") as f:
                json.dump({"error": line, "after": None if after < 0 else after, "failed_at": now}, f)


def finalize() -> None:
    """Leave the world (also run at exit). Buffers from the symmetric heap must not be used
    afterwards, and `init()` cannot be called again in this process."""
    if _state.world is None:
        return
    _state.transport.close(failed=_state.failed)
    from . import groups

    groups.forget()
    _state.world = None
    _state.heap = None
    _state.bounded_barrier = None
    _state.finalized = True


def world() -> World:
    """This rank's [`World`][tridist.World].

    Raises:
        NotInitializedError: before `tridist.init()`.
    """
    if _state.world is None:
        raise NotInitializedError("tridist is not initialised: call tridist.init() first")
    return _state.world


def heap() -> SymmetricHeap:
    world()
    return _state.heap


def bounded_barrier() -> tuple[torch.Tensor, torch.Tensor]:
    """On GPUs with TRIDIST_DEBUG=1: the symmetric slots (one per rank) and the device-side count of
    `ops.sync`'s bounded barrier."""
    world()
    return _state.bounded_barrier


def transport():
    world()
    return _state.transport
