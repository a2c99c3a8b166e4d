"""The GEMM the overlapped kernels are built on, and `matmul`: that GEMM alone.

A persistent kernel: one program per SM walks the output tiles `program_id, program_id + programs,
...`. A and B are read through TMA tensor descriptors (the copy happens in hardware, so the warps
only issue matrix instructions), accumulate in fp32, and each tile is stored with a mask so that a
caller can end tiles at any row (the overlapped kernels stop tiles at shard boundaries).

out (M x N) = a (M x K) @ b (K x N); a row-major, bf16, fp16 or fp8 (e4m3). TMA needs every row to
start on a 16-byte boundary: K and N must be multiples of 8 (K of 16 for fp8).
- bf16, fp16: b row-major, out in the operands' dtype.
- fp8 with per-tensor scales: out = scale_a * scale_b * (a @ b) in bf16, the scales fp32 one-element
  tensors on the device (read by the kernel, so they may change between calls and inside a CUDA
  graph). b is column-major (b = w.t() for a contiguous N x K weight w, as torch._scaled_mm takes
  it): Hopper's wgmma reads fp8 operands only along K, and a row-major fp8 b would be transposed
  byte by byte in shared memory.
"""
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

import tridist.language as dl
from tridist.runtime.jit import jit

from ...runtime.tune import tune
from .. import checks
from ..checks import check_input, check_output, shape_of
from ..instances import instance
from ..ranks import ranks_of
from ..sizing import programs_for
from . import policy

FP8 = torch.float8_e4m3fn
"""The fp8 dtype the GEMMs take (e4m3), with per-tensor scales."""
DTYPES = (torch.bfloat16, torch.float16, FP8)

# In order of preference: the big tile first, which runs closest to cuBLAS (how close, and why 3
# stages: benchmarks/NOTES.md, "Moved from the code's docstrings (issue 41)",
# "tridist/ops/gemm/persistent.py"). FLATTEN lets Triton pipeline the loads of a program's next tile
# behind the end of the current one. Small-M configs give decode batches enough tiles for every SM.
# fp8 configs take twice the BLOCK_K, so that a step loads as many bytes (`configs`).
# The emulator gets small tiles, so that its shapes can stay small.
GPU_CONFIGS = [
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, FLATTEN=True, num_stages=3, num_warps=8),
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, FLATTEN=False, num_stages=3, num_warps=8),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, FLATTEN=True, num_stages=4, num_warps=8),
    dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, FLATTEN=False, num_stages=4, num_warps=4),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, FLATTEN=False, num_stages=4, num_warps=4),
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, FLATTEN=False, num_stages=4, num_warps=4),
]
EMULATOR_CONFIGS = [dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, FLATTEN=False, num_stages=1, num_warps=4),
                    dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=16, GROUP_M=1, FLATTEN=True, num_stages=1, num_warps=4)]


