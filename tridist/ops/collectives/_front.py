"""What the collectives' op classes (`AllGather`, `ReduceScatter`, `AllReduce`) share: the method
each built, the sizes of it that tests and benchmarks read, and the check of a symmetric tensor
that a call's kernels reach on every rank."""
import torch

import tridist
from tridist.runtime.world import heap

from ..method import Method
from ..ranks import Ranks


class Collective:
    """An op instance: `impl` is the method it built (`tridist.ops.method.Method`; `Nothing` for
    zero elements), `method` the name of it, `ranks` (`ops.ranks.Ranks`) the world or the group it
    runs among."""

    impl: Method
    method: str
    ranks: Ranks

    @property
    def block(self) -> int:
        """Elements a program of the method's kernel moves or sums per step (`sizing.steps_for`);
        SM methods only."""
        return self.impl.block

    @property
    def splits(self) -> int:
        """Programs the method's kernel runs per destination (per slice for "2d" and "ring"); SM
        methods only (LL methods: `workspace.splits`)."""
        return self.impl.splits

    @property
    def workspace(self):
        """The method's symmetric staging and flags (`protocol.Workspace`, `PacketRows`); methods
        that stage through the SMs only."""
        return self.impl.workspace

    def free(self) -> None:
        """Give the symmetric buffers back (collective: every rank frees its instances in the same
        order)."""
        self.impl.free()


def check_held(t: torch.Tensor | None, name: str, ranks: Ranks, built: str) -> None:
    """`t` is a symmetric tensor that every one of `ranks` holds a copy of: allocated by the world,
    or by a group that has each of them (a group's allocation is not mapped on the other ranks,
    where the peers' kernels would reach it). `built` begins the message: how the op was built."""
    if t is None or not tridist.is_symmetric(t):
        raise ValueError(f"{built}{name} must be a symmetric tensor (tridist.symm_empty), the same on every rank")
    owner = heap().group_at(heap().offset_of(t))
    missing = sorted(set(ranks.ranks) - set(owner.ranks)) if owner is not None else []
    if missing:
        raise ValueError(f"{built}{name} was allocated by the group of ranks {list(owner.ranks)}, without ranks "
                         f"{missing} of this op's {list(ranks.ranks)}: allocate it with this op's group= (or for "
                         "the world)")
