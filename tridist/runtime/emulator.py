"""The CPU emulator's shared-memory world: one process per rank, heaps in shared memory.

The ranks share a folder (TRIDIST_EMU_DIR, made by `tridist run` with `make_shared_folder`; under
torchrun, `torchrun_folder`, which the ranks remove as soon as each has mapped every file). Every
rank creates two files there: `heap.<rank>`, its symmetric heap, and `ctl.<rank>`, a small control
block of 64-bit words that the host side of the runtime uses (state, pid, barrier count, a gather
slot); and all of them lock `atomics.lock` around atomic read-modify-writes. Every rank maps every
other rank's heap, so a peer's buffer is plain memory at `peer_base + offset`.

Host gathers (`allgather_ints`) run among any set of ranks, the world or a group's members, and
only those take part. Each rank has one gather slot, tagged with the gather it holds (the members
and that set's count of gathers); a member waits for each peer's slot to carry the tag it expects,
reads it and counts one more read of that peer's slots in its own control block. A rank rewrites
its slot only once every reader of what it holds has counted it, so a rank can go on to another
group's gather while a slow member of the last one is still reading, and no barrier follows a
gather. (Two ranks in two groups must use them in the same order, as with any blocking collective.)

Waits here are always bounded, and while they spin they watch the peers: a peer that failed or
whose process is gone ends the wait at once with `PeerFailedError` instead of a timeout. A rank that
fails leaves in its control block the first line of its error and, where it failed because a peer
had, that peer's rank; the `PeerFailedError` of a rank that finds a failed peer follows those ranks
back to the first one that failed and quotes its error, so that ranks which failed in turn do not
hide the cause.
"""
import fcntl
import hashlib
import mmap
import os
import pickle
import tempfile
import threading
import time

import torch

from . import config
from .errors import PeerFailedError, WaitTimeoutError

# Control block layout, in 64-bit words: state, pid, host barrier count, then the gather slot
# (tag, length, values), then the failure record (the rank whose failure this rank's followed, or -1;
# when it failed, in ns since the epoch; the first line of its error, UTF-8, NUL-padded), then one
# word per rank: how many of that rank's gather slots this rank has read. 58 values hold the longest gather, a symmetric
# allocation's description and proposed offset (`heap.py`: 6 words and a shape of up to 8), with
# room to spare.
_STATE, _PID, _BARRIER, _GATHER_TAG, _GATHER_LEN, _GATHER = range(6)
_SLOT_END = 64
_GATHER_MAX = _SLOT_END - _GATHER
_AFTER, _FAILED_AT, _ERROR = _SLOT_END, _SLOT_END + 1, _SLOT_END + 2
_ERROR_BYTES = 512
_READS = _ERROR + _ERROR_BYTES // 8
_READY, _FINISHED, _FAILED = 1, 2, 3
_STARTUP_TIMEOUT_S = 300.0
_SHARED_ROOT = "/dev/shm" if os.path.isdir("/dev/shm") else None  # None: the default temporary folder


class LaunchAborted(Exception):
    """Another program of the same launch failed; this one stops quietly."""


# Set while a launch runs, so that waits can name the kernel and stop when a sibling program failed.
_launch = threading.local()


def current_kernel() -> str:
    return getattr(_launch, "kernel", None) or "<host>"


class _LaunchState:
    def __init__(self, kernel: str, coresident: bool = False):
        self.kernel = kernel
        self.coresident = coresident  # every program on a thread of its own (`kernel[grid](..., coresident=True)`)
        self.failed = threading.Event()


