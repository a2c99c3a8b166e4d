"""Reduce-scatter (sum), accumulated in fp32 whatever the input dtype: x has world_size * m elements;
rank r gets out = sum over ranks of x[r*m:(r+1)*m], rounded once. With `group=`, the ranks are a
process group's: its members sum among themselves, group rank r getting chunk r.

The front (`ReduceScatter`, `reduce_scatter`) checks its arguments, asks
`policy.choose_reduce_scatter` for `"auto"` and builds one method; each method is a module of this
package, with its protocol in its docstring: `ll`, `one_shot`, `ce`, `two_d` ("2d"), `ring`.
"""
import torch

from ... import checks, instances, sizing
from ...checks import check_input, check_output, shape_of
from ...sizing import row_stride
from ...method import Nothing
from ...ranks import ranks_of
from .. import policy
from .._front import Collective
from . import ce, ll, one_shot, ring, two_d

# The methods by the name `method=` selects them with.
CLASSES = {kind.name: kind for kind in (ll.Packets, one_shot.OneShot, ce.CopyEngines, two_d.TwoD, ring.Ring)}
METHODS = ("auto", *CLASSES)


class ReduceScatter(Collective):
    """A sum reduce-scatter of `numel` elements of `dtype` per rank, with its own symmetric
    buffers: rank r gets the sum over ranks of chunk r (dim 0 of x cut in `world_size` chunks),
    summed in fp32 and rounded once.

    Build it on every rank (of `group`) at once; call it (`op(x, out)`) back to back on one
    stream, also in CUDA graphs; `free()` it on every rank. `tridist.ops.reduce_scatter` keeps one
    per shape, dtype, method, group and stream.

    | method | how | where |
    | --- | --- | --- |
    | `"ll"` | low-latency packets: chunk p travels to rank p with the call's epoch as the flag of every 4-byte word; summed in rank order | one node; small messages; chunks of whole 4-byte words |
    | `"one_shot"` | chunk p is cut in slices (about 128 KB), pushed to rank p, a flag after each; rank p's own programs sum each slice as every peer's arrives, so summing overlaps sending | any topology |
    | `"ce"` | the copy engines write chunk p into rank p's staging, a flag per 8 MB; a kernel sums the pieces as they land | one node; large messages next to other work on the SMs |
    | `"2d"` | summed on the node first: every rank pushes to its node's ranks the chunks they collect for each node, they sum them in fp32 and put one sum per other node (fp32, with its signal) to its owner | several nodes |
    | `"ring"` | each slice of the partial sums passes around the ring, each rank adding its part; partials travel in fp32 (twice the bytes of a 16-bit input) | any topology |
    | `"auto"` | [`choose_reduce_scatter`][tridist.ops.collectives.policy.choose_reduce_scatter]: `2d` across nodes, `ll` while a rank sends at most 1 MB, else `one_shot` | |

    Args:
        numel: elements of each rank's x, a multiple of the world size (0: calls do nothing).
        dtype: bf16, fp16 or fp32.
        method: one of the methods above.
        programs: the most programs (blocks, so SMs) a call's kernel runs (default: one per SM).
        group: a `torch.distributed` process group (or `tridist.Group`) to sum within, or None
            for the world: ranks, `world_size` and nodes are then the group's (x is cut in
            `group.size()` chunks, group rank r gets chunk r). Only its members build it; its
            buffers are the group's own.

    Raises:
        ValueError: an unknown method, a dtype it does not take, `numel` not a non-negative
            multiple of the world (group) size, `programs` not a positive int, a one-node method
            across several nodes, buffers past 2^31 elements, for `"ll"` chunks that are not
            whole 4-byte words, or a `group` this rank is not a member of.
    """

    def __init__(self, numel: int, dtype: torch.dtype, method: str = "auto", programs: int | None = None,
                 group=None):
        if method not in METHODS:
            raise checks.method_error("reduce_scatter", method, METHODS)
        checks.check_build("reduce_scatter", numel, dtype)
        self.ranks = ranks = ranks_of(group)
        if numel % ranks.world_size:
            raise ValueError(f"reduce_scatter needs a multiple of world_size={ranks.world_size} elements, got {numel}")
        self.numel, self.dtype = numel, dtype
        self.method = policy.choose_reduce_scatter(numel * dtype.itemsize, ranks) if method == "auto" else method
        if numel == 0:  # nothing to sum: no buffers, and calls return at once
            self.impl = Nothing()
            return
        kind = CLASSES[self.method]
        if kind.one_node:
            checks.require_one_node(f"reduce_scatter method {self.method!r}", "method='2d' or 'one_shot'", ranks)
        # staging holds a row per rank (the ring's fp32 partials: two, counted in elements of x)
        checks.check_offsets("reduce_scatter", 2 * ranks.world_size * row_stride(numel // ranks.world_size))
        self.impl = kind(numel, dtype, sizing.programs_limit(programs, ranks), ranks)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Sum `x` over ranks and give this rank its chunk.

        Args:
            x: `numel` elements of `dtype` (as built), contiguous, on this rank's device, dim 0 a
                multiple of the world (group) size.
            out: `x.shape[0] // world_size` rows of `x`'s other dimensions, `x`'s dtype; a new
                tensor if None.

        Returns:
            `out`: chunk `rank` of the sum over ranks (the group's rank and members, with `group`).

        Raises:
            ValueError: `x` or `out` not what this instance was built for, on any rank
                (`checks.agree` says when every rank checks).
        """
        ranks = self.ranks

        def check() -> None:
            checks.check_same(x, self.numel, self.dtype, "reduce-scatter")
            check_scattered(x, out, ranks)

        checks.agree("reduce_scatter", check, {"shape and dtype of x": shape_of(x)}, group=ranks.group)
        if out is None:
            out = torch.empty(scattered_shape(x, ranks), dtype=x.dtype, device=x.device)
        self.impl.launch(x, out)
        return out


def scattered_shape(x: torch.Tensor, ranks) -> tuple:
    """The shape of a rank's part of the reduce-scatter of `x` among `ranks` (the world or an
    `ops.ranks.Ranks`): dim 0 cut in `world_size` chunks."""
    return (x.shape[0] // ranks.world_size, *x.shape[1:])


def check_scattered(x: torch.Tensor, out: torch.Tensor | None, ranks) -> None:
    """x's dim 0 splits in `world_size` chunks (of `ranks`), and `out` (unless None) is one of them."""
    if x.dim() == 0 or x.shape[0] % ranks.world_size:
        where = "world" if ranks.group is None else "group"
        raise ValueError(f"reduce_scatter splits dim 0 of x ({tuple(x.shape)}) into {ranks.world_size} chunks; make "
                         f"it a multiple of the {where} size")
    if out is not None:
        check_output(out, scattered_shape(x, ranks), x.dtype)


def reduce_scatter(x: torch.Tensor, out: torch.Tensor | None = None, method: str = "auto",
                   group=None) -> torch.Tensor:
    """Sum `x` over ranks (of `group`) and give rank r the r-th of `world_size` chunks of dim 0,
    like `torch.distributed.reduce_scatter_tensor`; summed in fp32, rounded once.

    A collective: every rank (every member of `group`) calls it with the same shape, dtype, method
    and group. An empty `x` (on every rank) gives an empty `out` and moves nothing. Keeps one
    [`ReduceScatter`][tridist.ops.ReduceScatter] per shape, dtype, method, group and stream (its
    table lists the methods).

    Args:
        x: contiguous, on this rank's device, bf16, fp16 or fp32, dim 0 a multiple of the world
            (group) size.
        out: `x.shape[0] // world_size` rows of `x`'s other dimensions, `x`'s dtype; a new
            tensor if None.
        method: `"auto"` or one of `ReduceScatter`'s methods.
        group: a `torch.distributed` process group (e.g. `dist.new_group([0, 1])`, a
            DeviceMesh's `mesh.get_group("tp")`) or `tridist.Group` to sum within, or None for
            the world. Only its members call; group rank r gets chunk r of `group.size()`, and
            the other ranks may meanwhile run their own groups' calls.

    Returns:
        `out`.

    Raises:
        ValueError: before any launch, on every rank: a dtype, device, layout or size it does not
            take on any rank, ranks that disagree on the shape, dtype, method or group, an
            unknown method, or a one-node method on several nodes (see `ReduceScatter`); on this
            rank alone, a `group` it is not a member of.
        TypeError: `x` is not a tensor, or `group` not a process group.
    """
    ranks = ranks_of(group)

    def check() -> None:
        check_input(x, "x")
        if method not in METHODS:
            raise checks.method_error("reduce_scatter", method, METHODS)
        check_scattered(x, out, ranks)

    checks.agree("reduce_scatter", check, {"shape and dtype of x": shape_of(x), "method": method},
                 group=ranks.group)
    op = instances.instance(lambda: ReduceScatter(x.numel(), x.dtype, method, group=group), ReduceScatter,
                            x.numel(), x.dtype, method, ranks.key, device=x.device)
    return op(x, out)
