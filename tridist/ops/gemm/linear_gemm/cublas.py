"""`tridist.ops.linear` for more than `policy.MAX_ROWS` rows (a prefill): cuBLAS's product written
where the output goes, and for swiglu one pass over it that applies the epilogue.

The unfused reference is `linear_gemm.reference`: `F.linear`, then `F.silu(gate) * up`, which
reads the product twice and writes twice (silu, then the product), and a copy where an output
buffer is given. Here cuBLAS writes the plain product into `out` itself, and the swiglu product
into a scratch tensor that `swiglu_kernel` reads once, writing `out`: the rounding is
`split_k.swiglu`'s, the same as the split-K kernel's epilogue and LlamaMLP's.

With many rows the weight is reused across the rows of a tile, so cuBLAS's own tiling is the
right product; only its epilogue is ours.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tridist.runtime.jit import jit

from .split_k import swiglu

BLOCK = 1024
"""Output columns a program of `swiglu_kernel` writes (a row of them)."""


@jit
def swiglu_kernel(y_ptr, out_ptr, N, BLOCK: tl.constexpr):
    """out[r, c] = silu(y[r, c]) * y[r, N + c] for y [M, 2N] and out [M, N], both contiguous;
    program (r, b) takes row r's columns b*BLOCK ... (b+1)*BLOCK - 1."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(y_ptr + row * 2 * N + cols, mask=mask)
    up = tl.load(y_ptr + row * 2 * N + N + cols, mask=mask)
    tl.store(out_ptr + row * N + cols, swiglu(gate, up).to(out_ptr.dtype.element_ty), mask=mask)


def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, swiglu_epilogue: bool,
            out: torch.Tensor) -> None:
    """out ([M, N], contiguous) = x ([M, K], rows contiguous) @ weight.T (+ bias), with swiglu's
    epilogue where asked (weight then [2N, K]). Arguments checked by the front."""
    if not swiglu_epilogue:
        if bias is None:
            torch.mm(x, weight.t(), out=out)
        else:
            torch.addmm(bias, x, weight.t(), out=out)
        return
    m, n = out.shape
    swiglu_kernel[(m, triton.cdiv(n, BLOCK))](F.linear(x, weight, bias), out, n, BLOCK=BLOCK)