def configs(device: torch.device, flatten: bool = True, dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """The GEMM configs for operands of `dtype` on `device`: what `config="tune"` times, and what
    `config=` takes. Each is a dict of the kernel's block sizes (`BLOCK_M`, `BLOCK_N`,
    `BLOCK_K`, `GROUP_M`), `FLATTEN` (pipeline the next tile's loads behind the current one) and
    Triton's `num_stages` and `num_warps`; fp8 configs take twice the `BLOCK_K`. `flatten=False`
    leaves out those with `FLATTEN`, for kernels Triton cannot flatten. The emulator gets small
    tiles, so that its shapes can stay small."""
    candidates = GPU_CONFIGS if device.type == "cuda" else EMULATOR_CONFIGS
    if dtype == FP8 and device.type == "cuda":
        candidates = [{**c, "BLOCK_K": 2 * c["BLOCK_K"]} for c in candidates]
    return [c for c in candidates if flatten or not c["FLATTEN"]]


def out_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a product of `dtype` operands."""
    return torch.bfloat16 if dtype == FP8 else dtype


# Throughput of a full wave of each tile shape, relative to 128 x 256, as the GEMM benchmark measured
# it on 2 x H200 (benchmarks/NOTES.md, "Moved from the code's docstrings (issue 41)",
# "tridist/ops/gemm/persistent.py").
TILE_RATES = {(128, 256): 1.0, (128, 128): 0.85, (128, 64): 0.63, (64, 128): 0.79, (64, 64): 0.47}


def pick_tile(candidates: list[dict], m: int, n: int, sms: int, shards: int = 1) -> dict:
    """Of `candidates` (in order of preference), the one whose output tiles of an m x n product
    finish first (the first of equals): waves of `sms` tiles at a time, each wave as long as a tile
    takes at its shape's `TILE_RATES`. A small product with the big tile leaves SMs idle, where
    smaller tiles fill them.
    With `shards` > 1 the m rows come as equal shards, one at hand and the others arriving while
    its tiles are computed (ag_gemm): a wave that mixes the two waits for the transfer, so they are
    counted in waves of their own. The timings behind both: benchmarks/NOTES.md, "Moved from the
    code's docstrings (issue 41)", "tridist/ops/gemm/persistent.py"."""
    def finish(c):
        own = triton.cdiv(m // shards, c["BLOCK_M"]) * triton.cdiv(n, c["BLOCK_N"])
        waves = triton.cdiv(own, sms) + triton.cdiv((shards - 1) * own, sms)
        return waves * c["BLOCK_M"] * c["BLOCK_N"] / TILE_RATES[(c["BLOCK_M"], c["BLOCK_N"])]
    return min(candidates, key=finish)  # the first of equals


def default_config(device: torch.device, m: int, n: int, flatten: bool = True, shards: int = 1,
                   dtype: torch.dtype = torch.bfloat16) -> dict:
    """The config the GEMM ops use without `config=`, for an m x n product of `dtype` operands
    (`flatten`: as `configs`): in the emulator the first of `configs`; for a decode batch the tile
    of `policy.DECODE_TILES` for m rows, where the GEMM streams B and one row of tiles reads it
    once; otherwise `pick_tile`'s (`shards`: see there)."""
    candidates = configs(device, flatten, dtype)
    if device.type != "cuda":
        return candidates[0]
    for most_rows, tile in policy.DECODE_TILES:
        if m <= most_rows:
            return next(c for c in candidates if (c["BLOCK_M"], c["BLOCK_N"]) == tile)
    return pick_tile(candidates, m, n, programs_for(device), shards)


def refuse_flatten(config, what: str) -> None:
    """For ops whose kernel Triton cannot flatten (`what`: the op, and where that holds): a config
    dict with FLATTEN is refused."""
    if isinstance(config, dict) and config.get("FLATTEN"):
        raise ValueError(f"{what} takes configs with FLATTEN=False (Triton cannot flatten its loop nest); got {config}")


def resolve_config(config, name: str, key, make_op, make_inputs, device: torch.device, m: int, n: int,
                   flatten: bool = True, shards: int = 1, dtype: torch.dtype = torch.bfloat16,
                   candidates: list[dict] | None = None, default: dict | None = None, group=None) -> dict:
    """`config` as given; the default for an m x n product (in `shards` row shards) if None; with
    "tune", the config of `configs` under which `make_op(config)(*make_inputs())` is fastest on the
    slowest rank (`tridist.tune`, cached on disk). A collective when tuning, of `group`'s members
    (the op's: a `tridist.Group`, or None for the world). `candidates` and `default` replace
    `configs` and `default_config` (for the grouped GEMMs)."""
    if config is None:
        return default if default is not None else default_config(device, m, n, flatten, shards, dtype)
    if config != "tune":
        return config
    built = []

    def release():
        for op in built:
            op.free()
        built.clear()

    def make_run(candidate):
        release()
        built.append(make_op(candidate))
        inputs = make_inputs()
        return lambda: built[-1](*inputs)

    try:
        return tune(name, key, candidates if candidates is not None else configs(device, flatten, dtype), make_run,
                    group=group)
    finally:
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # nothing may still use the buffers that are given back
        release()


@triton.jit
def tile_coords(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Tile number -> (row tile, column tile), GROUP_M row tiles at a time so that the programs
    running together share A rows and B columns in L2."""
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_m, (tile % per_group) // group_m


@triton.jit
def load_scale(scale_a_ptr, scale_b_ptr):
    """What a tile's product is multiplied by: scale_a * scale_b for fp8 operands, 1 without scales
    (None). Kernels read it before their tile loop and multiply where they use a tile: a value
    computed after the K loop and used in more than one branch stops Triton 3.6 from flattening
    gemm_rs's loop nest (TritonGPUFuseNestedLoops fails)."""
    if scale_a_ptr is not None:
        return tl.load(scale_a_ptr) * tl.load(scale_b_ptr)
    else:
        return 1.0


@triton.jit
def tile_product(a_desc, b_desc, row, col, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """a[row:row+BLOCK_M, :] @ b[:, col:col+BLOCK_N] in fp32 (TMA fills rows and columns past the end
    with zeros). fp8: b_desc covers b's transpose (N x K)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, tl.cdiv(K, BLOCK_K)):
        if b_desc.dtype == tl.float8e4nv:
            b = b_desc.load([col, k * BLOCK_K]).T
        else:
            b = b_desc.load([k * BLOCK_K, col])
        acc = dl.dot(a_desc.load([row, k * BLOCK_K]), b, acc)
    return acc


@triton.jit
def store_tile(out_ptr, values, row, col, row_end, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[row:min(row+BLOCK_M, row_end), col:col+BLOCK_N] = values (out is row-major with N columns)."""
    rows = row + tl.arange(0, BLOCK_M)
    cols = col + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < row_end) & (cols[None, :] < N)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], values.to(out_ptr.dtype.element_ty), mask=mask)


@jit
def matmul_kernel(a_desc, b_desc, scale_a_ptr, scale_b_ptr, out_ptr, M, N, K, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, FLATTEN: tl.constexpr):
    scale = load_scale(scale_a_ptr, scale_b_ptr)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, tl.num_programs(0), flatten=FLATTEN):
        tm, tn = tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        acc = tile_product(a_desc, b_desc, tm * BLOCK_M, tn * BLOCK_N, K, BLOCK_M, BLOCK_N, BLOCK_K)
        store_tile(out_ptr, acc * scale, tm * BLOCK_M, tn * BLOCK_N, M, N, BLOCK_M, BLOCK_N)


