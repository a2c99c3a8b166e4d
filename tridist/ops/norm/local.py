"""Method "local" (world size 1, no exchange): the fused residual add and RMSNorm of transformers'
decoder layers, one program per row.

The unfused reference, as transformers computes it: `new_residual = residual + x` (rounded to the
dtype), then `LlamaRMSNorm` / `Qwen3RMSNorm` of it: `h = new_residual.float()`, `h * rsqrt(mean(h^2,
-1) + eps)` rounded to the dtype, times `weight` (one rounding). Here program r reads row r of x and
of the residual, stores the rounded sum, sums its squares and stores y (`_rows`); a row longer than
BLOCK is stored and read back chunk by chunk (two passes). Without a residual, `h` is x itself.

`launch_local` is also the second kernel of "two_shot", on the all-reduce's fp32 sums: x's dtype
may then be fp32 and the residual's 16-bit, each read as what it is.
"""
import torch
import triton.language as tl

from tridist.runtime.jit import jit

from ..method import Method
from . import policy
from ._rows import add_residual, inverse_rms, mean_arguments, normed_row


@jit
def add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, y_ptr, new_residual_ptr, hidden, eps, count, factor,
                        HAS_RESIDUAL: tl.constexpr, DIVIDE: tl.constexpr, BLOCK: tl.constexpr,
                        ONE_PASS: tl.constexpr):
    """Row `program_id` of every [rows, hidden] tensor (weight: [hidden]); without HAS_RESIDUAL the
    residual pointers are unused and h is x."""
    base = tl.program_id(0).to(tl.int64) * hidden
    columns = tl.arange(0, BLOCK)
    squares = tl.zeros([BLOCK], tl.float32)
    h = tl.zeros([BLOCK], tl.float32)
    for start in range(0, hidden, BLOCK):
        offsets = base + start + columns
        mask = start + columns < hidden
        h = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            h = add_residual(h, residual_ptr, new_residual_ptr, offsets, mask)
        squares += h * h
    rstd = inverse_rms(squares, count, factor, eps, DIVIDE)
    source = x_ptr
    if HAS_RESIDUAL:
        source = new_residual_ptr
    normed_row(h, rstd, source, weight_ptr, y_ptr, base, hidden, BLOCK, ONE_PASS)


def launch_local(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, y: torch.Tensor,
                 new_residual: torch.Tensor | None, block: int | None = None) -> None:
    """Queue `add_rms_norm_kernel` over x's rows (checked by the caller; none: nothing queued):
    y and, with a residual, new_residual."""
    tokens, hidden = x.shape
    if tokens == 0:
        return
    block, warps, one_pass = policy.row_shape(hidden, block)
    add_rms_norm_kernel[(tokens,)](
        x_ptr=x, residual_ptr=residual, weight_ptr=weight, y_ptr=y, new_residual_ptr=new_residual, hidden=hidden,
        HAS_RESIDUAL=residual is not None, BLOCK=block, ONE_PASS=one_pass, num_warps=warps, enable_fp_fusion=False,
        **mean_arguments(tokens, hidden, x.device, eps))


class Local(Method):
    """The fused add and norm at world size 1, for `tokens` rows of `hidden` (`block`: the chunk,
    `policy.row_shape`); no buffers. Built with the family's arguments (`programs` and `ranks` are
    not used: one program per row)."""

    name = "local"

    def __init__(self, tokens: int, hidden: int, dtype: torch.dtype, block: int | None, programs: int, ranks):
        super().__init__()
        self.block = block

    def launch(self, x, residual, weight, eps, y, new_residual) -> None:
        launch_local(x, residual, weight, eps, y, new_residual, self.block)
