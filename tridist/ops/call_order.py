"""Ops that wait on their peers start on the GPU in the order the program called them, on every
rank, whatever streams they were called on.

Why. A kernel that waits on a peer holds its SMs while it waits, and most of ours take every SM
(a program per SM, often with the register file full). Two ops called back to back on two streams
may start on the GPU in either order, and not in the same order on every rank, however the host
called them: if rank 0 starts op A's kernel and rank 1 op B's, each waits for a kernel that its
peer has no room to start, and neither ever ends. PyTorch's process groups avoid this by running
every collective of a group on one internal stream; NCCL leaves it to the caller.

How. The process remembers the stream it called its last op on. An op called on another stream
first makes its stream wait for all that the previous stream has queued so far (an event recorded
there now), so the GPU starts the ops in the order they were called. Ops on one stream are in order
already and pay one comparison. The side streams an op uses inside itself (copy engines, a
communication kernel beside its GEMM) fork from the op's stream and join back to it, so they are
inside that order and keep their overlap with the op's own kernels. Work of other kinds (a GEMM on
another stream) is not held back, unless it was queued on the previous op's stream before the
next op was called.

CUDA graphs: while a graph is being captured, ops on two streams of that capture are ordered the
same way (an edge of the graph). Between a capture and eager work nothing is ordered: an event of
one cannot be waited on in the other, and a captured op runs only when its graph is replayed.
"""
import torch

from tridist.runtime import backend

# The stream this process called its last op on.
_last: list = [None]


def take_turn() -> None:
    """Called by an op that waits on its peers, before it queues anything on the current stream."""
    if backend.is_emulator():  # one stream there: calls run in their order
        return
    stream = torch.cuda.current_stream()
    previous = _last[0]
    _last[0] = stream
    if previous is None or previous == stream or previous.device != stream.device:
        return
    capturing = torch.cuda.is_current_stream_capturing()
    with torch.cuda.stream(previous):
        if torch.cuda.is_current_stream_capturing() == capturing:
            stream.wait_event(previous.record_event())
