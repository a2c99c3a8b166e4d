"""The split-K GEMM of `tridist.ops.linear` for decode-sized M: y = x @ w.T (+ bias), and the
swiglu epilogue, in one launch that streams the weight over every SM.

The unfused reference: `F.linear(x, w, bias)`; with swiglu, `silu(F.linear(x, w_gate, b_gate)) *
F.linear(x, w_up, b_up)` (transformers' LlamaMLP), w being `torch.cat([w_gate, w_up])`.

With a few rows of x the product is a read of the weight (N x K elements, a few GB/s of arithmetic
each), so what counts is that every SM streams a share of it. The output columns are cut into
tiles of BLOCK_N, and K into `splits` ranges of `k_per_split` (a multiple of BLOCK_K); program
(tile, split) reads the weight's [BLOCK_N, k_per_split] slab once, in BLOCK_K steps with
num_stages of them in flight (through a TMA descriptor, or 16-byte pointer loads), for all M rows
at once, and accumulates in fp32:
- `DOT`: the weight's tile times x's transposed (BLOCK_M rows, M padded with zero rows to a power
  of two of at least 16) on the tensor cores, the weight on the left so that its BLOCK_N rows are
  the MMA's long side (a [BLOCK_N, BLOCK_M] accumulator);
- FMA (M = 1): the tile times x's row element by element into a [BLOCK_N, BLOCK_K] accumulator,
  summed along K once at the end.
The swiglu variant reads the gate's tile (rows col..) and the up's (rows N + col..) in the same
step, into two accumulators, so the weight needs no layout beyond the concatenation.

Protocol (splits > 1). The instance owns `partials` (fp32, a [BLOCK_N, BLOCK_M] tile per program,
two with swiglu) and `counters` (int32, one per output tile, zero between calls). A program stores
its partial tile, fences, and adds 1 to its tile's counter (acq_rel, after a barrier of the
program, so every thread's stores come before the add). The program that finds `splits - 1` there
is the tile's last: it reads the splits' partials in split order (its own too, from memory, so
that the sum's order does not depend on which program came last: the same bits every run), applies
the epilogue and stores the output, and sets the counter back to zero for the next call (the next
launch on the stream, or the next replay of a CUDA graph, starts after this one has ended). With
one split a program applies the epilogue to its own accumulator, and the kernel has no partials.

Epilogue: bias added in fp32, the result rounded once to the dtype. swiglu rounds as LlamaMLP
does: gate (+ bias) and up (+ bias) each rounded to the dtype, silu of the rounded gate computed in
fp32 (x / (1 + exp(-x)), an IEEE division) and rounded, the product of the two rounded values
computed in fp32 and rounded.
"""
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

import tridist.language as dl
from tridist.runtime.jit import jit

from ...protocol import sync_program


@triton.jit
def weight_tile(w_ptr, w_desc, row, k, ROWS, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """w[row:row+BLOCK_N, k:k+BLOCK_K] (w is ROWS x K), zeros past its end: through `w_desc` where
    it is a TMA descriptor, else through masked pointer loads."""
    if w_desc is not None:
        return w_desc.load([row, k])
    else:
        rows = row + tl.arange(0, BLOCK_N)
        cols = k + tl.arange(0, BLOCK_K)
        mask = (rows < ROWS)[:, None] & (cols < K)[None, :]
        return tl.load(w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], mask=mask, other=0.0)


