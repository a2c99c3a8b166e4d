"""The residual add and RMSNorm around every tensor-parallel layer of a decoder, with the layer's
all-reduce fused in: `all_reduce_rms_norm(x, residual, weight)` gives `new_residual = residual +
the sum over the ranks of x` and `y = RMSNorm(new_residual) * weight`, in one kernel at decode
sizes; `add_rms_norm(x, residual, weight)` is the same on one rank (no exchange, no group).

What every method computes, the same bits on every rank of the group (for each element, in fp32):
`s = x of rank 0`, then `s = s + x of rank r` for r = 1, 2, ... in rank order, then `s = s +
residual`, rounded once to x's dtype: `new_residual`. Then, as transformers' `LlamaRMSNorm` and
`Qwen3RMSNorm` do, `h = float(new_residual)`, `variance = mean(h * h)` over the row in fp32,
`normed = rounded(h * rsqrt(variance + eps))` to the dtype, and `y = rounded(weight * normed)`
(the product of two 16-bit values in fp32, rounded once). Rounding is to nearest, ties to even.

At world size 1 this is `torch`'s `residual + x` and then that formula, bit for bit, where the
variance comes out the same: `mean` is taken as torch takes it on the device (on GPUs the fp32 sum
times PyTorch's factor `float(T) / float(T * hidden)`, on the CPU the sum divided by `hidden`) and
`rsqrt` is the GPU's approximate one, which torch's CUDA kernel uses too (on the CPU the emulator's
is `1 / sqrt`, each step correctly rounded; torch's own CPU rsqrt is not). The fp32 sum of a row's squares is added in another order than
torch's reduction: where that changes its last bit (never where the partial sums are exact), y may
differ by one unit in the last place of the dtype in a few elements.

| method | module | how | where |
| --- | --- | --- | --- |
| `"local"` | `local` | one program per row: add, norm; no exchange | world size 1 |
| `"ll"` | `ll` | one kernel: x to every peer in low-latency packets, each row summed in rank order, residual, norm | one node; rows of whole 4-byte words |
| `"one_shot"` | `one_shot` | one kernel: x pushed to every peer (a put with signal across nodes), summed, residual, norm | any topology |
| `"two_shot"` | `two_shot` | the all-reduce's two-shot on fp32 sums, then the local kernel | any topology; prefill sizes on many ranks |
| `"auto"` | [`choose_all_reduce_rms_norm`][tridist.ops.norm.policy.choose_all_reduce_rms_norm] | `local` at world size 1, `ll` for small messages on one node, `one_shot` up to 256 rows (and beyond up to 4 ranks in 16-bit data), else `two_shot` | |

A row longer than 16384 elements (`policy.ONE_PASS_MAX`) is stored and read back in chunks (two
passes); any hidden size runs.
"""
import math

import torch

from tridist.runtime.tensors import check_tensor

from .. import checks, instances, sizing
from ..checks import check_input, check_output, shape_of
from ..method import Nothing
from ..ranks import ranks_of
from . import ll, local, one_shot, policy, two_shot
from .local import launch_local

CLASSES = {kind.name: kind for kind in (local.Local, ll.Packets, one_shot.OneShot, two_shot.TwoShot)}
METHODS = ("auto", *CLASSES)


def check_rows(x, residual, weight, eps, residual_required: bool = True) -> None:
    """This rank's arguments of one call: x [T, hidden] (T >= 0, hidden >= 1), residual None (where
    not required) or x's shape and dtype, weight [hidden] of x's dtype, all contiguous on this
    rank's device in bf16, fp16 or fp32; eps a non-negative finite number.

    Raises:
        ValueError: what to change; TypeError: a tensor argument that is not a tensor.
    """
    check_input(x, "x")
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"x must be [tokens, hidden] with hidden >= 1, got shape {tuple(x.shape)}: reshape it to "
                         "(-1, hidden)")
    if residual is not None or residual_required:
        check_input(residual, "residual")
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual must be x's shape {tuple(x.shape)} and dtype {x.dtype}, got "
                             f"{tuple(residual.shape)} {residual.dtype}")
    check_tensor(weight, "weight")
    if tuple(weight.shape) != (x.shape[1],) or weight.dtype != x.dtype:
        raise ValueError(f"weight must be [{x.shape[1]}] in x's dtype {x.dtype} (the norm's product is taken in it), "
                         f"got {tuple(weight.shape)} {weight.dtype}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")


