"""What the ops share: the call protocol, the checks of their arguments, how they size their work,
and the copy-engine transfers.

In this file, top down: the protocol (epochs, flags, `Workspace`, the LL `PacketRows`); checks and
the per-stream instance cache; device helpers that copy, push and split; sizing (`steps_for`,
`slices_for`, `warps_for`, `programs_for`, and `piece_sizes` to change the sizes while testing);
the copy engines (`SideStream`, `PeerStreams`, `CopyEnginePush`).

Protocol. Each op instance owns a symmetric workspace with two slots, and a counter of its calls
kept on the device (so that CUDA-graph replays count too). Call `e` (counting from 1) uses slot
`e % 2` and raises flags to the value `e`; readers wait for exactly `e`, so flags need no reset.
Two slots suffice without any handshake because every call waits for a flag from every peer: when a
rank starts call e+2, each peer has started call e+1, so each peer has finished call e, the last
one that used the slot about to be overwritten.

The calls counter counts finished programs: every program adds 1 as it ends (a relaxed atomic,
which waits for nothing). An instance always launches the same number of programs P, and launches
of one stream do not overlap, so when a program reads the counter it holds (e-1) * P plus the
programs of call e that already ended, fewer than P: every program of a launch computes the same
`e` = counter // P + 1. One op instance must not be used by two streams at once; use one instance
per stream.
"""
import contextlib

import torch
import triton
import triton.language as tl
from torch._C._distributed_c10d import _SymmetricMemory

import tridist
from tridist.runtime import config, occupancy
from tridist.runtime.backend import is_emulator
from tridist.runtime.world import heap, transport
from tridist.runtime.tensors import check_tensor

from .. import language as dl
from . import sync


@triton.jit
def _programs():
    return tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)


@triton.jit
def call_epoch(calls_ptr):
    """This launch's epoch: 1 + the number of earlier launches of this op instance."""
    return dl.ld(calls_ptr, scope="gpu", semantic="relaxed") // _programs() + 1


@triton.jit
def in_slot(base_ptr, epoch, slot_size):
    """The part of a two-slot buffer that call `epoch` uses: slot `epoch % 2` of `slot_size`
    elements from `base_ptr` (see "Protocol" above)."""
    return base_ptr + (epoch % 2) * slot_size


@triton.jit
def after_flags(pointer, flags_ptr, count, value):
    """`pointer`, once the `count` flags from `flags_ptr` on all equal `value`. Loads through the
    result stay after the wait (`dl.consume_token`); the acquire is at system scope because the
    flags are raised by other GPUs' releases."""
    token = dl.wait(flags_ptr, count, scope="sys", semantic="acquire", waitValue=value)
    return dl.consume_token(pointer, token)


@triton.jit
def notify_peers(flag_ptr, value):
    """Raise the flag at `flag_ptr` to `value` on every other rank (all on this node), the next rank
    first."""
    me = dl.rank()
    world = dl.num_ranks()
    for step in range(1, world):
        dl.notify(flag_ptr, (me + step) % world, signal=value, sig_op="set")


@triton.jit
def sync_program():
    """Every thread of this program waits here, and its stores to global memory so far are visible
    to all the others after it. Needed wherever a program reads back what it stored: Triton lays out
    each load and store on its own (an fp32 store of a sum computed from bf16 loads moves 4 elements
    a thread, the fp32 load of it 8), so an element may be stored by one warp and loaded by another
    that ran ahead, as many programs per SM make likely (it happened: benchmarks/NOTES.md, "Moved from
    the code's docstrings (issue 41)")."""
    tl.debug_barrier()


@triton.jit
def finish_call(calls_ptr):
    """Every program calls this last. Relaxed: the next launch starts after this one has ended, and
    a launch's end makes its writes visible to the next."""
    dl.atomic_add(calls_ptr, 1, scope="gpu", semantic="relaxed")


class Workspace:
    """Symmetric staging for one op instance: two slots of `slot_numel` elements of `dtype` (none
    for kernels that write straight into symmetric tensors of the caller's), a block of signal
    words per slot, and the device-side calls counter. `name` (e.g. "all_gather push") names the
    allocations in the report of a wait that expires on them ("all_gather push flags[5]")."""

    def __init__(self, slot_numel: int, dtype: torch.dtype, signals_per_slot: int, name: str | None = None):
        self.slot_numel = slot_numel
        # Zeroed: packets (LL) left in this memory by an op freed before would look fresh to a
        # reader expecting the same epoch.
        self.staging = (tridist.symm_zeros((2, slot_numel), dtype, name and f"{name} staging") if slot_numel
                        else None)
        self.flags = tridist.signals(2 * signals_per_slot, name and f"{name} flags").view(2, signals_per_slot)
        self.calls = torch.zeros(1, dtype=torch.int64, device=tridist.world().device)

    def free(self) -> None:
        tridist.symm_free(self.flags.view(-1))
        if self.staging is not None:
            tridist.symm_free(self.staging)


