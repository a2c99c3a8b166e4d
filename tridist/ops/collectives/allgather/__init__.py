"""All-gather: every rank contributes a shard of n elements; every rank gets all of them, in rank
order (torch's `all_gather_into_tensor` layout: out is world_size * n elements, rank r's at r*n).

The front (`AllGather`, `all_gather`) checks its arguments, asks `policy.choose_all_gather` for
`"auto"` and builds one method; each method is a module of this package, with its protocol in its
docstring: `push`, `pull`, `ll`, `ce` (through staging), `ce_symmetric` ("ce" into a symmetric
`out`), `two_d` ("2d"), `ring`.
"""
import torch

import tridist

from ... import _protocol
from ..._protocol import check_input, check_output, row_stride, shape_of, symmetric_identity
from ...method import Nothing
from .. import policy
from .._front import Collective
from . import ce, ce_symmetric, ll, pull, push, ring, two_d

# The methods by the name `method=` selects them with ("ce" into a symmetric out: `ce_symmetric`).
CLASSES = {kind.name: kind for kind in (push.Push, pull.Pull, ll.Packets, ce.CopyEngines, two_d.TwoD, ring.Ring)}
METHODS = ("auto", *CLASSES)
# An all-gather only moves data, so it takes raw bytes and integers as well.
DTYPES = (*_protocol.SUPPORTED, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


class AllGather(Collective):
    """An all-gather of `numel` elements of `dtype` per rank, with its own symmetric buffers.

    Build it on every rank at once; call it (`op(x, out)`) back to back on one stream, also in
    CUDA graphs; `free()` it on every rank. `tridist.ops.all_gather` keeps one per shape, dtype,
    method and stream.

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

    Raises:
        ValueError: an unknown method, a dtype it does not take, `numel` not a non-negative
            int, `programs` not a positive int, a one-node method in a world of several nodes, an
            output past 2^31 elements, or for `"ll"` a shard that is not whole 4-byte words.
    """

    def __init__(self, numel: int, dtype: torch.dtype, method: str = "auto", programs: int | None = None,
                 symmetric_out: bool = False):
        if method not in METHODS:
            raise _protocol.method_error("all_gather", method, METHODS)
        _protocol.check_build("all_gather", numel, dtype, DTYPES)
        self.world = w = tridist.world()
        self.numel, self.dtype = numel, dtype
        self.method = (policy.choose_all_gather(numel * dtype.itemsize * w.world_size, w, symmetric_out)
                       if method == "auto" else method)
        self.symmetric_out = symmetric_out
        if numel == 0:  # nothing to move: no buffers, and calls return at once
            self.impl = Nothing()
            return
        _protocol.check_offsets("all_gather", w.world_size * row_stride(numel))
        kind = CLASSES[self.method]
        if symmetric_out and self.method == "ce" and w.world_size > 1:
            kind = ce_symmetric.CopyEnginesIntoOut
        if kind.one_node:
            _protocol.require_one_node(f"all_gather method {self.method!r}", "method='2d' or 'push'")
        self.impl = kind(numel, dtype, _protocol.programs_limit(programs, w))

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Gather `x` from every rank into `out`.

        Args:
            x: this rank's shard: `numel` elements of `dtype` (as built), contiguous, on this
                rank's device.
            out: `world_size * x.shape[0]` rows of `x`'s other dimensions (`world_size`
                elements for a 0-d `x`), `x`'s dtype; a new tensor if None. Required, and
                symmetric, with `symmetric_out`.

        Returns:
            `out`, every rank's shard in rank order.

        Raises:
            ValueError: `x` or `out` not what this instance was built for, on any rank; with
                `symmetric_out`, ranks passed different tensors (`_protocol.agree` says when
                every rank checks).
        """
        w = self.world

        def check() -> None:
            _protocol.check_same(x, self.numel, self.dtype, "all-gather", DTYPES)
            if out is None and self.symmetric_out:
                raise ValueError("this all-gather was built with symmetric_out=True: pass out, a symmetric tensor "
                                 "(tridist.symm_empty)")
            if out is not None:
                check_output(out, gathered_shape(x, w), x.dtype)
            if self.symmetric_out and not tridist.is_symmetric(out):
                raise ValueError("this all-gather was built with symmetric_out=True: out must be a symmetric tensor "
                                 "(tridist.symm_empty), the same on every rank")

        _protocol.agree("all_gather", check, {"shape and dtype of x": shape_of(x),
                                              "out": symmetric_identity(out) if self.symmetric_out else "any"})
        if out is None:
            out = torch.empty(gathered_shape(x, w), dtype=x.dtype, device=x.device)
        self.impl.launch(x, out)
        return out


def gathered_shape(x: torch.Tensor, world) -> tuple:
    """The shape of the all-gather of `x`: `world_size` times its rows."""
    return (world.world_size * x.shape[0], *x.shape[1:]) if x.dim() else (world.world_size,)


def all_gather(x: torch.Tensor, out: torch.Tensor | None = None, method: str = "auto") -> torch.Tensor:
    """Gather `x` from every rank into `out` (`world_size * x.shape[0]` rows), like
    `torch.distributed.all_gather_into_tensor`.

    A collective: every rank calls it with the same shape, dtype and method, and a symmetric
    `out` on every rank or on none. An empty `x` (on every rank) gives an empty `out` and moves
    nothing. Keeps one [`AllGather`][tridist.ops.AllGather] per shape,
    dtype, method and stream (its table lists the methods).

    Args:
        x: this rank's shard, contiguous, on this rank's device: bf16, fp16, fp32, uint8, int8,
            int16, int32 or int64.
        out: the result, `world_size * x.shape[0]` rows of `x`'s other dimensions in `x`'s
            dtype; a new tensor if None. A symmetric `out` (`tridist.symm_empty`, the same on
            every rank) is written straight from the peers by method `"ce"`, what `"auto"` runs
            there above 64 MB on one node; `x` may then be `out`'s own row.
        method: `"auto"` or one of `AllGather`'s methods.

    Returns:
        `out`, every rank's shard in rank order.

    Raises:
        ValueError: before any launch, on every rank: a dtype, device, layout or size it does not
            take on any rank, ranks that disagree on the shape, dtype, method or a symmetric
            `out`, an unknown method, or a one-node method on several nodes (see `AllGather`).
        TypeError: `x` is not a tensor.
    """
    def check() -> None:
        check_input(x, "x", DTYPES)
        if method not in METHODS:
            raise _protocol.method_error("all_gather", method, METHODS)
        if out is not None:
            check_output(out, gathered_shape(x, tridist.world()), x.dtype)

    _protocol.agree("all_gather", check, {"shape and dtype of x": shape_of(x), "method": method,
                                          "out": symmetric_identity(out)})
    symmetric = out is not None and tridist.is_symmetric(out)
    op = _protocol.instance(lambda: AllGather(x.numel(), x.dtype, method, symmetric_out=symmetric), AllGather,
                            x.numel(), x.dtype, method, symmetric, device=x.device)
    return op(x, out)


@torch.library.custom_op("tridist::all_gather", mutates_args=())
def all_gather_op(x: torch.Tensor, method: str = "auto") -> torch.Tensor:
    """`all_gather` as a PyTorch custom op (`torch.ops.tridist.all_gather`), for torch.compile."""
    return all_gather(x, method=method)


@all_gather_op.register_fake
def _all_gather_shape(x: torch.Tensor, method: str = "auto") -> torch.Tensor:
    n = tridist.world().world_size
    return x.new_empty((n * x.shape[0], *x.shape[1:]) if x.dim() else (n,))
