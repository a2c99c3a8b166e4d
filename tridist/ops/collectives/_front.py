"""What the collectives' op classes (`AllGather`, `ReduceScatter`, `AllReduce`) share: the method
each built, and the sizes of it that tests and benchmarks read."""
from ..method import Method


class Collective:
    """An op instance: `impl` is the method it built (`tridist.ops.method.Method`; `Nothing` for
    zero elements), `method` the name of it."""

    impl: Method
    method: str

    @property
    def block(self) -> int:
        """Elements a program of the method's kernel moves or sums per step (`_protocol.steps_for`);
        SM methods only."""
        return self.impl.block

    @property
    def splits(self) -> int:
        """Programs the method's kernel runs per destination (per slice for "2d" and "ring"); SM
        methods only (LL methods: `workspace.splits`)."""
        return self.impl.splits

    @property
    def workspace(self):
        """The method's symmetric staging and flags (`_protocol.Workspace`, `PacketRows`); methods
        that stage through the SMs only."""
        return self.impl.workspace

    def free(self) -> None:
        """Give the symmetric buffers back (collective: every rank frees its instances in the same
        order)."""
        self.impl.free()
