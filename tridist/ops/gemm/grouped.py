"""Grouped GEMM: the expert GEMM of a mixture-of-experts layer, `torch._grouped_mm(x, w, offs=offs)`.

x is T x K with its rows sorted by group, w is E x K x N (a K x N matrix per group, or "expert"),
and offs holds E int32 cumulative row ends on the device: group e is rows [offs[e-1], offs[e]) of x
(with offs[-1] read as 0), and out[those rows] = x[those rows] @ w[e]. Groups may be empty; rows
from offs[E-1] on are not written.

One persistent kernel computes the tiles of every group. A row tile (BLOCK_M rows) never spans
two groups: each group's rows are cut into row tiles of their own, the last one partial, and the
row tiles are numbered group after group. Each program reads offs itself (it never goes through
the host), counts the row tiles of every group, and walks the tiles program_id, program_id +
programs, ... of the whole product, GROUP_M row tiles at a time as the plain GEMM does
(`persistent.tile_coords`). A tile finds its group by comparing its row-tile number with the
cumulative counts (`locate`). There are at most cdiv(T, BLOCK_M) + E row tiles, which sizes the
grid; the loop itself stops at the real count.

x and w are read through TMA descriptors. w's covers E x K x N, so that the last step along K reads
zeros past the end of the expert's matrix, never the next expert's rows. A tile's rows past the
end of its group (the next group's, or past the last group whatever the buffer holds there) are
never stored, and in the emulator they are zeroed before they are multiplied (`group_product`).

fp8 (e4m3), as `torch._scaled_grouped_mm(x, w, scale_a, scale_b, offs=offs)` takes it: x row-major,
w column-major per expert (w = v.transpose(1, 2) for a contiguous E x N x K v; Hopper reads fp8
operands along K only), scale_a float32 [T] (a scale per row of x), scale_b float32 [E, N] (a
scale per column of each expert); out = scale_a[:, None] * scale_b[e] * (x @ w[e]) in bf16. The
kernel reads the scales, so they may change between calls and under CUDA-graph replay.
"""
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

import tridist.language as dl
from tridist.runtime.jit import jit

from ...runtime.tensors import check_tensor
from ...runtime.tune import tune
from .. import _protocol
from .._protocol import check_output, programs_for
from . import persistent, policy

FP8 = persistent.FP8
DTYPES = persistent.DTYPES

# The plain GEMM's configs, and for decode batches (a few rows per expert, where the GEMM streams
# the weights and compute is cheap) 64-row tiles, the smallest Hopper's wgmma takes, with BLOCK_K
# 128 and 4 stages: 128 KB of weights in flight per SM, well past what HBM needs to stay busy.
# 64 x 64 gives twice the column tiles where E x N / 128 would leave SMs idle.
DECODE_CONFIGS = [
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, FLATTEN=True, num_stages=4, num_warps=4),
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, FLATTEN=True, num_stages=6, num_warps=4),
]


