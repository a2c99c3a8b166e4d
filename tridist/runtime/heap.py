"""The symmetric heap: every rank holds one of the same size and carves it up in the same order.

An allocation is an offset into the heap, so the same offset names a buffer on every rank and a
peer's copy is the peer's heap base plus that offset. The allocator is deterministic first-fit: as
long as every rank allocates and frees the same sizes in the same order, offsets agree. In the
emulator (always) and on GPUs with TRIDIST_DEBUG=1 every allocation and free is compared across
ranks, and a mismatch fails on every rank with a message that shows what each rank asked for.
"""
import math

import torch

from .errors import SymmetricAllocationError

ALIGNMENT = 256
_DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
           torch.float32, torch.float64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16,
           torch.uint32, torch.uint64]
_MAX_DIMS = 8
_ALLOC, _FREE = 1, 2


class SymmetricHeap:
    def __init__(self, transport, rank: int, checked: bool):
        self.transport = transport
        self.rank = rank
        self.checked = checked
        self.base = transport.heap
        self.nbytes = self.base.numel()
        self.base_ptr = self.base.data_ptr()
        self._blocks: list[tuple[int, int]] = []  # (offset, size), sorted by offset
        self._labels: dict[int, tuple[str, torch.dtype, tuple]] = {}  # offset -> (name, dtype, shape)
        self._seq = 0

    @property
    def used(self) -> int:
        return sum(size for _, size in self._blocks)

    def contains(self, t: torch.Tensor) -> bool:
        return self.base.device == t.device and self.base_ptr <= t.data_ptr() < self.base_ptr + self.nbytes

    def offset_of(self, t: torch.Tensor) -> int:
        return t.data_ptr() - self.base_ptr

    def allocate(self, shape: tuple, dtype: torch.dtype, name: str | None = None) -> torch.Tensor:
        if dtype not in _DTYPES:
            raise ValueError(f"symmetric tensors take one of {', '.join(str(d) for d in _DTYPES)}; got {dtype}")
        nbytes = math.prod(shape) * dtype.itemsize
        self._agree(_ALLOC, nbytes, dtype, shape)
        if nbytes == 0:  # torch gives empty tensors no address, so none in the heap either
            return torch.empty(shape, dtype=dtype, device=self.base.device)
        size = max(ALIGNMENT, -(-nbytes // ALIGNMENT) * ALIGNMENT)
        offset = self._first_fit(size)
        if offset is None:
            raise SymmetricAllocationError(
                f"rank {self.rank}: symmetric heap exhausted: asked for {nbytes} bytes ({_describe(dtype, shape)}) "
                f"with {self.used} of {self.nbytes} bytes used in {len(self._blocks)} allocations; raise "
                f"TRIDIST_HEAP_SIZE (now {self.nbytes}) before init, or free tensors with tridist.symm_free"
            )
        self._blocks.append((offset, size))
        self._blocks.sort()
        self._labels[offset] = (name or f"allocation #{self._seq}", dtype, shape)
        return self.base[offset:offset + nbytes].view(dtype).view(shape)

    def free(self, t: torch.Tensor) -> None:
        if t.numel() == 0:  # see `allocate`
            self._agree(_FREE, -1, t.dtype, tuple(t.shape))
            return
        offset = self.offset_of(t) if self.contains(t) else -1
        index = next((i for i, (o, _) in enumerate(self._blocks) if o == offset), None)
        if index is None:
            raise ValueError("symm_free takes a tensor returned by symm_empty/symm_zeros/signals, not a view "
                             "or a regular tensor")
        self._agree(_FREE, offset, t.dtype, tuple(t.shape))
        del self._blocks[index]
        del self._labels[offset]

    def name_of(self, address: int) -> str:
        """The word at `address` (a pointer into this rank's heap), as the reports of expired waits
        name it: its allocation, by the name given or by number, the word's index there (in elements
        of the allocation's dtype), dtype, shape and heap offset."""
        offset = address - self.base_ptr
        for start, size in self._blocks:
            if start <= offset < start + size and start in self._labels:
                name, dtype, shape = self._labels[start]
                return (f"{name}[{(offset - start) // dtype.itemsize}] ({_describe(dtype, shape)} at heap offset "
                        f"{start:#x})")
        if 0 <= offset < self.nbytes:
            return f"the word at heap offset {offset:#x} (in no allocation)"
        return f"the word at {address:#x} (not in the symmetric heap)"

    def _first_fit(self, size: int):
        cursor = 0
        for offset, block in self._blocks:
            if offset - cursor >= size:
                return cursor
            cursor = offset + block
        return cursor if self.nbytes - cursor >= size else None

    def _agree(self, kind: int, amount: int, dtype: torch.dtype, shape: tuple) -> None:
        self._seq += 1
        if not self.checked:
            return
        if len(shape) > _MAX_DIMS:
            raise ValueError(f"symmetric tensors have at most {_MAX_DIMS} dimensions")
        mine = (self._seq, kind, amount, _DTYPES.index(dtype), len(shape), *shape)
        everyone = self.transport.allgather_ints(mine)
        if all(other == mine for other in everyone):
            return
        lines = [f"  rank {r}: {_explain(entry)}" for r, entry in enumerate(everyone)]
        raise SymmetricAllocationError(
            "symmetric allocations differ between ranks; every rank must allocate and free the same shapes "
            "and dtypes in the same order:\n" + "\n".join(lines)
        )


def _describe(dtype: torch.dtype, shape: tuple) -> str:
    return f"{str(dtype).removeprefix('torch.')}{list(shape)}"


def _explain(entry: tuple) -> str:
    seq, kind, amount, dtype_index, ndim, *shape = entry
    what = _describe(_DTYPES[dtype_index], tuple(shape[:ndim]))
    if kind == _ALLOC:
        return f"allocation #{seq}: {what}, {amount} bytes"
    return f"call #{seq}: free of {what} at offset {amount}"