LL_BLOCK = 1024  # packets per step of the low-latency kernels


@triton.jit
def unpack_halves(words, dtype: tl.constexpr):
    """int32 words, each holding two 16-bit floats of `dtype` (the lower address low) -> (low, high) in fp32."""
    low = tl.cast((words & 0xFFFF).to(tl.int16), dtype, bitcast=True).to(tl.float32)
    high = tl.cast(((words >> 16) & 0xFFFF).to(tl.int16), dtype, bitcast=True).to(tl.float32)
    return low, high


@triton.jit
def pack_halves(low, high, dtype: tl.constexpr):
    """The inverse of `unpack_halves`: fp32 (low, high), rounded to `dtype`, -> int32 words."""
    low_bits = tl.cast(low.to(dtype), tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    high_bits = tl.cast(high.to(dtype), tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return low_bits | (high_bits << 16)


class PacketRows(Workspace):
    """Staging for the low-latency (LL) methods: per slot, a row of `words` packets for each rank
    (`dl.ll`: a 4-byte word and its flag in 8 bytes), moved by `splits` programs per row. `what`
    names the op in the error raised where the data is not whole 4-byte words."""

    def __init__(self, what: str, nbytes: int, programs: int):
        w = tridist.world()
        if nbytes % 4:
            raise ValueError(f"{what} method 'll' moves 4-byte words: each rank's part must be a multiple of 4 "
                             f"bytes, got {nbytes}")
        self.words = nbytes // 4
        self.splits = splits_for(self.words, LL_BLOCK, programs)
        self.row = row_stride(self.words)
        super().__init__(w.world_size * self.row, torch.int64, 1, f"{what} ll")


SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)
TRITON_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def check_input(x: torch.Tensor, name: str, dtypes=SUPPORTED) -> None:
    """`x` is a contiguous tensor on this rank's device with one of `dtypes` (it may be empty)."""
    check_tensor(x, name)
    if x.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {x.dtype}; supported: {', '.join(str(d) for d in dtypes)}")


def check_build(op: str, numel: int, dtype: torch.dtype, dtypes=SUPPORTED) -> None:
    """What an op instance for `numel` elements of `dtype` per rank needs before it allocates anything."""
    if dtype not in dtypes:
        raise ValueError(f"{op} takes {', '.join(str(d) for d in dtypes)}; got {dtype}")
    if not isinstance(numel, int) or numel < 0:
        raise ValueError(f"{op} needs a non-negative int number of elements per rank, got {numel!r}")


def check_same(x: torch.Tensor, numel: int, dtype: torch.dtype, op: str, dtypes=SUPPORTED) -> None:
    """x is what an op instance built for `numel` elements of `dtype` takes."""
    check_input(x, "x", dtypes)
    if x.numel() != numel or x.dtype != dtype:
        raise ValueError(f"this {op} was built for {numel} {dtype} elements per rank; x has {x.numel()} {x.dtype}: "
                         "build another instance, or call the op's function in tridist.ops, which keeps one per shape")


def capturing() -> bool:
    """A CUDA graph is being captured on the current stream (never in the emulator)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def host_reads(t: torch.Tensor) -> bool:
    """Whether a check may read the values of `t` on the host: always for CPU tensors (the
    emulator), for GPU tensors only with TRIDIST_DEBUG=1 (each read is a device synchronisation),
    and never while a CUDA graph is captured (the read would end the capture). What the checks that
    read values leave to the device elsewhere, each op's docstring says."""
    if capturing():
        return False
    return t.device.type == "cpu" or config.debug()


_agreed: set = set()  # the (op, values) whose first call every rank checked together


def agree(op: str, local=None, same: dict | None = None):
    """The checks of one call of the collective `op`, with an outcome every rank shares: the one
    way the ops check their arguments, so that a bad argument on one rank never leaves the others
    waiting for it.

    `local()` runs this rank's checks of its own arguments, raising ValueError or TypeError with a
    message for the user; `same` maps what every rank must pass alike (e.g. "shape of x") to this
    rank's value (ints, strings, tuples of them). Every rank gathers every rank's outcome and
    values (a host collective) and raises the same error: each failing rank's message, prefixed
    with its rank, or the values that differ, rank by rank.

    The gather runs in the emulator and with TRIDIST_DEBUG=1 at every call, and otherwise (GPUs) at
    the first call with each new `same` (the call that builds an instance and allocates collectively
    anyway), so that later calls cost no host round trip. Never while a CUDA graph is captured (a
    host collective would end the capture): there, and on later GPU calls, a local error is raised
    on this rank alone. Returns what `local()` returned."""
    same = same or {}
    error = result = None
    try:
        if local is not None:
            result = local()
    except (ValueError, TypeError) as raised:
        error = raised
    key = (op, tuple(same.items()))
    if capturing() or not (config.debug() or is_emulator() or key not in _agreed):
        if error is not None:
            raise error
        return result
    mine = (None if error is None else (type(error).__name__, str(error)), tuple(same.values()))
    everyone = transport().allgather_objects(mine)
    failed = [(rank, outcome) for rank, (outcome, _) in enumerate(everyone) if outcome is not None]
    if failed:
        kinds = {kind for _, (kind, _) in failed}
        kind = TypeError if kinds == {"TypeError"} else ValueError
        messages = {}
        for rank, (_, message) in failed:
            messages.setdefault(message, []).append(rank)
        raise kind(f"{op}: " + "; ".join(f"{_ranks(ranks)}: {message}" for message, ranks in messages.items()))
    for index, what in enumerate(same):
        values = [values[index] for _, values in everyone]
        if len(set(values)) > 1:
            listed = ", ".join(f"rank {rank}: {value}" for rank, value in enumerate(values))
            raise ValueError(f"{op}: ranks passed different {what} ({listed}); every rank must pass the same")
    _agreed.add(key)
    return result


def _ranks(ranks: list) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)


