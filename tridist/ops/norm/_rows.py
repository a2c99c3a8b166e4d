"""What the family's kernels share: the residual add, the RMS and the weighted norm of a row, with
the roundings of transformers' `LlamaRMSNorm` / `Qwen3RMSNorm`.

A kernel gives, for a chunk of a row, `total`: the fp32 sum of the ranks' x, in rank order (rank
0's x, plus rank 1's, ...). Then:
- `add_residual`: new_residual = `total + residual` in fp32, rounded once to the dtype and stored;
  returned in fp32 (what the variance and the norm read);
- `inverse_rms`: `rsqrt(mean(h^2) + eps)` over the row's fp32 squares of the rounded new residual,
  the mean taken as `torch.mean` takes it where the kernel runs (`mean_arguments`);
- `store_normed` / `normed_row`: `y = rounded(weight * rounded(h * inverse_rms))`, the product of
  two 16-bit values rounded once.

A row of at most BLOCK elements is held in registers (ONE_PASS); a longer one is stored chunk by
chunk while its squares are summed, then read back for the norm (`normed_row`).

The kernels launch with `enable_fp_fusion=False`: a fused multiply-add of `sum * factor + eps`, or
of the squares into their sum, rounds once where torch rounds twice (its mean and its add are
separate kernels), which changes the last bit of the variance and so, now and then, of y.
"""
import functools

import torch
import triton
import triton.language as tl

from tridist.runtime.backend import is_emulator

from ..protocol import sync_program

# Triton 3.6's interpreter rounds fp32 to bf16 toward zero (and its "rtne" rounds halves up); GPUs
# round to nearest even, as torch does. In the emulator the kernels round bf16 with integers.
_INTEGER_BF16 = tl.constexpr(is_emulator())


@triton.jit
def rounded(values, dtype: tl.constexpr):
    """fp32 `values` rounded to `dtype`, to nearest, ties to even (NaN and infinity kept)."""
    if _INTEGER_BF16 and dtype == tl.bfloat16:
        bits = values.to(tl.int32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return values.to(dtype)


@triton.jit
def add_residual(total, residual_ptr, new_residual_ptr, offsets, mask):
    """`total + residual` (fp32) rounded once and stored at `new_residual_ptr + offsets`; returned
    in fp32 (0 where masked off)."""
    total = total + tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    value = rounded(total, new_residual_ptr.dtype.element_ty)
    tl.store(new_residual_ptr + offsets, value, mask=mask)
    return value.to(tl.float32)


@triton.jit
def inverse_rms(squares, count, factor, eps, DIVIDE: tl.constexpr):
    """rsqrt(mean + eps) from a row's squares (summed here): the mean is their sum divided by
    `count` (DIVIDE) or times `factor` (`mean_arguments`)."""
    total = tl.sum(squares, axis=0)
    if DIVIDE:
        variance = total / count
    else:
        variance = total * factor
    return tl.math.rsqrt(variance + eps)


@triton.jit
def store_normed(h, rstd, weight_ptr, y_ptr, offsets, columns, mask):
    """y = weight * (h * rstd rounded to y's dtype), rounded once, stored at `y_ptr + offsets`."""
    dtype: tl.constexpr = y_ptr.dtype.element_ty
    normed = rounded(h * rstd, dtype).to(tl.float32)
    weight = tl.load(weight_ptr + columns, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offsets, rounded(normed * weight, dtype), mask=mask)


@triton.jit
def normed_row(h, rstd, source_ptr, weight_ptr, y_ptr, base, hidden, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
    """y's row from `base`: from `h`, the row's only chunk (ONE_PASS), or chunk by chunk from the
    rounded new residual stored at `source_ptr + base` by this program's threads."""
    columns = tl.arange(0, BLOCK)
    if ONE_PASS:
        store_normed(h, rstd, weight_ptr, y_ptr, base + columns, columns, columns < hidden)
    else:
        sync_program()  # the chunks were stored by other threads than read them back
        for start in range(0, hidden, BLOCK):
            mask = start + columns < hidden
            again = tl.load(source_ptr + base + start + columns, mask=mask, other=0.0).to(tl.float32)
            store_normed(again, rstd, weight_ptr, y_ptr, base + start + columns, start + columns, mask)


def mean_arguments(tokens: int, hidden: int, device: torch.device, eps: float) -> dict:
    """The kernels' arguments for `mean(h^2, -1) + eps` over `tokens` rows of `hidden`, as torch
    computes it on `device`: on the CPU (the emulator) the sum divided by `hidden`; on GPUs the sum
    times the factor PyTorch's CUDA mean multiplies by, `float(tokens) / float(tokens * hidden)` in
    fp32 (1 / hidden rounded, wherever tokens * hidden is exact in fp32). `eps` rounded to fp32
    as torch's `variance + eps` rounds it."""
    return _mean_arguments(tokens, hidden, device.type, eps)


@functools.lru_cache(maxsize=256)
def _mean_arguments(tokens: int, hidden: int, device_type: str, eps: float) -> dict:
    """`mean_arguments`, worked out once per shape and eps: every eager call launches with them."""
    def fp32(value):
        return torch.tensor(value, dtype=torch.float32)

    return dict(count=fp32(hidden).item(), factor=(fp32(tokens) / fp32(tokens * hidden)).item(),
                eps=fp32(eps).item(), DIVIDE=device_type == "cpu")