def configs(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """The configs `grouped_gemm` takes (`config=`) and tunes over, for operands of `dtype`."""
    return persistent.configs(device, dtype=dtype) + _decode_configs(device, dtype)


def _decode_configs(device: torch.device, dtype: torch.dtype) -> list[dict]:
    if device.type != "cuda":
        return []
    # fp8 takes twice the BLOCK_K, so that a step loads as many bytes (as `persistent.configs`)
    return [{**c, "BLOCK_K": 2 * c["BLOCK_K"]} for c in DECODE_CONFIGS] if dtype == FP8 else list(DECODE_CONFIGS)


def default_config(device: torch.device, rows: int, groups: int, n: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Without tuning, for `rows` rows of x in `groups` groups and n columns: the first decode tile
    when the groups average `policy.GROUPED_DECODE_ROWS` rows or fewer, else the plain GEMM's pick
    for rows x n."""
    if device.type != "cuda":
        return persistent.configs(device, dtype=dtype)[0]
    if rows <= policy.GROUPED_DECODE_ROWS * groups:
        return _decode_configs(device, dtype)[0]
    return persistent.pick_tile(persistent.configs(device, dtype=dtype), rows, n, programs_for(device))


@triton.jit
def pick(values, index):
    """values[index] of a vector held by the program."""
    return tl.sum(tl.where(tl.arange(0, values.shape[0]) == index, values, 0), 0)


@triton.jit
def locate(tm, tiles):
    """Row tile `tm` of groups with `tiles` row tiles each (a vector, padded with zeros) -> (its
    group, that group's first row tile). tm must be below the total."""
    ends = tl.cumsum(tiles, 0)
    group = tl.sum((ends <= tm).to(tl.int32), 0)
    return group, pick(ends - tiles, group)


@triton.jit
def expert_weights(w_desc, group, k, col, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows k..k+BLOCK_K, columns col..col+BLOCK_N of w[group] (K x N). fp8: w_desc covers w's
    transpose per expert (E x N x K)."""
    if w_desc.dtype == tl.float8e4nv:
        return w_desc.load([group, col, k]).reshape(BLOCK_N, BLOCK_K).T
    else:
        return w_desc.load([group, k, col]).reshape(BLOCK_K, BLOCK_N)


def zero_tail(device: torch.device) -> bool:
    """`group_product`'s ZERO_TAIL for kernels on `device`: in the emulator only."""
    return device.type != "cuda"


@triton.jit
def group_product(x_desc, w_desc, row, row_end, group, col, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, ZERO_TAIL: tl.constexpr):
    """x[row:row+BLOCK_M, :] @ w[group][:, col:col+BLOCK_N] in fp32, of which the caller stores the
    rows below `row_end` (the end of the group) only. Rows of a product are independent, so the rows
    from row_end on change none of those. ZERO_TAIL (`zero_tail`: the emulator) zeroes them before
    multiplying: numpy warns of the overflows and NaNs that a buffer's unwritten rows make. GPUs
    multiply them as they are: a select on every element of x would take its tile off the tensor
    cores' shared-memory path (TMA straight into wgmma) in every tile, for rows nobody reads."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, tl.cdiv(K, BLOCK_K)):
        a = x_desc.load([row, k * BLOCK_K])
        if ZERO_TAIL:
            a = tl.where((row + tl.arange(0, BLOCK_M) < row_end)[:, None], a, 0)
        acc = dl.dot(a, expert_weights(w_desc, group, k * BLOCK_K, col, BLOCK_N, BLOCK_K), acc)
    return acc


@triton.jit
def scaled(acc, scale_a_ptr, scale_b_ptr, row, row_end, group, col, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc times the fp8 scales of its rows (scale_a[row:]) and of its group's columns (scale_b[group,
    col:]); acc itself without scales (None)."""
    if scale_a_ptr is not None:
        rows = row + tl.arange(0, BLOCK_M)
        cols = col + tl.arange(0, BLOCK_N)
        scale_rows = tl.load(scale_a_ptr + rows, mask=rows < row_end, other=0.0)
        scale_cols = tl.load(scale_b_ptr + group.to(tl.int64) * N + cols, mask=cols < N, other=0.0)
        return acc * scale_rows[:, None] * scale_cols[None, :]
    else:
        return acc


@jit
def grouped_gemm_kernel(x_desc, w_desc, scale_a_ptr, scale_b_ptr, out_ptr, offs_ptr, T, E, N, K, E_PAD: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                        FLATTEN: tl.constexpr, ZERO_TAIL: tl.constexpr):
    """E_PAD: E rounded up to a power of two (the groups' vectors). Row ends are clamped to T and
    groups to at least no rows, so that offs out of order costs wrong products, never an access
    outside x or out."""
    groups = tl.arange(0, E_PAD)
    ends = tl.minimum(tl.load(offs_ptr + groups, mask=groups < E, other=0), T)
    starts = tl.minimum(tl.load(offs_ptr + groups - 1, mask=(groups > 0) & (groups < E), other=0), T)
    tiles = tl.cdiv(tl.maximum(ends - starts, 0), BLOCK_M)
    tiles_m = tl.sum(tiles, 0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, tl.num_programs(0), flatten=FLATTEN):
        tm, tn = persistent.tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        group, first = locate(tm, tiles)
        row = pick(starts, group) + (tm - first) * BLOCK_M
        row_end = pick(ends, group)
        acc = group_product(x_desc, w_desc, row, row_end, group, tn * BLOCK_N, K, BLOCK_M, BLOCK_N, BLOCK_K, ZERO_TAIL)
        acc = scaled(acc, scale_a_ptr, scale_b_ptr, row, row_end, group, tn * BLOCK_N, N, BLOCK_M, BLOCK_N)
        persistent.store_tile(out_ptr, acc, row, tn * BLOCK_N, row_end, N, BLOCK_M, BLOCK_N)


def weight_descriptor(w: torch.Tensor, config: dict) -> TensorDescriptor:
    """TMA descriptor of the experts' weights w (E x K x N; fp8: of its transpose per expert, E x N x K)."""
    if w.dtype == FP8:
        return TensorDescriptor.from_tensor(w.transpose(1, 2), [1, config["BLOCK_N"], config["BLOCK_K"]])
    return TensorDescriptor.from_tensor(w, [1, config["BLOCK_K"], config["BLOCK_N"]])


def check_weights(w: torch.Tensor, name: str = "w", dtypes=DTYPES) -> None:
    """w: E x K x N of one of `dtypes`, row-major per expert (fp8: column-major per expert), K and N
    aligned for TMA."""
    if not isinstance(w, torch.Tensor) or w.dim() != 3:
        raise ValueError(f"{name} must be a 3-D tensor (experts x K x N), got "
                         f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
    if w.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {w.dtype}; supported: {', '.join(map(str, dtypes))}")
    if w.dtype == FP8:
        if not w.transpose(1, 2).is_contiguous():
            raise ValueError(f"fp8 {name} must be column-major per expert, as torch._scaled_grouped_mm takes it "
                             f"(wgmma reads fp8 operands along K): pass v.transpose(1, 2) of a contiguous experts x N "
                             f"x K tensor v")
        check_tensor(w.transpose(1, 2), name)
    else:
        check_tensor(w, name)
    if w.numel() == 0:
        raise ValueError(f"{name} is empty: {tuple(w.shape)}")
    persistent.check_sizes("grouped_gemm", w.dtype, w.shape[1], w.shape[2])
    if w.data_ptr() % 16:
        raise ValueError(f"{name} does not start on a 16-byte boundary, as TMA needs: pass {name}.clone()")


def check_call(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, out, scale_a, scale_b) -> torch.Tensor:
    """Checks grouped_gemm's arguments; returns `out`, a new tensor if None."""
    check_weights(w)
    check_tensor(x, "x")
    if x.dim() != 2 or x.dtype != w.dtype:
        raise ValueError(f"x must be a matrix of w's dtype {w.dtype}; got {x.dtype} of shape {tuple(x.shape)}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"x has {x.shape[1]} columns but w's experts have {w.shape[1]} rows (w is experts x K x N)")
    if x.data_ptr() % 16:
        raise ValueError("x does not start on a 16-byte boundary, as TMA needs: pass x.clone()")
    check_tensor(offs, "offs")
    if offs.dtype != torch.int32 or offs.dim() != 1 or offs.shape[0] != w.shape[0]:
        raise ValueError(f"offs must be int32 of shape ({w.shape[0]},) (the cumulative row ends of w's {w.shape[0]} "
                         f"experts); got {offs.dtype} of shape {tuple(offs.shape)}")
    if w.dtype == FP8:
        _check_scale(scale_a, "scale_a", (x.shape[0],), "a scale per row of x", x.device)
        _check_scale(scale_b, "scale_b", (w.shape[0], w.shape[2]), "a scale per column of each expert", x.device)
    elif scale_a is not None or scale_b is not None:
        raise ValueError(f"scale_a and scale_b go with fp8 operands only; these are {w.dtype}")
    shape, dtype = (x.shape[0], w.shape[2]), persistent.out_dtype(w.dtype)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=x.device)
    check_output(out, shape, dtype)
    if _protocol.host_reads(offs):
        check_offs(offs, x.shape[0])
    return out


def check_offs(offs: torch.Tensor, rows: int) -> None:
    """offs is non-decreasing and at most `rows` (reads it back: a host synchronisation)."""
    ends = offs.cpu()
    if (ends[1:] < ends[:-1]).any() or (ends < 0).any() or (ends > rows).any():
        raise ValueError(f"offs must be non-decreasing row ends between 0 and {rows}; got {ends.tolist()}")


def _check_scale(scale, name: str, shape: tuple, meaning: str, device: torch.device) -> None:
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or tuple(scale.shape) != shape \
            or scale.device != device or not scale.is_contiguous():
        got = f"{scale.dtype} of shape {tuple(scale.shape)} on {scale.device}" if isinstance(scale, torch.Tensor) \
            else repr(scale)
        raise ValueError(f"fp8 operands need {name}: contiguous float32 of shape {shape} on {device} ({meaning}, as "
                         f"torch._scaled_grouped_mm takes it); got {got}")


_tuned: dict = {}


def resolve_config(config, x: torch.Tensor, w: torch.Tensor, run) -> dict:
    """`config` as given, the default if None, or with "tune" the fastest of `configs` under
    `run(config)` (`tridist.tune`, a collective; the choice is kept for the process and on disk)."""
    if config is None:
        return default_config(x.device, x.shape[0], w.shape[0], w.shape[2], w.dtype)
    if config != "tune":
        if not isinstance(config, dict):
            raise ValueError(f"config must be a dict (one of grouped.configs(device, dtype)), None or 'tune'; "
                             f"got {config!r}")
        return config
    key = (x.shape[0], *w.shape, str(w.dtype))
    if key not in _tuned:
        _tuned[key] = tune("grouped_gemm", key, configs(x.device, w.dtype), lambda c: lambda: run(c))
    return _tuned[key]


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, out: torch.Tensor | None = None,
                 config: dict | str | None = None, scale_a: torch.Tensor | None = None,
                 scale_b: torch.Tensor | None = None) -> torch.Tensor:
    """out[offs[e-1]:offs[e]] = x[offs[e-1]:offs[e]] @ w[e] for every expert e, in one persistent
    kernel, with no host synchronisation (offs stays on the device). The meaning of
    `torch._grouped_mm(x, w, offs=offs)`.

    Args:
        x: T x K, rows sorted by expert; bf16, fp16 or fp8 (e4m3); contiguous.
        w: E x K x N of x's dtype, row-major per expert; fp8 column-major per expert
            (`v.transpose(1, 2)` of a contiguous E x N x K `v`), as `torch._scaled_grouped_mm` takes it.
        offs: int32 [E] on the device, the cumulative row ends (non-decreasing, at most T; checked only
            with TRIDIST_DEBUG=1, which reads it back). Empty groups are allowed.
        out: T x N in x's dtype (bf16 for fp8); rows from offs[E-1] on are left as they are. New if None.
        config: a dict of `configs(device, dtype)`, None for `default_config`, or "tune" (every rank
            calls it together: `tridist.tune`).
        scale_a: fp8 only: float32 [T], a scale per row of x.
        scale_b: fp8 only: float32 [E, N], a scale per column of each expert; out =
            scale_a[:, None] * scale_b[e] * (x @ w[e]) in bf16.

    K and N must be multiples of 8 (K of 16 for fp8): TMA reads 16-byte aligned rows.
    Raises ValueError, before launching anything, for shapes, dtypes, layouts or scales it does not take.
    """
    out = check_call(x, w, offs, out, scale_a, scale_b)
    if x.shape[0] == 0:
        return out
    config = resolve_config(config, x, w, lambda c: grouped_gemm(x, w, offs, out, c, scale_a, scale_b))
    experts, k, n = w.shape
    bound = (triton.cdiv(x.shape[0], config["BLOCK_M"]) + experts) * triton.cdiv(n, config["BLOCK_N"])
    x_desc = TensorDescriptor.from_tensor(x, [config["BLOCK_M"], config["BLOCK_K"]])
    grouped_gemm_kernel[(min(bound, programs_for(x.device)),)](
        x_desc=x_desc, w_desc=weight_descriptor(w, config), scale_a_ptr=scale_a, scale_b_ptr=scale_b, out_ptr=out,
        offs_ptr=offs, T=x.shape[0], E=experts, N=n, K=k, E_PAD=triton.next_power_of_2(experts),
        ZERO_TAIL=zero_tail(x.device), **config)
    return out
