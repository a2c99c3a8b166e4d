"""Process groups: a subset of the ranks that allocates symmetric memory and runs kernels among
itself, while the other ranks do something else.

A group comes from torch.distributed (`dist.new_group(ranks)`, or a DeviceMesh's
`mesh.get_group("tp")`); `group(process_group)` wraps it in a [`Group`][tridist.Group], made once
per set of ranks and kept. Ranks are numbered within the group: group rank i is world rank
`ranks[i]` (the order torch.distributed gives), which on GPUs is NVSHMEM's PE `ranks[i]`, since
tridist's world ranks are the PEs. There are no NVSHMEM teams here: creating one
(`nvshmem_team_split_strided`) is collective over every PE, and a group must not need the ranks
outside it. Instead each group has a small device table, its *handle*, `[rank, size, pe_0, ...,
pe_{size-1}]` (int32), which a kernel receives as an argument (the `Group` itself: it passes as a
pointer) and the device functions read to translate group ranks into PEs (`dl.rank(g)`,
`dl.symm_at(ptr, peer, g)`, `dl.shmem.putmem(..., pe, g)`).

Host collectives within a group (the agreement on a group allocation's offset, checks, barriers)
go through the transport among the members only: in the emulator its own shared-memory gather,
on GPUs the process group's `all_gather_object`. Ranks outside the group take no part and do not
wait. A group whose ranks are the whole world in order (0, 1, ..., n-1) is the world.
"""
import torch

from .world import transport, world

_groups: dict = {}  # ranks -> Group, one per set of ranks for the life of the world
_by_address: dict = {}  # handle address -> Group, for the emulator's device functions


class Group:
    """The ranks of a process group, as tridist uses them: `tridist.group(process_group)` makes it.

    Pass it to a kernel as an argument (it is passed as a pointer to its device table, like a
    tensor) and give it to the device functions: `dl.rank(g)`, `dl.num_ranks(g)`,
    `dl.symm_at(ptr, peer, g)`, `dl.notify(ptr, peer, ..., group=g)`, `dl.shmem.putmem(..., pe, g)`,
    where `peer`/`pe` are ranks of the group.

    Equal groups (the same ranks, in the same order) are the same object; `key` is a hashable
    value that names the group on every member alike (for caches of per-group state). The first
    `tridist.group(pg)` of a group puts its table on the device: not inside a CUDA-graph capture.

    Attributes:
        ranks: the world ranks of the members, in group order: group rank i is world rank
            `ranks[i]` (on GPUs, NVSHMEM's PE). torch.distributed sorts a group's ranks, so
            group order is world order.
        rank: this rank's index in the group.
        size: the number of members.
        key: `ranks`, a hashable name of the group, the same on every member.
        nodes: the node of each member, in group order.
        nnodes: the number of nodes the group spans.
        local_rank: this rank's index among the members on its node.
        local_size: the number of members on this rank's node.
        is_one_node: whether every member is on this rank's node (all reachable through
            `dl.symm_at`); otherwise kernels reach members on other nodes with `dl.shmem`.
        is_world: whether the group is the whole world, in world order.
        process_group: the torch.distributed group it wraps (None for the world made by
            `tridist.group()`).
        handle: the device table `[rank, size, ranks...]`, int32 on this rank's device.
    """

    dtype = torch.int32  # what Triton reads of an argument to type it: a pointer to int32

    def __init__(self, ranks: tuple, process_group, w):
        self.ranks = ranks
        self.key = ranks
        self.rank = ranks.index(w.rank)
        self.size = len(ranks)
        self.nodes = tuple(w.node_of(r) for r in ranks)
        self.nnodes = len(set(self.nodes))
        here = [r for r, node in zip(ranks, self.nodes) if node == self.nodes[self.rank]]
        self.local_rank, self.local_size = here.index(w.rank), len(here)
        self.is_one_node = self.nnodes == 1
        self.is_world = ranks == tuple(range(w.world_size))
        self.process_group = process_group
        self.handle = torch.tensor([self.rank, self.size, *ranks], dtype=torch.int32, device=w.device)
        _by_address[self.handle.data_ptr()] = self

    def data_ptr(self) -> int:
        """The address of the device table: what a kernel argument of this group passes."""
        return self.handle.data_ptr()

    def world_rank(self, group_rank: int) -> int:
        """The world rank of the member `group_rank`."""
        if not 0 <= group_rank < self.size:
            raise ValueError(f"group rank {group_rank} is outside the group of {self.size} ranks {list(self.ranks)}")
        return self.ranks[group_rank]

    def group_rank(self, world_rank: int) -> int | None:
        """The group rank of `world_rank`, or None when it is not a member."""
        return self.ranks.index(world_rank) if world_rank in self.ranks else None

    def same_node(self, group_rank: int) -> bool:
        """Whether the member `group_rank` is on this rank's node (load/store reachable)."""
        return self.nodes[group_rank] == self.nodes[self.rank]

    def allgather_objects(self, value) -> list:
        """Every member's `value` (picklable), in group order: a host collective of the members
        only (not while a CUDA graph is captured). What checks that every member must pass alike
        build on."""
        return transport().allgather_objects(value, self)

    def barrier(self) -> None:
        """Host barrier of the members only (on GPUs, after their queued device work)."""
        transport().barrier(self)

    def __repr__(self) -> str:
        return f"tridist.Group(ranks={list(self.ranks)}, rank={self.rank})"