@triton.jit
def slab_product(x_ptr, w_ptr, w_desc, col, up_row, M, ROWS, K, stride_xm, k_start, k_end, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWIGLU: tl.constexpr, DOT: tl.constexpr):
    """(x[:, k_start:k_end] @ w[col:col+BLOCK_N, k_start:k_end].T).T in fp32, [BLOCK_N, BLOCK_M], and
    with SWIGLU the same for w's rows from up_row + col (else zeros). k_start is a multiple of
    BLOCK_K; rows of x from M on and columns from K on count as zeros."""
    rows = tl.arange(0, BLOCK_M)
    if DOT:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:  # BLOCK_M is 1: products element by element, summed along K after the loop
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in tl.range(k_start, k_end, BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=(rows < M)[:, None] & (cols < K)[None, :],
                    other=0.0)
        w = weight_tile(w_ptr, w_desc, col, k, ROWS, K, BLOCK_N, BLOCK_K)
        if DOT:
            acc = dl.dot(w, tl.trans(x), acc)
        else:
            acc += w.to(tl.float32) * x.to(tl.float32)
        if SWIGLU:
            w_up = weight_tile(w_ptr, w_desc, up_row + col, k, ROWS, K, BLOCK_N, BLOCK_K)
            if DOT:
                acc_up = dl.dot(w_up, tl.trans(x), acc_up)
            else:
                acc_up += w_up.to(tl.float32) * x.to(tl.float32)
    if DOT:
        return acc, acc_up
    else:
        return tl.sum(acc, 1)[:, None], tl.sum(acc_up, 1)[:, None]


@triton.jit
def swiglu(gate, up):
    """silu(gate) * up in fp32 for gate and up of the output's dtype, rounded as LlamaMLP rounds
    (module docstring): silu's result rounded to that dtype before the product."""
    dtype = gate.dtype
    gate = gate.to(tl.float32)
    act = tl.div_rn(gate, 1.0 + tl.exp(-gate)).to(dtype).to(tl.float32)
    return act * up.to(tl.float32)


@triton.jit
def epilogue_store(acc, acc_up, bias_ptr, out_ptr, col, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   SWIGLU: tl.constexpr):
    """out[:M, col:col+BLOCK_N] = the epilogue (module docstring) of the [BLOCK_N, BLOCK_M] sums
    `acc` (and `acc_up`, the up's, with SWIGLU); out is M x N, the bias [N] ([2N] with SWIGLU)."""
    cols = col + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    dtype = out_ptr.dtype.element_ty
    if bias_ptr is not None:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[:, None]
        if SWIGLU:
            acc_up += tl.load(bias_ptr + N + cols, mask=cols < N, other=0.0).to(tl.float32)[:, None]
    if SWIGLU:
        y = swiglu(acc.to(dtype), acc_up.to(dtype))
    else:
        y = acc
    tl.store(out_ptr + rows[None, :] * N + cols[:, None], y.to(dtype), mask=(cols < N)[:, None] & (rows < M)[None, :])


