"""Copy-engine transfers between the GPUs of one node: side streams, one per peer, and
`CopyEnginePush`, which writes into the peers' staging chunk by chunk with a flag after each, for a
kernel on the current stream to consume as chunks land (`wait_chunks`)."""
import contextlib

import torch
import triton
import triton.language as tl
from torch._C._distributed_c10d import _SymmetricMemory

import tridist

from . import sync
from .protocol import after_flags
from .sizing import pieces, row_stride


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


class SideStream:
    """A stream beside the current one (GPUs only: in the emulator, work runs in order anyway)."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.forked = False

    def fork(self):
        """A context that queues work on the side stream, after what the current stream has queued so far."""
        if self.stream is None:
            return contextlib.nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream())
        self.forked = True
        return torch.cuda.stream(self.stream)

    def join(self) -> None:
        """The current stream waits for what the side stream has queued since it was forked. A stream
        not forked since the last join is left alone: during a CUDA graph's capture, waiting on a
        stream that takes no part in it is an error (the capture is invalidated)."""
        if self.stream is not None and self.forked:
            torch.cuda.current_stream().wait_stream(self.stream)
            self.forked = False


class PeerStreams:
    """A side stream per peer of this node, so that copies to different peers run on different copy
    engines at once. `peers` lists them in the order copies are queued, the next rank first."""

    def __init__(self, world):
        """`world`: the ranks that exchange (a `tridist.World` or an `ops.ranks.Ranks`)."""
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

    def __init__(self, numel: int, dtype: torch.dtype, ranks, row: int | None = None, name: str | None = None):
        """`ranks` (an `ops.ranks.Ranks`): the ranks that exchange, rows and peers counted in them;
        `row`: elements from one row of staging to the next (at least `numel`; default `numel`
        rounded up to whole 64-element blocks); `name`: as `Workspace`'s."""
        self.world = w = ranks
        group = ranks.group
        self.chunk = row_stride(max(pieces.chunk_bytes // dtype.itemsize, 1))
        self.chunks = triton.cdiv(numel, self.chunk)
        self.row = row_stride(numel) if row is None else row
        self.staging = tridist.symm_empty((w.world_size, self.row), dtype, group, name=name and f"{name} staging")
        self.flags = tridist.symm_zeros((w.world_size * self.chunks,), torch.int32, group,
                                        name=name and f"{name} flags")
        self.streams = PeerStreams(w)
        # What each peer's copy engines write into, in the order `push` visits the peers.
        self.remote_rows = [tridist.peer_tensor(self.staging, peer, group)[w.rank] for peer in self.streams.peers]
        self.remote_flags = [tridist.peer_tensor(self.flags, peer, group) for peer in self.streams.peers]
        self.barrier = sync.Barrier(group)

    def push(self, sources, in_turn: bool = False) -> None:
        """Queue, after what the current stream has queued, `sources[p]` (a 1-D tensor of at most
        `numel` elements, for every peer p) into row `rank` of p's staging: to every peer at once,
        a stream each, the next peer first; or `in_turn`, on one stream, one peer after another from
        the previous rank back, so that when every rank does the same each rank receives from one
        peer at a time, rank+1's data whole first, then rank+2's: the order a consumer that works
        through the rows in that order (ag_gemm's GEMM) can start on soonest."""
        for index in reversed(range(len(self.streams.peers))) if in_turn else range(len(self.streams.peers)):
            with self.streams.side(0 if in_turn else index):
                remote, source = self.remote_rows[index], sources[self.streams.peers[index]]
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
