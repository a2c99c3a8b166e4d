"""The symmetric heap: every rank holds one of the same size and carves it up.

An allocation is an offset into the heap, so the same offset names a buffer on every rank that
holds it, and a peer's copy is the peer's heap base plus that offset.

- **World allocations** (every rank) are placed first-fit from the bottom of the heap among the
  world's allocations only. As long as every rank allocates and frees the same sizes in the same
  order, offsets agree with no communication.
- **Group allocations** (`group=`, the members of a process group only) are placed from the top
  of the heap down, at an offset the members agree on: each member proposes the highest offset at
  or below a bound where the block fits among everything it holds (world allocations and those of
  every group it is in), above the world's allocations; the lowest proposal becomes the next bound,
  until every member proposes the same offset. A rank in several groups thus never gets two blocks
  at one offset, and ranks outside the group take no part.

The two meet only when the heap is nearly full: a world allocation that would overlap a group
allocation of some rank fails there as heap exhaustion (on every rank where allocations are
checked; without checks, on that rank). In the emulator (always) and on GPUs with TRIDIST_DEBUG=1
every allocation and free is compared across the ranks concerned, and a mismatch fails on each of
them with a message that shows what each asked for; group allocations are compared everywhere,
since their offset is agreed anyway.
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
_NO_ROOM = -1
# Group blocks start this far below the heap's end (at most a sixteenth of the heap): a kernel's
# masked-off lanes past the end of the top block still point into the heap, as they do past a world
# block (the emulator refuses addresses outside the heap, masked or not).
_TOP_GUARD = 1 << 20


class SymmetricHeap:
    def __init__(self, transport, rank: int, checked: bool):
        self.transport = transport
        self.rank = rank
        self.checked = checked
        self.base = transport.heap
        self.nbytes = self.base.numel()
        self.base_ptr = self.base.data_ptr()
        self._top = (self.nbytes - min(_TOP_GUARD, self.nbytes // 16)) // ALIGNMENT * ALIGNMENT  # group blocks below
        self._blocks: list[tuple[int, int]] = []  # (offset, size), sorted by offset: world and group blocks
        self._owners: dict = {}  # offset -> the Group of a group block (world blocks are absent)
        self._labels: dict[int, tuple[str, torch.dtype, tuple]] = {}  # offset -> (name, dtype, shape)
        self._seqs: dict = {}  # group key (None: the world) -> allocations and frees counted there

    @property
    def used(self) -> int:
        return sum(size for _, size in self._blocks)

    def contains(self, t: torch.Tensor) -> bool:
        return self.base.device == t.device and self.base_ptr <= t.data_ptr() < self.base_ptr + self.nbytes

    def offset_of(self, t: torch.Tensor) -> int:
        return t.data_ptr() - self.base_ptr

    def group_at(self, offset: int):
        """The Group of the allocation that holds heap offset `offset`, None for a world one (or none)."""
        if not self._owners:
            return None
        for start, size in self._blocks:
            if start <= offset < start + size:
                return self._owners.get(start)
        return None

    def allocate(self, shape: tuple, dtype: torch.dtype, name: str | None = None, group=None) -> torch.Tensor:
        """`group`: a Group (not the world) whose members allocate together; None for the world."""
        if dtype not in _DTYPES:
            raise ValueError(f"symmetric tensors take one of {', '.join(str(d) for d in _DTYPES)}; got {dtype}")
        if (self.checked or group is not None) and len(shape) > _MAX_DIMS:  # what a gather carries
            raise ValueError(f"symmetric tensors have at most {_MAX_DIMS} dimensions")
        nbytes = math.prod(shape) * dtype.itemsize
        size = max(ALIGNMENT, -(-nbytes // ALIGNMENT) * ALIGNMENT)
        seq = self._count(group)
        description = (seq, _ALLOC, nbytes, _DTYPES.index(dtype), len(shape), *shape)
        if nbytes == 0:  # torch gives empty tensors no address, so none in the heap either
            if self.checked:
                self._compare(group, self._gather(description, group))
            return torch.empty(shape, dtype=dtype, device=self.base.device)
        if group is None:
            offset = self._world_offset(size, nbytes, dtype, shape, description)
        else:
            offset = self._group_offset(size, nbytes, dtype, shape, description, group)
        self._blocks.append((offset, size))
        self._blocks.sort()
        if group is not None:
            self._owners[offset] = group
        where = "" if group is None else f" of group {list(group.ranks)}"
        self._labels[offset] = (name or f"allocation #{seq}{where}", dtype, shape)
        return self.base[offset:offset + nbytes].view(dtype).view(shape)

    def free(self, t: torch.Tensor) -> None:
        if t.numel() == 0:  # see `allocate`: nothing to give back, and nothing to compare
            return
        offset = self.offset_of(t) if self.contains(t) else -1
        index = next((i for i, (o, _) in enumerate(self._blocks) if o == offset), None)
        if index is None:
            raise ValueError("symm_free takes a tensor returned by symm_empty/symm_zeros/signals, not a view "
                             "or a regular tensor")
        group = self._owners.get(offset)
        description = (self._count(group), _FREE, offset, _DTYPES.index(t.dtype), t.dim(), *t.shape)
        if self.checked:
            self._compare(group, self._gather(description, group))
        del self._blocks[index]
        del self._labels[offset]
        self._owners.pop(offset, None)

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

    # ---- placement ---------------------------------------------------------------------------------
    def _world_blocks(self) -> list[tuple[int, int]]:
        return [(o, s) for o, s in self._blocks if o not in self._owners]

    def _world_offset(self, size: int, nbytes: int, dtype, shape, description) -> int:
        """First fit among the world's blocks (the same on every rank), refused where it would overlap
        a group block of this rank."""
        offset = _first_fit(self._world_blocks(), size, self.nbytes)
        groups = [(o, s) for o, s in self._blocks if o in self._owners]
        if offset is not None and any(o < offset + size and offset < o + s for o, s in groups):
            offset = None
        mine = _NO_ROOM if offset is None else offset
        if self.checked:
            everyone = self._gather((*description, mine), None)
            self._compare(None, [entry[:-1] for entry in everyone])
            offsets = [entry[-1] for entry in everyone]
            ranks = range(len(offsets))
        else:
            offsets, ranks = [mine], [self.rank]
        if _NO_ROOM in offsets:
            raise self._exhausted(nbytes, dtype, shape, [r for r, o in zip(ranks, offsets) if o == _NO_ROOM], None)
        if len(set(offsets)) > 1:
            raise SymmetricAllocationError(
                "symmetric allocations differ between ranks: the world's allocations so far put this one at heap "
                f"offsets {offsets} (rank by rank); every rank must allocate and free the same shapes and dtypes "
                "in the same order")
        return offset

    def _group_offset(self, size: int, nbytes: int, dtype, shape, description, group) -> int:
        """The members' agreed offset, from the top of the heap down (see the module docstring)."""
        bound = (self._top - size) // ALIGNMENT * ALIGNMENT
        values = description
        while True:
            mine = self._top_fit(size, bound)
            everyone = self._gather((*values, mine), group)
            if values:
                self._compare(group, [entry[:-1] for entry in everyone])
                values = ()
            proposals = [entry[-1] for entry in everyone]
            if _NO_ROOM in proposals:
                raise self._exhausted(nbytes, dtype, shape,
                                      [group.ranks[i] for i, p in enumerate(proposals) if p == _NO_ROOM], group)
            bound = min(proposals)
            if all(p == bound for p in proposals):
                return bound

    def _top_fit(self, size: int, bound: int) -> int:
        """The highest aligned offset at most `bound`, above every world block, where `size` bytes are
        free among all of this rank's blocks (world and group); _NO_ROOM if there is none."""
        floor = max((o + s for o, s in self._world_blocks()), default=0)
        ends = [0] + [o + s for o, s in self._blocks]
        starts = [o for o, _ in self._blocks] + [self._top]
        for gap_start, gap_end in reversed(list(zip(ends, starts))):  # the gaps between blocks, top first
            candidate = min(bound, gap_end - size) // ALIGNMENT * ALIGNMENT
            if candidate >= max(gap_start, floor):
                return candidate
        return _NO_ROOM

    # ---- agreement ---------------------------------------------------------------------------------
    def _count(self, group) -> int:
        key = None if group is None else group.key
        self._seqs[key] = self._seqs.get(key, 0) + 1
        return self._seqs[key]

    def _gather(self, values: tuple, group) -> list:
        return self.transport.allgather_ints(values, group)

    def _compare(self, group, everyone: list) -> None:
        """Every rank concerned asked for the same allocation (or free), or all of them raise."""
        if all(entry == everyone[0] for entry in everyone):
            return
        ranks = range(len(everyone)) if group is None else group.ranks
        lines = [f"  rank {r}: {_explain(entry)}" for r, entry in zip(ranks, everyone)]
        where = "ranks" if group is None else f"the ranks of group {list(group.ranks)}"
        raise SymmetricAllocationError(
            f"symmetric allocations differ between {where}; every rank must allocate and free the same shapes "
            "and dtypes in the same order:\n" + "\n".join(lines)
        )

    def _exhausted(self, nbytes: int, dtype, shape, ranks: list, group) -> SymmetricAllocationError:
        where = "" if group is None else f" in group {list(group.ranks)}"
        return SymmetricAllocationError(
            f"rank {self.rank}: symmetric heap exhausted{where}: asked for {nbytes} bytes "
            f"({_describe(dtype, shape)}), with no room on rank(s) {ranks}; this rank uses {self.used} of "
            f"{self.nbytes} bytes in {len(self._blocks)} allocations (world allocations grow from the bottom, "
            f"group allocations from the top); raise TRIDIST_HEAP_SIZE (now {self.nbytes}) before init, or free "
            "tensors with tridist.symm_free"
        )


def _first_fit(blocks: list[tuple[int, int]], size: int, nbytes: int):
    cursor = 0
    for offset, block in blocks:
        if offset - cursor >= size:
            return cursor
        cursor = offset + block
    return cursor if nbytes - cursor >= size else None


def _describe(dtype: torch.dtype, shape: tuple) -> str:
    return f"{str(dtype).removeprefix('torch.')}{list(shape)}"


def _explain(entry: tuple) -> str:
    seq, kind, amount, dtype_index, ndim, *shape = entry
    what = _describe(_DTYPES[dtype_index], tuple(shape[:ndim]))
    if kind == _ALLOC:
        return f"allocation #{seq}: {what}, {amount} bytes"
    return f"call #{seq}: free of {what} at offset {amount}"