def _map(path: str, nbytes: int, create: bool) -> torch.Tensor:
    flags = os.O_RDWR | (os.O_CREAT if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return torch.frombuffer(mapping, dtype=torch.uint8)


def make_shared_folder(prefix: str) -> str:
    """A new folder for a world's heaps, in /dev/shm where there is one (so that the heaps live in
    memory), else in the default temporary folder; whoever makes it removes it."""
    return tempfile.mkdtemp(prefix=prefix, dir=_SHARED_ROOT)


def torchrun_folder() -> str | None:
    """The folder the ranks of a torchrun job share (made by the first rank to get there), or None
    outside torchrun. Its name comes from what every rank of the job knows and no other job has:
    torchrun's agent process (the ranks' parent), its run id, its master port and its restart count."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    job = ":".join([str(os.getppid()), os.environ["TORCHELASTIC_RUN_ID"], os.environ.get("MASTER_PORT", ""),
                    os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")])
    folder = os.path.join(_SHARED_ROOT or tempfile.gettempdir(),
                          "tridist-torchrun-" + hashlib.sha256(job.encode()).hexdigest()[:16])
    os.makedirs(folder, mode=0o700, exist_ok=True)
    return folder


def spin_until(done, describe, transport: "EmulatorTransport | None" = None, timeout_s: float | None = None) -> None:
    """Spin until `done()`; past the timeout raise `WaitTimeoutError(describe(seconds waited))`.

    Backs off from busy polling to 1 ms sleeps, so that a 2-core machine running four ranks and
    their programs' threads still makes progress. With `transport`, a failed or vanished peer ends
    the wait at once (`PeerFailedError`).
    """
    if done():
        return
    timeout_s = config.wait_timeout_s() if timeout_s is None else timeout_s
    start = time.monotonic()
    next_check = start
    pause = 0.0
    state = getattr(_launch, "state", None)
    while not done():
        now = time.monotonic()
        if now >= next_check:
            if state is not None and state.failed.is_set():
                raise LaunchAborted()
            if transport is not None:
                transport.check_peers()
            if now - start > timeout_s:
                raise WaitTimeoutError(describe(now - start))
            next_check = now + 0.05
        time.sleep(pause)
        pause = min(pause * 2 or 1e-5, 1e-3)


class EmulatorTransport:
    """This rank's view of an emulated world, the emulator's counterpart of `NvshmemTransport`: all
    heaps mapped, host barrier and gather."""

    def __init__(self, folder: str, rank: int, world_size: int, heap_bytes: int):
        self.folder, self.rank, self.world_size, self.heap_bytes = folder, rank, world_size, heap_bytes
        self._barriers = 0
        self._gathers: dict = {}  # members -> gathers among them so far
        self._sent = [0] * world_size  # per peer: gathers of mine that it has to read
        self._ctl_words = _READS + world_size
        self.first_failed = -1  # the first failed rank that a PeerFailedError of this rank named
        self._lock_file = open(os.path.join(folder, "atomics.lock"), "a+")
        self._thread_lock = threading.RLock()
        self.heap = _map(self._path("heap", rank), heap_bytes, create=True)
        ctl = _map(self._path("ctl", rank), self._ctl_words * 8, create=True)
        self._ctl = [None] * world_size
        self._ctl[rank] = ctl.view(torch.int64)
        self._ctl[rank][_PID] = os.getpid()
        self._ctl[rank][_AFTER] = -1
        self._ctl[rank][_STATE] = _READY
        self.heaps = [None] * world_size
        self.heaps[rank] = self.heap
        self._connect()

    def _path(self, kind: str, rank: int) -> str:
        return os.path.join(self.folder, f"{kind}.{rank}")

    def _connect(self) -> None:
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        for peer in range(self.world_size):
            if peer == self.rank:
                continue
            path = self._path("ctl", peer)
            while not (os.path.exists(path) and os.path.getsize(path) == self._ctl_words * 8):
                if time.monotonic() > deadline:
                    raise PeerFailedError(
                        f"rank {self.rank}: rank {peer} did not start within {_STARTUP_TIMEOUT_S:.0f} s "
                        f"(no {path}); start every rank with `tridist run -n {self.world_size}`"
                    )
                time.sleep(0.01)
            self._ctl[peer] = _map(path, self._ctl_words * 8, create=False).view(torch.int64)
            spin_until(lambda: int(self._ctl[peer][_STATE]) != 0,
                       lambda waited: f"rank {self.rank}: rank {peer} never became ready in {waited:.0f} s",
                       timeout_s=_STARTUP_TIMEOUT_S)
            heap_path = self._path("heap", peer)
            size = os.path.getsize(heap_path)
            if size != self.heap_bytes:
                raise PeerFailedError(
                    f"rank {self.rank}: rank {peer}'s heap is {size} bytes, mine is {self.heap_bytes}; "
                    "set the same TRIDIST_HEAP_SIZE on every rank"
                )
            self.heaps[peer] = _map(heap_path, self.heap_bytes, create=False)

    def peer_base(self, peer: int) -> int:
        return self.heaps[peer].data_ptr()

    def check_peers(self) -> None:
        """Raises PeerFailedError where a peer failed or its process is gone, naming the first rank
        that failed of its own (not because a peer had) and quoting its error's first line."""
        failed = [peer for peer in range(self.world_size) if peer != self.rank and self._failed_at(peer) is not None]
        if failed:
            own = [(self._failed_at(peer), peer) for peer in failed if int(self._ctl[peer][_AFTER]) < 0]
            self.first_failed = min(own)[1] if own else failed[0]
            raise PeerFailedError(f"rank {self.rank}: {self._failure(self.first_failed)}")

    def _failed_at(self, peer: int) -> int | None:
        """When `peer` failed (ns since the epoch; 0 for a process that died without a word), or None."""
        state = int(self._ctl[peer][_STATE])
        if state == _FAILED:
            return int(self._ctl[peer][_FAILED_AT])
        return 0 if state == _READY and not _alive(int(self._ctl[peer][_PID])) else None

    def _failure(self, peer: int) -> str:
        ctl = self._ctl[peer]
        if int(ctl[_STATE]) != _FAILED:
            return f"rank {peer} (pid {int(ctl[_PID])}) died"
        error = ctl[_ERROR:_READS].numpy().tobytes().rstrip(b"\0").decode(errors="replace")
        return f"rank {peer} failed while rank {self.rank} waited on it" + (f": {error}" if error else "")

    def barrier(self, group=None) -> None:
        """Host barrier of every rank, or of `group`'s members only (a gather of nothing)."""
        if group is not None and not group.is_world:
            self.allgather_ints((), group)
            return
        self._barriers += 1
        target = self._barriers
        self._ctl[self.rank][_BARRIER] = target
        spin_until(
            lambda: all(int(c[_BARRIER]) >= target for c in self._ctl),
            lambda waited: f"rank {self.rank}: host barrier #{target} timed out after {waited:.1f} s "
            f"(TRIDIST_WAIT_TIMEOUT raises the limit); barrier counts per rank: {[int(c[_BARRIER]) for c in self._ctl]}",
            transport=self,
        )

    def allgather_ints(self, values: tuple, group=None) -> list:
        """Every member's tuple of small ints, in group order: among `group`'s members (a Group),
        or every rank (None); the others take no part (see the module docstring)."""
        if len(values) > _GATHER_MAX:
            raise ValueError(f"allgather_ints takes at most {_GATHER_MAX} values")
        members = tuple(range(self.world_size)) if group is None else group.ranks
        seq = self._gathers[members] = self._gathers.get(members, 0) + 1
        what = f"host gather #{seq} of {'the world' if group is None else f'group {list(members)}'}"
        mine = self._ctl[self.rank]
        for peer, sent in enumerate(self._sent):  # every reader of what the slot holds has read it
            if sent and int(self._ctl[peer][_READS + self.rank]) < sent:
                spin_until(lambda peer=peer, sent=sent: int(self._ctl[peer][_READS + self.rank]) >= sent,
                           lambda waited, peer=peer: f"rank {self.rank}: {what}: rank {peer} did not read this "
                           f"rank's previous gather within {waited:.1f} s (TRIDIST_WAIT_TIMEOUT raises the limit)",
                           transport=self)
        tag = _gather_tag(members, seq)
        mine[_GATHER_TAG] = 0
        mine[_GATHER:_GATHER + len(values)] = torch.tensor(values, dtype=torch.int64)
        mine[_GATHER_LEN] = len(values)
        mine[_GATHER_TAG] = tag  # last: a reader that sees the tag sees the values
        out = []
        for peer in members:
            if peer == self.rank:
                out.append(tuple(int(v) for v in values))
                continue
            self._sent[peer] += 1
            theirs = self._ctl[peer]
            spin_until(lambda: int(theirs[_GATHER_TAG]) == tag,
                       lambda waited, peer=peer: f"rank {self.rank}: {what} timed out after {waited:.1f} s waiting "
                       f"for rank {peer} (TRIDIST_WAIT_TIMEOUT raises the limit)", transport=self)
            out.append(tuple(int(v) for v in theirs[_GATHER:_GATHER + int(theirs[_GATHER_LEN])]))
            mine[_READS + peer] += 1
        return out

    def allgather_objects(self, value, group=None) -> list:
        """Every member's `value` (any picklable object, such as an error message), in group order
        (`group` as in `allgather_ints`): pickled and carried through `allgather_ints`, its length
        and first words in one round (what the ops' checks send fits), the rest in as many more as
        the longest takes."""
        data = pickle.dumps(value)
        mine = torch.frombuffer(bytearray(data.ljust(-(-len(data) // 8) * 8, b"\0")), dtype=torch.int64).tolist()
        first = self.allgather_ints((len(data), *mine[:_GATHER_MAX - 1]), group)
        sizes, parts = [size for size, *_ in first], [list(words) for _, *words in first]
        for start in range(_GATHER_MAX - 1, -(-max(sizes) // 8), _GATHER_MAX):
            for index, words in enumerate(self.allgather_ints(tuple(mine[start:start + _GATHER_MAX]), group)):
                parts[index] += words
        return [pickle.loads(torch.tensor(words, dtype=torch.int64).numpy().tobytes()[:size])
                for size, words in zip(sizes, parts)]

    def attach_device_barrier(self, slots: torch.Tensor) -> None:
        """The symmetric words `dl.shmem.barrier_all` uses: slot r holds rank r's latest epoch."""
        self.device_barrier = slots
        self._device_barriers = 0
        self._epoch_lock = threading.Lock()

    def next_device_barrier_epoch(self) -> int:
        with self._epoch_lock:
            self._device_barriers += 1
            return self._device_barriers

    def atomic_lock(self):
        """A lock held around every atomic read-modify-write, across processes and threads."""
        return _AtomicLock(self._thread_lock, self._lock_file)

    def close(self, failed: bool = False, error: str | None = None, failed_at: int | None = None) -> None:
        """Leave the world, finished or `failed`. A failed rank's record, written once, is what its
        peers' PeerFailedError quotes: `error`, the first line of its error (cut to 512 bytes), when
        it failed (`failed_at`, ns since the epoch; default now) and the peer whose failure it
        followed, if a PeerFailedError of this rank named one."""
        mine = self._ctl[self.rank]
        if failed and int(mine[_STATE]) != _FAILED:
            text = (error or "").encode()
            if len(text) >= _ERROR_BYTES:
                text = text[:_ERROR_BYTES - 4].decode(errors="ignore").encode() + b"..."
            mine[_ERROR:_READS] = torch.frombuffer(bytearray(text.ljust(_ERROR_BYTES, b"\0")), dtype=torch.int64)
            mine[_FAILED_AT] = time.time_ns() if failed_at is None else failed_at
            mine[_AFTER] = self.first_failed
        mine[_STATE] = _FAILED if failed else _FINISHED


class _AtomicLock:
    def __init__(self, thread_lock, lock_file):
        self._thread_lock, self._lock_file = thread_lock, lock_file

    def __enter__(self):
        self._thread_lock.acquire()
        fcntl.flock(self._lock_file, fcntl.LOCK_EX)

    def __exit__(self, *exc):
        fcntl.flock(self._lock_file, fcntl.LOCK_UN)
        self._thread_lock.release()


def _gather_tag(members: tuple, seq: int) -> int:
    """A word that names gather `seq` among `members` (never 0, which marks a slot being written)."""
    digest = hashlib.blake2b(repr((members, seq)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True) or 1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
