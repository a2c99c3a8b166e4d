"""The interface every communication method implements, in every family.

An op (`AllReduce`, `GemmReduceScatter`, `EPBuffer`, ...) is a thin front: it checks its
arguments, asks its family's `policy` module which method to run, builds that method once and
launches it on every call. A method is one way of doing the op's work (one-shot, two-shot, LL
packets, copy engines, ...), and lives in a module of its own that holds its kernels, its workspace
plan and its launch, so that reading one method needs no other.

A method is built collectively (its constructor allocates symmetric memory: every rank builds the
same method in the same order), launched any number of times on one stream, and freed
collectively. Its constructor takes what the op was built for (each family passes its own
arguments, the same to all of its methods); everything it allocates goes into `buffers`, which
`free` gives back in order, so that every method has the same attributes whatever it allocated.

Across nodes a put's local side must be memory the network card may read: NVSHMEM registers its
symmetric heap and nothing else, and InfiniBand or UCX refuse the rest (on one node, and on virtual
nodes of one machine, NVLink reads any device memory). A method that puts from a caller's tensor
to other nodes builds a `send_buffer` and puts from `sendable(x, buffer)`: x itself where it is
symmetric, else x copied there first. The emulator checks every transfer to another node for it
(TRIDIST_REGISTERED_ONLY, on unless set to 0).
"""
import torch

import tridist


class Method:
    """One way to run an op, built for one shape and dtype.

    Attributes:
        name: the `method=` string that selects it (class attribute).
        one_node: it reaches peers through pointers or copy engines, so a world of several nodes
            refuses it (class attribute).
        buffers: the symmetric allocations it owns (`Workspace`s, copy-engine transfers: anything
            with `free()`; symmetric tensors from `tridist.symm_empty`), given back by `free` in order.
    """

    name: str = ""
    one_node: bool = False

    def __init__(self) -> None:
        self.buffers = []

    def own(self, buffer):
        """Record `buffer` as this method's, to be freed with it; returns `buffer`."""
        self.buffers.append(buffer)
        return buffer

    def send_buffer(self, ranks, numel: int, dtype: torch.dtype, name: str) -> torch.Tensor | None:
        """Where `ranks` (an `ops.ranks.Ranks`) span nodes, a symmetric buffer of `numel` elements of
        `dtype` this method owns, from which `sendable` lets its puts read; None on one node."""
        if ranks.nnodes == 1:
            return None
        return self.own(tridist.symm_empty((numel,), dtype, group=ranks.group, name=f"{name} send buffer"))

    @staticmethod
    def sendable(x: torch.Tensor, buffer: torch.Tensor | None) -> torch.Tensor:
        """x where a network transport can read it (one node, or x symmetric), else x copied into
        the front of `buffer` (`send_buffer`) on the current stream. The copy is reused by the next
        call: the kernel that puts from it ends with `dl.shmem.quiet`, so stream order keeps the two
        apart."""
        if buffer is None or tridist.is_symmetric(x):
            return x
        staged = buffer[:x.numel()].view(x.shape)
        staged.copy_(x)
        return staged

    def launch(self, *args, **kwargs) -> None:
        """Run one call on the current stream (no host synchronisation, capturable)."""
        raise NotImplementedError(f"{type(self).__name__}.launch")

    def free(self) -> None:
        """Give the symmetric buffers back (collective: every rank, in the same order)."""
        for buffer in self.buffers:
            if isinstance(buffer, torch.Tensor):
                tridist.symm_free(buffer)
            else:
                buffer.free()
        self.buffers = []


class Nothing(Method):
    """The method of an op built for zero elements: no buffers, and every launch returns at once."""

    name = "nothing"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__()

    def launch(self, *args, **kwargs) -> None:
        return None
