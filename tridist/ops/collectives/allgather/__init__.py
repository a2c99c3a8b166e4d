"""All-gather: every rank contributes a shard of n elements; every rank gets all of them, in rank
order (torch's `all_gather_into_tensor` layout: out is world_size * n elements, rank r's at r*n).
With `group=`, the ranks are a process group's: its members gather among themselves.

The front (`AllGather`, `all_gather`) checks its arguments, asks `policy.choose_all_gather` for
`"auto"` and builds one method; each method is a module of this package, with its protocol in its
docstring: `push`, `pull`, `ll`, `ce` (through staging), `ce_symmetric` ("ce" into a symmetric
`out`), `two_d` ("2d"), `ring`.
"""
import torch

import tridist

from ... import checks, instances, sizing
from ...checks import check_input, check_output, shape_of, symmetric_identity
from ...sizing import row_stride
from ...method import Nothing
from ...ranks import ranks_of
from .. import policy
from .._front import Collective, check_held
from . import ce, ce_symmetric, ll, pull, push, ring, two_d

# The methods by the name `method=` selects them with ("ce" into a symmetric out: `ce_symmetric`).
CLASSES = {kind.name: kind for kind in (push.Push, pull.Pull, ll.Packets, ce.CopyEngines, two_d.TwoD, ring.Ring)}
METHODS = ("auto", *CLASSES)
# An all-gather only moves data, so it takes raw bytes and integers as well.
DTYPES = (*checks.SUPPORTED, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


class AllGather(Collective):
    """An all-gather of `numel` elements of `dtype` per rank, with its own symmetric buffers.

    Build it on every rank (of `group`) at once; call it (`op(x, out)`) back to back on one
    stream, also in CUDA graphs; `free()` it on every rank. `tridist.ops.all_gather` keeps one per
    shape, dtype, method, group and stream.

    | method | how | where |
    | --- | --- | --- |
    | `"ll"` | low-latency packets (`dl.ll`): every 4-byte word travels with the call's epoch as its flag, no separate signal | one node; small messages; `numel * itemsize` a multiple of 4 |
    | `"push"` | the shard is cut in slices (about 128 KB); programs store each slice into every peer's staging and raise its flag, while the rank's own programs copy the slices that have arrived into `out`, so copying out overlaps sending | any topology (across nodes each slice is a put with signal to every rank) |
    | `"pull"` | each rank stages its shard and raises a flag on every peer; each peer reads it through `symm_at` (reads instead of writes over NVLink) | one node |
    | `"ce"` | the copy engines write the shard into every peer's staging, 8 MB chunks with a flag each; a kernel copies each chunk out as its flag rises. Into a symmetric `out` (`symmetric_out=True`) they write straight into the peers' `out`, no staging | one node; for large messages next to other work on the SMs |
    | `"2d"` | each shard crosses to every other node once: put (with its signal) to the rank with the same local index on each other node, which forwards it along its node | several nodes (on one node, `push` with the copy-outs spread differently) |
    | `"ring"` | each slice passes around the ring of ranks, every rank forwarding what it received to the next | any topology |
    | `"auto"` | [`choose_all_gather`][tridist.ops.collectives.policy.choose_all_gather]: `2d` across nodes, `ll` up to 1 MB in all, `ce` into a symmetric `out` above 64 MB, else `push` | |

    Args:
        numel: elements of each rank's shard (0: calls do nothing).
        dtype: bf16, fp16, fp32, uint8, int8, int16, int32 or int64 (an all-gather only moves
            bytes).
        method: one of the methods above.
        programs: the most programs (blocks, so SMs) a call's kernel runs (default: one per SM).
        symmetric_out: every call passes a symmetric `out` (`tridist.symm_empty`), the same
            tensor on every rank; `"ce"` then writes into it directly.
        group: a `torch.distributed` process group (or `tridist.Group`) to gather within, or None
            for the world: ranks, `world_size` and nodes are then the group's (group rank r's shard
            at row r of `out`). Only its members build it; its buffers are the group's own.

    Raises:
        ValueError: an unknown method, a dtype it does not take, `numel` not a non-negative
            int, `programs` not a positive int, a one-node method across several nodes, an
            output past 2^31 elements, for `"ll"` a shard that is not whole 4-byte words, or a
            `group` this rank is not a member of.
    """

    def __init__(self, numel: int, dtype: torch.dtype, method: str = "auto", programs: int | None = None,
                 symmetric_out: bool = False, group=None):
        if method not in METHODS:
            raise checks.method_error("all_gather", method, METHODS)
        checks.check_build("all_gather", numel, dtype, DTYPES)
        self.ranks = ranks = ranks_of(group)
        self.numel, self.dtype = numel, dtype
        self.method = (policy.choose_all_gather(numel * dtype.itemsize * ranks.world_size, ranks, symmetric_out)
                       if method == "auto" else method)
        self.symmetric_out = symmetric_out
        if numel == 0:  # nothing to move: no buffers, and calls return at once
            self.impl = Nothing()
            return
        checks.check_offsets("all_gather", ranks.world_size * row_stride(numel))
        kind = CLASSES[self.method]
        if symmetric_out and self.method == "ce" and ranks.world_size > 1:
            kind = ce_symmetric.CopyEnginesIntoOut
        if kind.one_node:
            checks.require_one_node(f"all_gather method {self.method!r}", "method='2d' or 'push'", ranks)
        self.impl = kind(numel, dtype, sizing.programs_limit(programs, ranks), ranks)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Gather `x` from every rank into `out`.

        Args:
            x: this rank's shard: `numel` elements of `dtype` (as built), contiguous, on this
                rank's device.
            out: `world_size * x.shape[0]` rows of `x`'s other dimensions (`world_size`
                elements for a 0-d `x`; the group's size with `group`), `x`'s dtype; a new
                tensor if None. Required, and symmetric, with `symmetric_out`: allocated by the
                world or by a group every member of this one is in.

        Returns:
            `out`, every rank's shard in rank order.

        Raises:
            ValueError: `x` or `out` not what this instance was built for, on any rank; with
                `symmetric_out`, ranks passed different tensors (`checks.agree` says when
                every rank checks).
        """
        ranks = self.ranks

        def check() -> None:
            checks.check_same(x, self.numel, self.dtype, "all-gather", DTYPES)
            if out is None and self.symmetric_out:
                raise ValueError("this all-gather was built with symmetric_out=True: pass out, a symmetric tensor "
                                 "(tridist.symm_empty)")
            if out is not None:
                check_output(out, gathered_shape(x, ranks), x.dtype)
            if self.symmetric_out:
                check_held(out, "out", ranks, "this all-gather was built with symmetric_out=True: ")

        checks.agree("all_gather", check, {"shape and dtype of x": shape_of(x),
                                              "out": symmetric_identity(out) if self.symmetric_out else "any"},
                     group=ranks.group)
        if out is None:
            out = torch.empty(gathered_shape(x, ranks), dtype=x.dtype, device=x.device)
        self.impl.launch(x, out)
        return out


def gathered_shape(x: torch.Tensor, ranks) -> tuple:
    """The shape of the all-gather of `x` among `ranks` (the world or an `ops.ranks.Ranks`):
    `world_size` times its rows."""
    return (ranks.world_size * x.shape[0], *x.shape[1:]) if x.dim() else (ranks.world_size,)


def all_gather(x: torch.Tensor, out: torch.Tensor | None = None, method: str = "auto", group=None) -> torch.Tensor:
    """Gather `x` from every rank (of `group`) into `out` (`world_size * x.shape[0]` rows), like
    `torch.distributed.all_gather_into_tensor`.

    A collective: every rank (every member of `group`) calls it with the same shape, dtype, method
    and group, and a symmetric `out` on every rank or on none. An empty `x` (on every rank) gives
    an empty `out` and moves nothing. Keeps one [`AllGather`][tridist.ops.AllGather] per shape,
    dtype, method, group and stream (its table lists the methods).

    Args:
        x: this rank's shard, contiguous, on this rank's device: bf16, fp16, fp32, uint8, int8,
            int16, int32 or int64.
        out: the result, `world_size * x.shape[0]` rows of `x`'s other dimensions in `x`'s
            dtype; a new tensor if None. A symmetric `out` (`tridist.symm_empty`, the same on
            every rank) is written straight from the peers by method `"ce"`, what `"auto"` runs
            there above 64 MB on one node; `x` may then be `out`'s own row.
        method: `"auto"` or one of `AllGather`'s methods.
        group: a `torch.distributed` process group (e.g. `dist.new_group([0, 1])`, a
            DeviceMesh's `mesh.get_group("tp")`) or `tridist.Group` to gather within, or None for
            the world. Only its members call; `out` then holds the group's shards in group rank
            order, and the other ranks may meanwhile run their own groups' calls.

    Returns:
        `out`, every rank's shard in rank order.

    Raises:
        ValueError: before any launch, on every rank: a dtype, device, layout or size it does not
            take on any rank, ranks that disagree on the shape, dtype, method, group or a
            symmetric `out`, an unknown method, or a one-node method on several nodes (see
            `AllGather`); on this rank alone, a `group` it is not a member of.
        TypeError: `x` is not a tensor, or `group` not a process group.
    """
    ranks = ranks_of(group)

    def check() -> None:
        check_input(x, "x", DTYPES)
        if method not in METHODS:
            raise checks.method_error("all_gather", method, METHODS)
        if out is not None:
            check_output(out, gathered_shape(x, ranks), x.dtype)

    checks.agree("all_gather", check, {"shape and dtype of x": shape_of(x), "method": method,
                                          "out": symmetric_identity(out)}, group=ranks.group)
    symmetric = out is not None and tridist.is_symmetric(out)
    op = instances.instance(lambda: AllGather(x.numel(), x.dtype, method, symmetric_out=symmetric, group=group),
                            AllGather, x.numel(), x.dtype, method, symmetric, ranks.key, device=x.device)
    return op(x, out)