def group(process_group=None) -> Group:
    """The [`Group`][tridist.Group] of a torch.distributed process group, for this rank, which
    must be a member. `None` (or the default group) gives the world as a group, so that a kernel
    written for groups also runs on the world.

    Args:
        process_group: a `torch.distributed.ProcessGroup` (from `dist.new_group(ranks)`, or a
            DeviceMesh's `mesh.get_group(dim)`), a `tridist.Group`, or None.

    Raises:
        ValueError: this rank is not a member of the group (`dist.new_group` hands ranks outside
            the group a placeholder, not the group).
        TypeError: `process_group` is none of the above.
        NotInitializedError: before `tridist.init()`.
    """
    w = world()
    if isinstance(process_group, Group):
        if w.rank not in process_group.ranks:  # a Group made before a finalize, or by hand
            raise ValueError(f"rank {w.rank} is not a member of {process_group}")
        return process_group
    if process_group is None:
        ranks = tuple(range(w.world_size))
    else:
        import torch.distributed as dist

        if process_group is dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError(
                f"rank {w.rank} is not a member of this process group: torch.distributed.new_group gives the ranks "
                "outside a group a placeholder, not the group. Only the group's members allocate in it and run its "
                "kernels: test membership first (`torch.distributed.get_rank(group) >= 0`), and let the other ranks "
                "do their own work meanwhile")
        if not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"group must be a torch.distributed.ProcessGroup, a tridist.Group or None, not "
                            f"{type(process_group).__name__}")
        ranks = tuple(dist.get_process_group_ranks(process_group))
        if w.rank not in ranks:
            raise ValueError(f"rank {w.rank} is not a member of the process group of ranks {list(ranks)}; only its "
                             "members may use it")
    if ranks not in _groups:
        _groups[ranks] = Group(ranks, process_group, w)
    return _groups[ranks]


def resolve(process_group) -> Group | None:
    """What the host functions do with their `group=` argument: the Group, or None for the world
    (None, or a group of every rank in world order)."""
    if process_group is None:
        return None
    g = group(process_group)
    return None if g.is_world else g


def at_address(address: int) -> Group | None:
    """The group whose device table is at `address` (the emulator's device functions get the
    group as a pointer), or None."""
    return _by_address.get(address)


def forget() -> None:
    """At `finalize`: the groups' tables go with the world."""
    _groups.clear()
    _by_address.clear()