def shape_of(t) -> tuple | str:
    """What `agree` compares for a tensor argument: its shape and dtype (or what else it is)."""
    return (*t.shape, str(t.dtype).removeprefix("torch.")) if isinstance(t, torch.Tensor) else type(t).__name__


def symmetric_identity(t: torch.Tensor | None) -> str:
    """What `agree` compares for an argument that may be a symmetric tensor: where it lies in the
    heap (the same on every rank for the same tensor), or "not symmetric" (a regular tensor, None)."""
    if not isinstance(t, torch.Tensor) or not tridist.is_symmetric(t):
        return "not symmetric"
    return f"symmetric, {t.numel() * t.element_size()} bytes at heap offset {heap().offset_of(t)}"


INDEX_LIMIT = 1 << 31  # the kernels index rows of x, out and staging with 32-bit offsets


def check_offsets(op: str, elements: int) -> None:
    """`elements`: the furthest element (of x, out or staging) the op's kernels index from a base
    pointer. Past 2^31 the 32-bit offsets would wrap, so refuse the size instead."""
    if elements >= INDEX_LIMIT:
        raise ValueError(f"{op} indexes its buffers with 32-bit offsets and would reach element {elements} here "
                         f"(at most {INDEX_LIMIT - 1}): split the call into smaller ones")


def check_output(out: torch.Tensor, shape: tuple, dtype: torch.dtype) -> None:
    check_tensor(out, "out")
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
        raise ValueError(f"out must be {dtype} of shape {tuple(shape)}, got {out.dtype} of shape {tuple(out.shape)}")


_instances: dict = {}


def instance(build, *key, device: torch.device):
    """The op instance for `key` on the current stream, made once by `build()`. The functions of
    `tridist.ops` keep one per shape and stream, since an instance must not serve two streams at once."""
    key = (*key, torch.cuda.current_stream() if device.type == "cuda" else None)
    if key not in _instances:
        _instances[key] = build()
    return _instances[key]


def free_instances() -> int:
    """Free every op instance that the functions of `tridist.ops` keep (`instance`), so that a
    program moving on to other shapes gets its symmetric heap back; the next call of a function
    builds a new one. A collective: every rank calls it at the same point, once no call of those
    instances is in flight on any rank (after `tridist.barrier_all()`). Returns how many it freed."""
    freed = len(_instances)
    for op in _instances.values():  # in the order they were built: the same on every rank
        op.free()
    _instances.clear()
    _agreed.clear()  # their shapes are checked together again at their next first call
    return freed


