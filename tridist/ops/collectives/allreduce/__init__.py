"""All-reduce (sum), accumulated in fp32 whatever the input dtype: x has n elements; every rank gets
out = sum over ranks of x, rounded once, the same bits on every rank. With `group=`, the ranks are
a process group's: its members sum among themselves.

The front (`AllReduce`, `all_reduce`, `all_reduce_`) checks its arguments, asks
`policy.choose_all_reduce` for `"auto"` and builds one method; each method is a module of this
package, with its protocol in its docstring: `ll`, `one_shot`, `two_shot` (through staging),
`two_shot_symmetric` ("two_shot" in place on a symmetric x), `ce`, `reduce_scatter_all_gather`
("rs_ag").
"""
import torch
import triton

import tridist

from ... import checks, instances, sizing
from ...checks import check_input, check_output, shape_of, symmetric_identity
from ...sizing import row_stride
from ...method import Nothing
from ...ranks import ranks_of
from .. import policy
from .._front import Collective, check_held
from . import ce, ll, one_shot, reduce_scatter_all_gather, two_shot, two_shot_symmetric

# The methods by the name `method=` selects them with ("two_shot" in place on a symmetric x:
# `two_shot_symmetric`).
CLASSES = {kind.name: kind for kind in (one_shot.OneShot, two_shot.TwoShot, ll.Packets, ce.CopyEngines,
                                        reduce_scatter_all_gather.ReduceScatterAllGather)}
METHODS = ("auto", *CLASSES)