@jit(do_not_specialize=["M"])
def linear_split_k_kernel(x_ptr, w_ptr, w_desc, bias_ptr, out_ptr, partials_ptr, counters_ptr, M, N, ROWS, K,
                          stride_xm, k_per_split, splits, SWIGLU: tl.constexpr, DOT: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program p: output tile p // splits, split p % splits (see the module docstring). N: the
    output's columns; ROWS: the weight's (2N with SWIGLU)."""
    tile = tl.program_id(0) // splits
    split = tl.program_id(0) % splits
    col = tile * BLOCK_N
    k_start = split * k_per_split
    acc, acc_up = slab_product(x_ptr, w_ptr, w_desc, col, N, M, ROWS, K, stride_xm, k_start,
                               tl.minimum(k_start + k_per_split, K), BLOCK_M, BLOCK_N, BLOCK_K, SWIGLU, DOT)
    last = splits == 1
    if splits > 1:
        parts: tl.constexpr = 2 if SWIGLU else 1
        tile_size: tl.constexpr = BLOCK_N * BLOCK_M
        offsets = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        partials = partials_ptr + tile.to(tl.int64) * (splits * parts * tile_size)
        tl.store(partials + split * (parts * tile_size) + offsets, acc, cache_modifier=".cg")
        if SWIGLU:
            tl.store(partials + (split * parts + 1) * tile_size + offsets, acc_up, cache_modifier=".cg")
        dl.fence("gpu")
        sync_program()  # every thread's partial is stored before the count below says so
        last = dl.atomic_add(counters_ptr + tile, 1, scope="gpu", semantic="acq_rel") == splits - 1
        if last:
            dl.fence("gpu")
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(0, splits):  # in split order, whichever program came last
                acc += tl.load(partials + s * (parts * tile_size) + offsets, cache_modifier=".cg")
                if SWIGLU:
                    acc_up += tl.load(partials + (s * parts + 1) * tile_size + offsets, cache_modifier=".cg")
            tl.store(counters_ptr + tile, 0)  # zero for the next call
    if last:
        epilogue_store(acc, acc_up, bias_ptr, out_ptr, col, M, N, BLOCK_M, BLOCK_N, SWIGLU)


def block_m(m: int, dot: bool) -> int:
    """The kernel's BLOCK_M for m rows: 1 for FMA (m must be 1), else m's power of two, at least 16
    (what `tl.dot` takes)."""
    return max(16, triton.next_power_of_2(m)) if dot else 1


def split_plan(k: int, block_k: int, splits: int) -> tuple[int, int]:
    """(splits, k_per_split): K cut into at most `splits` ranges of whole BLOCK_K steps, as even as
    whole steps allow, none empty."""
    steps = triton.cdiv(k, block_k)
    per_split = triton.cdiv(steps, max(1, min(splits, steps)))
    return triton.cdiv(steps, per_split), per_split * block_k


class SplitK:
    """The kernel built for an m x k by (rows x k).T product of `dtype` (`swiglu`: rows = 2N, the
    output N columns) under `config` (BLOCK_N, BLOCK_K, DOT, TMA, splits, num_warps, num_stages:
    `tridist.ops.gemm.linear_gemm.policy`), with its workspace when it splits K: `launch(x, weight,
    bias, out)` writes out (m x N) on the current stream, with no host synchronisation and no
    allocation. One instance serves one stream at a time (its counters are per call)."""

    def __init__(self, m: int, rows: int, k: int, dtype: torch.dtype, swiglu: bool, config: dict,
                 device: torch.device):
        self.m, self.rows, self.k, self.swiglu, self.config = m, rows, k, swiglu, dict(config)
        self.n = rows // 2 if swiglu else rows
        self.block_m = block_m(m, config["DOT"])
        self.tiles = triton.cdiv(self.n, config["BLOCK_N"])
        self.splits, self.k_per_split = split_plan(k, config["BLOCK_K"], config["splits"])
        self.partials = self.counters = None
        if self.splits > 1:
            parts = 2 if swiglu else 1
            self.partials = torch.empty(self.tiles * self.splits * parts * config["BLOCK_N"] * self.block_m,
                                        dtype=torch.float32, device=device)
            self.counters = torch.zeros(self.tiles, dtype=torch.int32, device=device)

    @property
    def programs(self) -> int:
        return self.tiles * self.splits

    def launch(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
        """x: m x k with unit column stride; weight: rows x k, contiguous, 16-byte aligned; bias: [rows]
        or None; out: m x N contiguous."""
        c = self.config
        w_desc = TensorDescriptor.from_tensor(weight, [c["BLOCK_N"], c["BLOCK_K"]]) if c["TMA"] else None
        linear_split_k_kernel[(self.programs,)](
            x_ptr=x, w_ptr=weight, w_desc=w_desc, bias_ptr=bias, out_ptr=out, partials_ptr=self.partials,
            counters_ptr=self.counters, M=self.m, N=self.n, ROWS=self.rows, K=self.k, stride_xm=x.stride(0),
            k_per_split=self.k_per_split, splits=self.splits, SWIGLU=self.swiglu, DOT=c["DOT"], BLOCK_M=self.block_m,
            BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], num_warps=c["num_warps"], num_stages=c["num_stages"])