def _same(x, residual, weight, eps) -> dict:
    """What every rank must pass alike (`checks.agree`)."""
    return {"shape and dtype of x": shape_of(x), "shape and dtype of residual": shape_of(residual),
            "shape and dtype of weight": shape_of(weight), "eps": repr(eps)}


class AllReduceRMSNorm:
    """`all_reduce_rms_norm` for `tokens` rows of `hidden` elements of `dtype` per rank, with its own
    symmetric buffers (none at world size 1): see the module docstring for what it computes.

    Build it on every rank (of `group`) at once; call it back to back on one stream, also in CUDA
    graphs; `free()` it on every rank. `tridist.ops.all_reduce_rms_norm` keeps one per shape,
    dtype, group and stream.

    Args:
        tokens: rows of x (0: calls do nothing and return empty tensors).
        hidden: elements of a row (>= 1).
        dtype: bf16, fp16 or fp32.
        method: `"auto"` or one of the module docstring's methods (`"local"` at world size 1 only).
        block: the elements of a row a program holds at once (a power of two): rows longer than it
            are normed in two passes; None: `policy.row_shape`'s.
        programs: the most programs the fused methods' kernels run (default: one per SM; each
            takes a contiguous range of rows).
        group: a `torch.distributed` process group (or `tridist.Group`) to sum within, or None for
            the world. Only its members build it.

    Raises:
        ValueError: an unknown method, a dtype it does not take, `tokens` or `hidden` out of range,
            `block` not a power of two, `programs` not a positive int, `"local"` at a world size
            above 1, `"ll"` across nodes or on rows that are not whole 4-byte words, staging past
            2^31 elements, or a `group` this rank is not a member of.
    """

    def __init__(self, tokens: int, hidden: int, dtype: torch.dtype, method: str = "auto", block: int | None = None,
                 programs: int | None = None, group=None):
        if method not in METHODS:
            raise checks.method_error("all_reduce_rms_norm", method, METHODS)
        checks.check_build("all_reduce_rms_norm", tokens, dtype)
        if not isinstance(hidden, int) or hidden < 1:
            raise ValueError(f"all_reduce_rms_norm needs a positive int hidden size, got {hidden!r}")
        if block is not None and (not isinstance(block, int) or block < 1 or block & (block - 1)):
            raise ValueError(f"block must be a power of two (elements of a row a program holds), got {block!r}")
        self.ranks = ranks = ranks_of(group)
        self.tokens, self.hidden, self.dtype = tokens, hidden, dtype
        self.method = (policy.choose_all_reduce_rms_norm(tokens, hidden, dtype.itemsize, ranks) if method == "auto"
                       else method)
        if self.method == "local" and ranks.world_size > 1:
            raise ValueError(f"all_reduce_rms_norm method 'local' runs at world size 1; these ranks are "
                             f"{ranks.world_size}: use method='auto'")
        kind = CLASSES[self.method]
        if kind.one_node:
            checks.require_one_node(f"all_reduce_rms_norm method {self.method!r}", "method='one_shot'", ranks)
        limit = sizing.programs_limit(programs, ranks)
        self.impl = Nothing() if tokens == 0 else kind(tokens, hidden, dtype, block, limit, ranks)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                 y: torch.Tensor | None = None,
                 new_residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`(y, new_residual)` for this rank's x (module docstring).

        Args:
            x: [tokens, hidden] of `dtype` (as built), contiguous, on this rank's device.
            residual: x's shape and dtype.
            weight: [hidden] of x's dtype.
            eps: added to the variance; the same on every rank.
            y: where y goes (x's shape and dtype); a new tensor if None. May be x.
            new_residual: where the new residual goes; a new tensor if None. May be `residual`
                (updated in place), not y.

        Returns:
            `(y, new_residual)`, the same bits on every rank.

        Raises:
            ValueError: arguments not what this instance was built for, on any rank, or ranks
                that passed different shapes, dtypes or eps (`checks.agree` says when every rank
                checks).
        """
        shape = (self.tokens, self.hidden)

        def check() -> None:
            check_rows(x, residual, weight, eps)
            if tuple(x.shape) != shape or x.dtype != self.dtype:
                raise ValueError(f"this all_reduce_rms_norm was built for x of shape {shape} in {self.dtype}; x is "
                                 f"{tuple(x.shape)} {x.dtype}: build another, or call tridist.ops.all_reduce_rms_norm, "
                                 "which keeps one per shape")
            for out in (y, new_residual):
                if out is not None:
                    check_output(out, shape, self.dtype)
            if self.tokens and y is not None and new_residual is not None and y.data_ptr() == new_residual.data_ptr():
                raise ValueError("y and new_residual must be different tensors")

        checks.agree("all_reduce_rms_norm", check, _same(x, residual, weight, eps), group=self.ranks.group)
        y = torch.empty_like(x) if y is None else y
        new_residual = torch.empty_like(x) if new_residual is None else new_residual
        self.impl.launch(x, residual, weight, eps, y, new_residual)
        return y, new_residual

    def free(self) -> None:
        """Give the symmetric buffers back (collective: every rank, in the same order)."""
        self.impl.free()


def all_reduce_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
                        group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum over the ranks (of `group`) of x, plus `residual`, and transformers' RMSNorm of that
    times `weight`: the all-reduce, residual add and norm around a decoder's tensor-parallel layer,
    one kernel at decode sizes (the module docstring says what it computes and in which order).

    A collective: every rank (every member of `group`) calls it with the same shapes, dtypes, eps
    and group. At world size 1 it is the fused add and norm, with no exchange. Capturable in CUDA
    graphs (after a first call on the capture stream, which builds the op's instance). Keeps one
    [`AllReduceRMSNorm`][tridist.ops.AllReduceRMSNorm] per shape, dtype, group and stream.

    Args:
        x: [T, hidden] (any T >= 0), bf16, fp16 or fp32, contiguous, on this rank's device: this
            rank's part of the sum (a row-parallel layer's partial output).
        residual: x's shape and dtype: the residual stream.
        weight: [hidden], x's dtype: the norm's weight.
        eps: added to the variance, the same on every rank.
        group: a `torch.distributed` process group (or `tridist.Group`) to sum within, or None for
            the world.

    Returns:
        `(y, new_residual)`: new tensors, the same bits on every rank.

    Raises:
        ValueError: before any launch, on every rank: shapes, dtypes, devices or layouts it does
            not take on any rank, or ranks that disagree on them or on eps; on this rank alone, a
            `group` it is not a member of.
        TypeError: an argument that is not a tensor, or `group` not a process group.
    """
    ranks = ranks_of(group)
    checks.agree("all_reduce_rms_norm", lambda: check_rows(x, residual, weight, eps), _same(x, residual, weight, eps),
                 group=ranks.group)
    tokens, hidden = x.shape
    op = instances.instance(lambda: AllReduceRMSNorm(tokens, hidden, x.dtype, group=group), AllReduceRMSNorm, tokens,
                            hidden, x.dtype, ranks.key, device=x.device)
    return op(x, residual, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual + x`, then transformers' RMSNorm of it times `weight`, in one kernel on this rank (no
    exchange, no group): `all_reduce_rms_norm`'s world-size-1 method on its own, for a layer whose
    input is already summed (the first layer's input norm, an MoE layer's output).

    Args:
        x: [T, hidden] (any T >= 0), bf16, fp16 or fp32, contiguous, on this rank's device.
        residual: x's shape and dtype, or None: then `new_residual` is x itself (no copy) and y is
            the norm of x.
        weight: [hidden], x's dtype.
        eps: added to the variance.

    Returns:
        `(y, new_residual)`: y a new tensor; new_residual a new tensor, or x where `residual` is
        None. Rounded as the module docstring says: with a residual, torch's `residual + x` and
        transformers' formula bit for bit (where the variance comes out the same).

    Raises:
        ValueError: shapes, dtypes, devices or layouts it does not take, or eps not a finite number
            >= 0, before any launch.
        TypeError: an argument that is not a tensor.
    """
    check_rows(x, residual, weight, eps, residual_required=False)
    y = torch.empty_like(x)
    new_residual = x if residual is None else torch.empty_like(x)
    launch_local(x, residual, weight, eps, y, None if residual is None else new_residual)
    return y, new_residual