class AllReduce(Collective):
    """A sum all-reduce of `numel` elements of `dtype` per rank, with its own symmetric buffers:
    every rank gets the sum over ranks, summed in fp32 and rounded once, the same bits on every
    rank.

    Build it on every rank (of `group`) at once; call it (`op(x, out)`) back to back on one
    stream, also in CUDA graphs; `free()` it on every rank. `tridist.ops.all_reduce` keeps one per
    shape, dtype, method, group and stream.

    | method | how | where |
    | --- | --- | --- |
    | `"ll"` | one-shot in low-latency packets: all of x to every peer, each 4-byte word with the call's epoch as its flag; summed in rank order | one node; small messages; whole 4-byte words |
    | `"one_shot"` | every program pushes its slice of x to every peer, raises a flag, waits for every peer's and sums the rows it received: one step, `world_size - 1` copies of the data received per rank | any topology; while latency dominates |
    | `"two_shot"` | a sliced reduce-scatter, then the program that summed a slice pushes the sum to every peer: each rank receives `2 (n-1)/n` of the data | any topology; large messages |
    | `"ce"` | a copy-engine reduce-scatter, then a copy-engine all-gather of the sums | one node; large messages next to other work on the SMs |
    | `"rs_ag"` | the reduce-scatter, then the all-gather of the sums, as two kernels, each the method its op's `auto` picks | any topology; large messages from 4 ranks |
    | `"auto"` | [`choose_all_reduce`][tridist.ops.collectives.policy.choose_all_reduce]: `ll` while a rank sends at most 1 MB (one node), `one_shot` up to 4 MB sent, `rs_ag` from 64 MB a rank with 4 ranks or more on one node, else `two_shot` (on one node in place on a symmetric x: `two_shot` from 1 MB) | |

    With `symmetric_in_place`, every call reduces a symmetric x (`tridist.symm_empty`, the same
    tensor on every rank) in place (`out=x`). On one node the two-shot then needs no staging: rank
    r reads chunk r of every rank's x through `symm_at`, sums it and stores the sum into every
    rank's x, as PyTorch's `two_shot_all_reduce_` does (from 64 MB with two programs per SM).

    Args:
        numel: elements of each rank's x (0: calls do nothing).
        dtype: bf16, fp16 or fp32.
        method: one of the methods above.
        programs: the most programs (blocks, so SMs) a call's kernels run (default: one per SM).
        symmetric_in_place: every call passes a symmetric x with `out=x`.
        group: a `torch.distributed` process group (or `tridist.Group`) to sum within, or None
            for the world: ranks, `world_size` and nodes are then the group's. Only its members
            build it; its buffers are the group's own.

    Raises:
        ValueError: an unknown method, a dtype it does not take, `numel` not a non-negative
            int, `programs` not a positive int, a one-node method across several nodes, buffers
            past 2^31 elements, for `"ll"` data that is not whole 4-byte words, or a `group` this
            rank is not a member of.
    """

    def __init__(self, numel: int, dtype: torch.dtype, method: str = "auto", programs: int | None = None,
                 symmetric_in_place: bool = False, group=None):
        if method not in METHODS:
            raise checks.method_error("all_reduce", method, METHODS)
        checks.check_build("all_reduce", numel, dtype)
        self.ranks = ranks = ranks_of(group)
        self.numel, self.dtype = numel, dtype
        self.symmetric_in_place = symmetric_in_place
        nbytes = numel * dtype.itemsize
        self.method = policy.choose_all_reduce(nbytes, ranks, symmetric_in_place) if method == "auto" else method
        if numel == 0:  # nothing to sum: no buffers, and calls return at once
            self.impl = Nothing()
            return
        # one-shot and LL staging hold all of x per rank; the others a chunk per rank, twice
        whole = self.method in ("one_shot", "ll")
        checks.check_offsets("all_reduce", ranks.world_size * row_stride(numel) if whole else
                                2 * ranks.world_size * row_stride(triton.cdiv(numel, ranks.world_size)))
        limit = sizing.programs_limit(programs, ranks)
        kind = CLASSES[self.method]
        if symmetric_in_place and self.method == "two_shot" and ranks.nnodes == 1:
            kind = two_shot_symmetric.SymmetricTwoShot
            if programs is None:
                limit = policy.symmetric_two_shot_programs(nbytes, limit)
        if kind.one_node:
            checks.require_one_node(f"all_reduce method {self.method!r}", "method='one_shot' or 'two_shot'", ranks)
        self.impl = kind(numel, dtype, limit, ranks)

    @property
    def direct(self) -> bool:
        """Whether the calls reduce the symmetric x in place without staging (`two_shot_symmetric`)."""
        return isinstance(self.impl, two_shot_symmetric.SymmetricTwoShot)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Sum `x` over ranks into `out`.

        Args:
            x: `numel` elements of `dtype` (as built), contiguous, on this rank's device.
            out: `x`'s shape and dtype; a new tensor if None; `x` itself for in place (required
                with `symmetric_in_place`, x then allocated by the world or by a group every
                member of this one is in).

        Returns:
            `out`, the sum over ranks.

        Raises:
            ValueError: `x` or `out` not what this instance was built for, on any rank; with
                `symmetric_in_place`, ranks passed different tensors (`checks.agree` says when
                every rank checks).
        """
        def check() -> None:
            checks.check_same(x, self.numel, self.dtype, "all-reduce")
            if out is not None:
                check_output(out, tuple(x.shape), x.dtype)
            if self.symmetric_in_place:
                if out is None or out.data_ptr() != x.data_ptr() or not tridist.is_symmetric(x):
                    raise ValueError("this all-reduce was built with symmetric_in_place=True: call it with out=x, x "
                                     "a symmetric tensor (tridist.symm_empty), the same on every rank")
                check_held(x, "x", self.ranks, "this all-reduce was built with symmetric_in_place=True: ")

        checks.agree("all_reduce", check, {"shape and dtype of x": shape_of(x),
                                              "x": symmetric_identity(x) if self.symmetric_in_place else "any"},
                     group=self.ranks.group)
        if out is None:
            out = torch.empty_like(x)
        self.impl.launch(x, out)
        return out


def all_reduce(x: torch.Tensor, out: torch.Tensor | None = None, method: str = "auto", group=None) -> torch.Tensor:
    """Sum `x` over ranks (of `group`) into `out`, a new tensor unless given: out of place, where
    `torch.distributed.all_reduce` sums in place (that is `all_reduce_(x)`, or `out=x`); summed
    in fp32, rounded once, the same bits on every rank.

    A collective: every rank (every member of `group`) calls it with the same shape, dtype, method
    and group, and a symmetric x in place on every rank or on none. An empty `x` (on every rank)
    moves nothing. Keeps one [`AllReduce`][tridist.ops.AllReduce] per shape, dtype, method, group
    and stream (its table lists the methods).

    Args:
        x: contiguous, on this rank's device, bf16, fp16 or fp32.
        out: `x`'s shape and dtype; a new tensor if None; `x` for in place. In place on a
            symmetric x (`tridist.symm_empty`) on one node, the two-shot reduces it without
            staging: what `"auto"` runs once a rank sends more than 1 MB.
        method: `"auto"` or one of `AllReduce`'s methods.
        group: a `torch.distributed` process group (e.g. `dist.new_group([0, 1])`, a
            DeviceMesh's `mesh.get_group("tp")`) or `tridist.Group` to sum within, or None for
            the world. Only its members call; the other ranks may meanwhile run their own
            groups' calls.

    Returns:
        `out` (a new tensor if None was given): the sum over ranks.

    Raises:
        ValueError: before any launch, on every rank: a dtype, device, layout or size it does not
            take on any rank, ranks that disagree on the shape, dtype, method, group or a
            symmetric x in place, an unknown method, or a one-node method on several nodes (see
            `AllReduce`); on this rank alone, a `group` it is not a member of.
        TypeError: `x` is not a tensor, or `group` not a process group.
    """
    ranks = ranks_of(group)

    def check() -> None:
        check_input(x, "x")
        if method not in METHODS:
            raise checks.method_error("all_reduce", method, METHODS)
        if out is not None:
            check_output(out, tuple(x.shape), x.dtype)

    in_place = isinstance(x, torch.Tensor) and isinstance(out, torch.Tensor) and out.data_ptr() == x.data_ptr()
    checks.agree("all_reduce", check, {"shape and dtype of x": shape_of(x), "method": method,
                                          "x in place": symmetric_identity(x) if in_place else "not in place"},
                 group=ranks.group)
    symmetric = in_place and tridist.is_symmetric(x)
    op = instances.instance(lambda: AllReduce(x.numel(), x.dtype, method, symmetric_in_place=symmetric, group=group),
                            AllReduce, x.numel(), x.dtype, method, symmetric, ranks.key, device=x.device)
    return op(x, out)


def all_reduce_(x: torch.Tensor, method: str = "auto", group=None) -> torch.Tensor:
    """Sum `x` over ranks (of `group`) in place, as `torch.distributed.all_reduce(x, group=group)`
    does: `all_reduce(x, out=x, group=group)`. On a symmetric x (`tridist.symm_empty`, the same
    tensor on every rank) on one node, the two-shot sums it without staging (see `all_reduce`).

    Args:
        x: contiguous, on this rank's device, bf16, fp16 or fp32; regular or symmetric.
        method: `"auto"` or one of `AllReduce`'s methods.
        group: a `torch.distributed` process group or `tridist.Group` to sum within, or None for
            the world (see `all_reduce`).

    Returns:
        `x`, which now holds the sum over ranks (summed in fp32, rounded once, the same bits on
        every rank).

    Raises:
        ValueError, TypeError: as `all_reduce`.
    """
    return all_reduce(x, out=x, method=method, group=group)