def method_error(op: str, method: str, methods) -> ValueError:
    return ValueError(f"{op}: unknown method {method!r}; choose one of {', '.join(methods)}")


def require_one_node(what: str, instead: str) -> None:
    """`what` (e.g. "all_gather method 'll'") reaches its peers through `symm_at` or the copy
    engines, which reach the ranks of this node only."""
    nnodes = tridist.world().nnodes
    if nnodes > 1:
        raise ValueError(f"{what} works within one node; this world has {nnodes} nodes: use {instead}")


@triton.jit
def placement(local_world_size):
    """(rank, world size, nodes, this rank's node, its index on the node)."""
    me = dl.rank()
    world = dl.num_ranks()
    return me, world, world // local_world_size, me // local_world_size, me % local_world_size


@triton.jit
def copy_slice(src_ptr, dst_ptr, start, stop, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    for offset in range(start, stop, BLOCK):
        mask = offset + offsets < stop
        tl.store(dst_ptr + offset + offsets, tl.load(src_ptr + offset + offsets, mask=mask), mask=mask)


@triton.jit
def push_slice(src_ptr, dst_ptr, start, stop, flag_ptr, epoch, peer, local_world_size, BLOCK: tl.constexpr,
               WIDE: tl.constexpr = True):
    """Copy src[start:stop] to dst[start:stop] on `peer` (`dst_ptr` is this rank's address of the
    symmetric destination), then set the peer's flag to `epoch`. On this node the program stores
    through the peer's pointer and raises the flag with a release; on another node NVSHMEM puts the
    data with the signal attached (and the caller's `quiet` completes it). WIDE: in 16-byte stores
    (`dl.symm_at`'s `aligned`), else 2 bytes at a time for 16-bit data (see `_send_chunks`)."""
    me = dl.rank()
    if peer // local_world_size == me // local_world_size:
        copy_slice(src_ptr, dl.symm_at(dst_ptr, peer, aligned=WIDE), start, stop, BLOCK)
        dl.notify(flag_ptr, peer, signal=epoch, sig_op="set")
    else:
        nbytes = (stop - start) * (src_ptr.dtype.element_ty.primitive_bitwidth // 8)
        dl.shmem.putmem_signal_nbi_block(dst_ptr + start, src_ptr + start, nbytes, flag_ptr, epoch,
                                         dl.shmem.SIGNAL_SET, peer)


@triton.jit
def split_bounds(n, split, splits, BLOCK: tl.constexpr):
    """Part `split` [start, stop) of n elements cut in `splits` parts. Parts are whole BLOCKs, so
    that Triton can prove their starts aligned and keeps loads and stores vectorised; the last
    parts may be empty (start == stop == n)."""
    per_split = tl.cdiv(tl.cdiv(n, splits), BLOCK) * BLOCK
    start = tl.minimum(split * per_split, n)
    return start, tl.minimum(start + per_split, n)


def row_stride(numel: int) -> int:
    """Staging rows start at multiples of 64 elements (64 bytes for 1-byte types), so that every row
    admits 16-byte vector accesses."""
    return triton.cdiv(numel, 64) * 64


def splits_for(numel: int, block: int, programs: int) -> int:
    """Programs per destination: a block or more each, at most `programs`."""
    return max(1, min(programs, triton.cdiv(numel, block)))


SMALLEST_STEP = 2048  # elements
STEP_BYTES = 16 << 10


def steps_for(numel: int, itemsize: int, programs: int, step_bytes: int = STEP_BYTES) -> tuple[int, int, int]:
    """(BLOCK, splits, num_warps) for the SM kernels that move or sum `numel` elements: the elements
    a program handles per loop step, the programs that share the work (at most `programs`), and the
    warps of each (`warps_for`).

    A step's loads complete before its stores are issued, so a program moves about one step per
    memory latency, and large messages need large steps (4 KB steps held a copy to far below what
    16 KB steps reached: benchmarks/NOTES.md, "Moved from the code's docstrings (issue 41)").
    Steps grow from SMALLEST_STEP elements to `step_bytes` as long as every one of the programs
    still gets a whole step, so small messages keep their programs."""
    block = SMALLEST_STEP
    while 2 * block * itemsize <= step_bytes and numel >= 2 * block * programs:
        block *= 2
    return block, splits_for(numel, block, programs), warps_for(block, itemsize)


SLICE_BYTES = 128 << 10  # see `slices_for`


def slices_for(numel: int, itemsize: int, splits: int) -> int:
    """Slices of `numel` elements for kernels whose `splits` programs take them in turn (program s:
    slices s, s + splits, ...), each slice with its own flag, so that its consumer starts on it while
    later slices are still on the wire. About SLICE_BYTES each: large enough that the release after
    each slice (which waits until its remote stores have landed) costs little next to sending it,
    small enough that the last slice, which nothing overlaps, is short."""
    return max(splits, triton.cdiv(numel * itemsize, SLICE_BYTES))


def warps_for(block: int, itemsize: int) -> int:
    """Warps for a step of `block` elements: 64 bytes or fewer per thread. More, and Triton's
    per-element offsets and masks run out of registers (16 KB of bf16 on 4 warps: 255 and spills)."""
    return max(4, block * itemsize // 2048)


def programs_for(device: torch.device) -> int:
    """One program per SM this process may use: what the ops launch at most by default. Under CUDA MPS
    (ranks sharing a GPU) that is this rank's share (`occupancy.available_sms`)."""
    if device.type == "cuda":
        return occupancy.available_sms(device)[0]
    return 4  # the emulator: a few programs keep the threads busy without slowing tests down


def fit_coresident(kernel, wanted: int, per_unit: int, *args, **kwargs) -> int:
    """How many units (programs, or splits of `per_unit` programs each) a persistent kernel whose
    programs wait on each other launches: `wanted`, or fewer if not all of them could be resident at
    once (`tridist.coresident_programs` for the launch's arguments `args`, `kwargs`). Such kernels
    shrink to fit rather than refuse: with ranks sharing a GPU, each has only part of its SMs. Ops
    ask at their first call and keep the answer, since a call's programs count its epoch
    (`call_epoch`). At least 1; where even that does not fit, the co-resident launch refuses."""
    return max(1, min(wanted, tridist.coresident_programs(kernel, *args, **kwargs) // per_unit))


def check_programs(programs, name: str = "programs", meaning: str = "the most blocks a call launches") -> None:
    if not isinstance(programs, int) or programs < 1:
        raise ValueError(f"{name} must be a positive int ({meaning}), got {programs!r}")


def programs_limit(programs: int | None, world) -> int:
    """The programs an op may launch: `programs` if given (an op's argument), else one per SM."""
    if programs is None:
        return programs_for(world.device)
    check_programs(programs)
    return programs


@triton.jit
def wait_chunks(flags_ptr, arrived, stop, chunk, pointer):
    """Before reading elements below `stop` of a row that `CopyEnginePush` fills: waits for the
    flag of the chunk holding element stop - 1 (`flags_ptr` is the row's first flag) unless a chunk
    at least that far was seen (`arrived`). Returns the last chunk seen and `pointer`, which later
    loads must be computed from."""
    last = ((stop - 1) // chunk).to(tl.int32)
    if last > arrived:
        pointer = after_flags(pointer, flags_ptr + last, 1, 1)
        arrived = last
    return arrived, pointer


def raise_flag(flags: torch.Tensor, index: int) -> None:
    """flags[index] = 1 (int32 flags, this rank's or a peer's through `peer_tensor`) in stream order,
    after the copies queued before it: a 4-byte memset, which runs once they are complete (a stream
    write, cuStreamWriteValue32, was far slower outside CUDA graphs: benchmarks/NOTES.md, "Moved from
    the code's docstrings (issue 41)"). In the emulator the copies before it are done already, so a
    store does."""
    if flags.is_cuda:
        _SymmetricMemory.memset32(flags.view(torch.uint32), offset=index, val=1, count=1)
    else:
        flags[index] = 1


CE_CHUNK_BYTES = 8 << 20  # per copy-engine transfer: the copy-out of the last chunk is what shows


# Steps of the kernels that wait for copy-engine flags: 8 KB keeps them on 4 warps (at most 255
# registers a thread, half an SM's register file), so an SM they wait on has room left for the
# flags' memset; 16 KB steps take 8 warps and the whole register file.
CE_STEP_BYTES = 8 << 10


@contextlib.contextmanager
def piece_sizes(slice_bytes: int | None = None, chunk_bytes: int | None = None):
    """Ops built inside cut their sliced kernels' work in slices of `slice_bytes` (`slices_for`) and
    their copy-engine transfers in chunks of `chunk_bytes` (`CopyEnginePush`; rounded up to whole
    rows, `row_stride`); None keeps the default. For tests, which want small data in many pieces,
    and for the benchmark's `--slice-bytes` sweep. Sizes are read when an op is built."""
    global SLICE_BYTES, CE_CHUNK_BYTES
    saved = SLICE_BYTES, CE_CHUNK_BYTES
    SLICE_BYTES = SLICE_BYTES if slice_bytes is None else slice_bytes
    CE_CHUNK_BYTES = CE_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    try:
        yield
    finally:
        SLICE_BYTES, CE_CHUNK_BYTES = saved


class SideStream:
    """A stream beside the current one (GPUs only: in the emulator, work runs in order anyway)."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def fork(self):
        """A context that queues work on the side stream, after what the current stream has queued so far."""
        if self.stream is None:
            return contextlib.nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream())
        return torch.cuda.stream(self.stream)

    def join(self) -> None:
        """The current stream waits for what the side stream has queued."""
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)


class PeerStreams:
    """A side stream per peer of this node, so that copies to different peers run on different copy
    engines at once. `peers` lists them in the order copies are queued, the next rank first."""

    def __init__(self, world):
        self.peers = [(world.rank + step) % world.world_size for step in range(1, world.world_size)]
        self.streams = [SideStream(world.device) for _ in self.peers]

    def side(self, index: int):
        """A context that queues work on the stream of peer `peers[index]` (`SideStream.fork`)."""
        return self.streams[index].fork()

    def join(self) -> None:
        for stream in self.streams:
            stream.join()


class CopyEnginePush:
    """Copy-engine transfers into the peers' symmetric staging, with a flag per chunk (one node).

    `staging` has a row per rank, `row` elements apart: rank r's copy engines write its data into
    row r of every peer's staging, chunk by chunk, and after each chunk set flag (r, chunk) there to
    1. A kernel on the current stream waits for the flags of the chunks it reads, so it works on
    early chunks while later ones are still on the wire. No SM takes part in the transfer.

    One stream writes a row's chunks in order, so a flag that is up says every earlier chunk of
    the row has landed too (`wait_chunks`). Reuse: the owner zeroes its flags after the call's
    kernels have read them (`join`); the caller queues `barrier` (across ranks, this instance's own:
    `sync.Barrier`) at the start of each call, after which every peer's staging has been read and
    its flags zeroed.
    """

    def __init__(self, numel: int, dtype: torch.dtype, row: int | None = None, name: str | None = None):
        """`row`: elements from one row of staging to the next (at least `numel`; default `numel`
        rounded up to whole 64-element blocks); `name`: as `Workspace`'s."""
        self.world = w = tridist.world()
        self.chunk = row_stride(max(CE_CHUNK_BYTES // dtype.itemsize, 1))
        self.chunks = triton.cdiv(numel, self.chunk)
        self.row = row_stride(numel) if row is None else row
        self.staging = tridist.symm_empty((w.world_size, self.row), dtype, name and f"{name} staging")
        self.flags = tridist.symm_zeros((w.world_size * self.chunks,), torch.int32, name and f"{name} flags")
        self.streams = PeerStreams(w)
        # What each peer's copy engines write into, in the order `push` visits the peers.
        self.remote_rows = [tridist.peer_tensor(self.staging, peer)[w.rank] for peer in self.streams.peers]
        self.remote_flags = [tridist.peer_tensor(self.flags, peer) for peer in self.streams.peers]
        self.barrier = sync.Barrier()

    def push(self, sources) -> None:
        """Queue, after what the current stream has queued, `sources[p]` (a 1-D tensor of at most
        `numel` elements, for every peer p) into row `rank` of p's staging, the next peer first."""
        for index, peer in enumerate(self.streams.peers):
            with self.streams.side(index):
                remote, source = self.remote_rows[index], sources[peer]
                for chunk in range(self.chunks):
                    start, stop = chunk * self.chunk, min((chunk + 1) * self.chunk, source.numel())
                    if start < stop:
                        remote[start:stop].copy_(source[start:stop])
                    raise_flag(self.remote_flags[index], self.world.rank * self.chunks + chunk)

    def join(self) -> None:
        """The current stream waits for the transfers; then this rank's flags are zeroed for the next call."""
        self.streams.join()
        self.flags.zero_()

    def free(self) -> None:
        self.barrier.free()
        tridist.symm_free(self.flags)
        tridist.symm_free(self.staging)