def check_sizes(op: str, dtype: torch.dtype, k: int, n: int) -> None:
    """What an op built for (.., k) x (k, n) operands of `dtype` needs before it allocates anything."""
    if dtype not in DTYPES:
        raise ValueError(f"{op} takes {', '.join(map(str, DTYPES))}; got {dtype}")
    _check_aligned(dtype, k, n)


def _check_aligned(dtype: torch.dtype, k: int, n: int) -> None:
    for name, size, multiple in (("K", k, 16 // dtype.itemsize), ("N", n, 8)):
        if size % multiple:
            raise ValueError(f"{name} = {size} is not a multiple of {multiple}: TMA needs 16-byte aligned rows; "
                             f"pad {name}")


def check_operands(a: torch.Tensor, b: torch.Tensor, a_name: str = "a", b_name: str = "b") -> None:
    """a (rows x K, row-major) and b (K x N: row-major, column-major for fp8), both 2-D, of one
    dtype, with K and N multiples of 8 (K of 16 for fp8)."""
    if isinstance(b, torch.Tensor) and b.dtype == FP8 and b.dim() == 2:
        if not b.t().is_contiguous():
            raise ValueError(f"fp8 {b_name} must be column-major (wgmma reads fp8 operands along K): pass w.t() for "
                             f"a contiguous N x K weight w, or {b_name}.t().contiguous().t()")
        check_input(b.t(), b_name, DTYPES)
    else:
        check_input(b, b_name, DTYPES)
    check_input(a, a_name, DTYPES)
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"{a_name} and {b_name} must be matrices; got {a_name} of shape {tuple(a.shape)} and "
                         f"{b_name} of shape {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"{a_name} is {a.dtype} but {b_name} is {b.dtype}; use one dtype")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"{a_name} has {a.shape[1]} columns but {b_name} has {b.shape[0]} rows")
    _check_aligned(a.dtype, a.shape[1], b.shape[1])
    for name, tensor in ((a_name, a), (b_name, b)):
        if tensor.data_ptr() % 16:
            raise ValueError(f"{name} does not start on a 16-byte boundary, as TMA needs (a view at an odd offset?): "
                             f"pass a tensor of its own, e.g. {name}.clone()")


def check_scales(dtype: torch.dtype, scale_a, scale_b, device: torch.device) -> None:
    """fp8 operands come with both scales, one-element fp32 tensors on `device`; others with none."""
    if dtype != FP8:
        if scale_a is not None or scale_b is not None:
            raise ValueError(f"scale_a and scale_b go with fp8 operands only; these are {dtype}")
        return
    for name, scale in (("scale_a", scale_a), ("scale_b", scale_b)):
        if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or scale.numel() != 1 \
                or scale.device != device:
            raise ValueError(f"fp8 operands need {name}: a one-element float32 tensor on {device} "
                             f"(out = scale_a * scale_b * (a @ b)); got {_describe(scale)}")


def check_call(a: torch.Tensor, b: torch.Tensor, scale_a, scale_b, out: torch.Tensor | None, out_rows: int,
               a_name: str = "a", built: tuple | None = None, group=None) -> torch.Tensor:
    """Checks the operands, scales and `out` (out_rows x N, of `out_dtype`) of a GEMM call; returns
    `out`, a new tensor if None. `built`: (op name, a's shape, b's shape, dtype) of the collective op
    instance called, which takes nothing else; its ranks (`group`'s members, None: the world's)
    then check together (`checks.agree`)."""
    def check() -> None:
        check_operands(a, b, a_name)
        if built is not None:
            op, a_shape, b_shape, dtype = built
            if (tuple(a.shape), tuple(b.shape), a.dtype) != (a_shape, b_shape, dtype):
                raise ValueError(f"this {op} takes {a_name} {dtype} {a_shape} and b {b_shape}; got {a.dtype} "
                                 f"{tuple(a.shape)} and {tuple(b.shape)}: build another instance, or call "
                                 f"`tridist.ops.{op}`, which keeps one per shape")
        check_scales(a.dtype, scale_a, scale_b, a.device)
        if out is not None:
            check_output(out, (out_rows, b.shape[1]), out_dtype(a.dtype))

    if built is None:
        check()
    else:
        checks.agree(built[0], check, {f"shape and dtype of {a_name}": shape_of(a), "shape of b": shape_of(b)},
                     group=group)
    return torch.empty((out_rows, b.shape[1]), dtype=out_dtype(a.dtype), device=a.device) if out is None else out


def cached(cls, a: torch.Tensor, b: torch.Tensor, config, a_name: str = "a", group=None, **options):
    """The instance of `cls` (an overlapped GEMM op, a collective) for these operands' shapes and
    dtype, `config`, `options` and `group` (the op's `group=`), on the current stream
    (`instances.instance`), once every rank's operands are checked and alike (`checks.agree`,
    among the group's members: a rank outside the group gets its ValueError there)."""
    checks.agree(cls.__name__, lambda: check_operands(a, b, a_name),
                 {f"shape and dtype of {a_name}": shape_of(a), "shape of b": shape_of(b), "config": repr(config),
                  **{name: repr(value) for name, value in options.items()}}, group=group)
    return instance(lambda: cls(a.shape[0], a.shape[1], b.shape[1], a.dtype, config=config, group=group, **options),
                    cls, tuple(a.shape), b.shape[1], a.dtype, repr(config), *options.values(), ranks_of(group).key,
                    device=a.device)


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of {value.numel()} elements on {value.device}"
    return repr(value)


def random_operands(m: int, k: int, n: int, dtype: torch.dtype, device: torch.device) -> tuple:
    """What an op for an m x k by k x n product of `dtype` takes, random, for tuning: (a, b), and
    for fp8 (a, b, None, scale_a, scale_b) with b column-major."""
    a = torch.randn(m, k, device=device).to(dtype)
    if dtype != FP8:
        return a, torch.randn(k, n, device=device).to(dtype)
    one = torch.ones(1, device=device)
    return a, torch.randn(n, k, device=device).to(dtype).t(), None, one, one


def descriptors(a: torch.Tensor, b: torch.Tensor, config: dict) -> tuple[TensorDescriptor, TensorDescriptor]:
    """TMA descriptors of a and b (of b's transpose for fp8, see the module docstring)."""
    if b.dtype == FP8:
        b_desc = TensorDescriptor.from_tensor(b.t(), [config["BLOCK_N"], config["BLOCK_K"]])
    else:
        b_desc = TensorDescriptor.from_tensor(b, [config["BLOCK_K"], config["BLOCK_N"]])
    return TensorDescriptor.from_tensor(a, [config["BLOCK_M"], config["BLOCK_K"]]), b_desc


def matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, config: dict | None = None,
           scale_a: torch.Tensor | None = None, scale_b: torch.Tensor | None = None) -> torch.Tensor:
    """`a @ b` with the persistent TMA GEMM of the overlapped ops, on one rank (no communication).

    Args:
        a: M x K, row-major, bf16, fp16 or fp8.
        b: K x N of a's dtype, row-major (column-major for fp8); K and N multiples of 8 (K of 16
            for fp8).
        out: M x N of `out_dtype(a.dtype)`; a new tensor if None.
        config: one of [`configs`][tridist.ops.gemm.configs] (a dict), or None for the default.
        scale_a: fp8 only: a one-element float32 tensor on the device.
        scale_b: fp8 only: the same.

    Returns:
        `out`.

    Raises:
        ValueError: operands, scales, `out` or `config` it does not take (the message says what
            to change).
    """
    out = check_call(a, b, scale_a, scale_b, out, a.shape[0])
    shape = tuple(out.shape)
    if config is not None and not isinstance(config, dict):
        raise ValueError(f"matmul takes a config dict (one of gemm.configs(device, dtype=...)) or None, got {config!r}")
    config = config or default_config(a.device, a.shape[0], b.shape[1], dtype=a.dtype)
    tiles = triton.cdiv(shape[0], config["BLOCK_M"]) * triton.cdiv(shape[1], config["BLOCK_N"])
    a_desc, b_desc = descriptors(a, b, config)
    matmul_kernel[(min(tiles, programs_for(a.device)),)](a_desc=a_desc, b_desc=b_desc, scale_a_ptr=scale_a,
                                                         scale_b_ptr=scale_b, out_ptr=out, M=shape[0], N=shape[1],
                                                         K=a.shape[1], **config)
    return out
