"""The ranks an op runs among: the world, or a process group.

Every op takes `group=None`. The op asks `ranks_of(group)` once, when it is built, and from then on
uses the answer where it used the world before: `rank` and `world_size` are the group's (rank r of
the group, `world_size` shards), `nnodes` and `local_world_size` its layout over nodes, and
`group` what its kernels receive as their `group` argument. For the world `group` is None: the
device functions (`dl.rank(group)`, `dl.symm_at(ptr, peer, group)`, ...) then compile exactly as
they did before groups existed; for a group it is the `tridist.Group`, whose device table
translates group ranks into the world's.

The kernels that split their work by node (the `2d` methods) number a group's members node by
node, `local_world_size` to a node, so a group that spans nodes must have as many members on each:
`ranks_of` refuses one that does not.
"""
import dataclasses

import torch

import tridist
from tridist.runtime import groups
from tridist.runtime.world import transport


@dataclasses.dataclass(frozen=True)
class Ranks:
    """Who an op instance runs among, in the terms the ops use (the same names as `tridist.World`).

    Attributes:
        rank: this rank's index among them.
        world_size: how many they are.
        nnodes: the nodes they span.
        local_world_size: how many of them are on each node.
        device: this rank's device.
        group: the `tridist.Group`, or None for the world: the kernels' `group` argument (a
            pointer to the group's device table).
        key: a hashable name, the same on every member (the instance caches key on it).
        ranks: their world ranks, in order (what error messages name).
    """

    rank: int
    world_size: int
    nnodes: int
    local_world_size: int
    device: torch.device
    group: "groups.Group | None"
    key: tuple
    ranks: tuple

    def allgather_objects(self, value) -> list:
        """Every member's `value`, in member order (a host collective of the members only)."""
        return transport().allgather_objects(value) if self.group is None else self.group.allgather_objects(value)

    def world_rank(self, rank: int) -> int:
        return self.ranks[rank]


class Alone:
    """The `group=` of an op instance that runs on this rank by itself, with no peer and no host
    collective, whatever the world: `ALONE`. What a tensor-parallel layer's attention is over the
    heads each rank holds (`ops.decode_attention`)."""

    def __repr__(self) -> str:
        return "ALONE"


ALONE = Alone()


def ranks_of(group=None) -> Ranks:
    """The `Ranks` of `group` (a `torch.distributed.ProcessGroup`, a `tridist.Group`, None for
    the world, or `ALONE` for this rank by itself) for this rank.

    Raises:
        ValueError: this rank is not a member of `group`; a group spanning nodes with unequal
            numbers of members on them.
        TypeError: `group` is not a process group.
    """
    w = tridist.world()
    # Keyed by the argument itself: resolving a ProcessGroup asks torch.distributed for its ranks,
    # and every call of an op asks for its Ranks.
    key = (id(w), w.rank, w.world_size, w.nnodes, group)
    cached = _cache.get(key)
    if cached is not None:
        return cached
    if group is ALONE:
        ranks = Ranks(0, 1, 1, 1, w.device, None, ("alone", w.rank), (w.rank,))
    else:
        ranks = _ranks(w, groups.resolve(group))
    _cache[key] = ranks
    return ranks


_cache: dict = {}  # (the world, the group argument) -> Ranks


def _ranks(w, g) -> Ranks:
    if g is None:
        return Ranks(w.rank, w.world_size, w.nnodes, w.local_world_size, w.device, None, ("world",),
                     tuple(range(w.world_size)))
    per_node = {node: g.nodes.count(node) for node in g.nodes}
    if len(set(per_node.values())) > 1:
        raise ValueError(f"the group of ranks {list(g.ranks)} has {', '.join(map(str, per_node.values()))} members on "
                         "its nodes; tridist's ops take groups with as many members on every node they span (or on "
                         "one node)")
    return Ranks(g.rank, g.size, g.nnodes, g.local_size, w.device, g, ("group", *g.key), g.ranks)
