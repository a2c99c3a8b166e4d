"""`linear(x, weight, bias=None, *, activation=None)`: `torch.nn.functional.linear` on one GPU, and
its swiglu variant, with a split-K kernel for decode-sized M (`split_k`) that reads the weight
over every SM; the choices in `policy`.

The front checks, then chooses: products of 1 to `policy.MAX_ROWS` rows of x take the split-K
kernel (an instance per shape, dtype and stream, `Linear`, holding its workspace); larger ones
cuBLAS, with swiglu's epilogue in one pass after it (`cublas`). Local: no ranks, no `group=`.
"""
import torch
import torch.nn.functional as F

import tridist

from ...checks import check_input
from ...instances import instance
from ...sizing import programs_for
from . import cublas, policy
from .split_k import SplitK

DTYPES = (torch.bfloat16, torch.float16)
ACTIVATIONS = (None, "swiglu")
CONFIG_KEYS = {"DOT", "TMA", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "splits"}


def check_call(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation) -> None:
    """What `linear` takes (see there); raises ValueError (TypeError for a non-tensor) saying what
    to change."""
    check_input(weight, "weight", DTYPES)
    if weight.dim() != 2 or weight.numel() == 0:
        raise ValueError(f"weight must be a non-empty matrix [N, K] (torch.nn.Linear's layout); got shape "
                         f"{tuple(weight.shape)}")
    rows, k = weight.shape
    if k % 8:
        raise ValueError(f"weight has K = {k} columns, not a multiple of 8: the kernel reads 16-byte aligned rows; "
                         f"pad K")
    if weight.data_ptr() % 16:
        raise ValueError("weight does not start on a 16-byte boundary (a view at an odd offset?): pass weight.clone()")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x is {x.dtype} but weight is {weight.dtype}; use one dtype")
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device} but weight on {weight.device}")
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"x must be [..., K] with K = {k} (weight's columns); got shape {tuple(x.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}; got {activation!r}")
    if activation == "swiglu" and rows % 2:
        raise ValueError(f"swiglu takes weight [2I, K], the gate's rows then the up's; got {rows} rows, an odd number")
    if bias is not None:
        check_input(bias, "bias", DTYPES)
        if bias.dtype != weight.dtype or tuple(bias.shape) != (rows,):
            raise ValueError(f"bias must be {weight.dtype} of shape ({rows},) (one per row of weight); got "
                             f"{bias.dtype} of shape {tuple(bias.shape)}")


def check_config(config: dict, m: int) -> None:
    """A config dict as `policy.config` gives them, for m rows."""
    if not isinstance(config, dict) or set(config) != CONFIG_KEYS:
        raise ValueError(f"config must be a dict with keys {sorted(CONFIG_KEYS)} (as policy.config gives); "
                         f"got {config!r}")
    for name in ("BLOCK_N", "BLOCK_K", "num_warps"):
        if config[name] < 1 or config[name] & (config[name] - 1):
            raise ValueError(f"config's {name} must be a power of two; got {config[name]}")
    if config["splits"] < 1 or config["num_stages"] < 1:
        raise ValueError(f"config's splits and num_stages must be at least 1; got {config}")
    if not config["DOT"] and m != 1:
        raise ValueError(f"the FMA variant (DOT=False) takes one row; this product has {m}")


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation=None) -> torch.Tensor:
    """What `linear` computes, with torch: `F.linear`, then for swiglu the epilogue as transformers'
    LlamaMLP applies it (silu of the gate's half times the up's half, each step rounded). The
    benchmark's baseline and the tests'; `cublas` runs the same product with its epilogue fused."""
    y = F.linear(x, weight, bias)
    if activation == "swiglu":
        gate, up = y.chunk(2, dim=-1)
        return F.silu(gate) * up
    return y


class Linear:
    """`linear` for one shape: x with m rows (the product of its leading dims) by a weight of `rows`
    x k (`activation="swiglu"`: rows = 2I, the output I columns), of `dtype`, on this rank's device.
    Up to `policy.MAX_ROWS` rows it runs the split-K kernel under `config` (a dict as
    `policy.config` gives, None for that one), whose workspace it owns; otherwise cuBLAS (`cublas`).
    Call it as `linear`, any number of times, on one stream at a time (its counters are per call);
    `free()` gives the workspace back. Bad sizes, dtype, activation or config are a ValueError."""

    def __init__(self, m: int, rows: int, k: int, dtype: torch.dtype, activation=None, config: dict | None = None):
        if dtype not in DTYPES:
            raise ValueError(f"linear takes {', '.join(map(str, DTYPES))}; got {dtype}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}; got {activation!r}")
        if m < 0 or rows < 1 or k < 8 or k % 8 or (activation == "swiglu" and rows % 2):
            raise ValueError(f"Linear takes m >= 0 rows, weight rows >= 1 (even for swiglu) and K a multiple of 8; "
                             f"got m={m}, rows={rows}, k={k}")
        self.m, self.rows, self.k, self.dtype, self.activation = m, rows, k, dtype, activation
        self.n = rows // 2 if activation == "swiglu" else rows
        self.device = tridist.world().device
        self.method = None
        self.freed = False
        if 0 < m <= policy.MAX_ROWS:
            if config is None:
                config = policy.config(m, self.n, k, programs_for(self.device), activation == "swiglu",
                                       gpu=self.device.type == "cuda")
            check_config(config, m)
            self.method = SplitK(m, rows, k, dtype, activation == "swiglu", config, self.device)

    @property
    def config(self) -> dict | None:
        """The split-K kernel's config, with the splits it runs; None where cuBLAS runs."""
        if self.method is None:
            return None
        return {**self.method.config, "splits": self.method.splits}

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """`linear(x, weight, bias, activation=...)` with this instance's activation; `out` (of the
        result's shape, or m x N) is written and returned where given, else a new tensor."""
        if self.freed:
            raise ValueError("this Linear was freed: build another")
        check_call(x, weight, bias, self.activation)
        m = x.numel() // self.k
        if (m, *weight.shape, weight.dtype) != (self.m, self.rows, self.k, self.dtype):
            raise ValueError(f"this Linear takes {self.m} rows of x and weight {self.dtype} [{self.rows}, {self.k}]; "
                             f"got {m} rows and {weight.dtype} {list(weight.shape)}: build another, or call "
                             f"tridist.ops.linear, which keeps one per shape")
        if out is not None:
            check_input(out, "out", (self.dtype,))
            if tuple(out.shape) not in ((*x.shape[:-1], self.n), (m, self.n)):
                raise ValueError(f"out must be of shape {(*x.shape[:-1], self.n)} or {(m, self.n)}; got "
                                 f"{tuple(out.shape)}")
        return self.run(x, weight, bias, out)

    def run(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """`__call__` for arguments already checked."""
        if out is None:
            out = torch.empty((*x.shape[:-1], self.n), dtype=self.dtype, device=x.device)
        if not self.m:
            return out
        rows = x.reshape(self.m, self.k)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        if self.method is None:
            cublas.product(rows, weight, bias, self.activation == "swiglu", out.view(self.m, self.n))
        else:
            self.method.launch(rows, weight, bias, out.view(self.m, self.n))
        return out

    def free(self) -> None:
        """Give the workspace back; calling the instance after is a ValueError."""
        self.method = None
        self.freed = True


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           activation: str | None = None) -> torch.Tensor:
    """y = x @ weight.T (+ bias), as `torch.nn.functional.linear`; with `activation="swiglu"`,
    transformers' LlamaMLP's `silu(gate_proj(x)) * up_proj(x)` from one weight.

    Up to `policy.MAX_ROWS` rows of x (decode) one launch of the split-K kernel reads the weight
    over every SM (`split_k`); more rows go to cuBLAS. The same bits every call for one shape on one
    device; no host synchronisation and no allocation but the result's, so a call can be captured in
    a CUDA graph once a call of that shape has run on the capturing stream (which builds the
    kernel's instance and workspace, as every op of `tridist.ops`).

    Args:
        x: [..., K], any leading dims (M rows, their product, M >= 0), bf16 or fp16, on this rank's
            device; its last dim need not be contiguous (it is then copied).
        weight: [N, K] of x's dtype, contiguous (torch.nn.Linear's layout), K a multiple of 8. For
            swiglu [2I, K]: the gate's rows, then the up's (`torch.cat([gate.weight, up.weight])`).
        bias: [N] of x's dtype, or None; for swiglu [2I] likewise (the gate's, then the up's).
        activation: None, or "swiglu".

    Returns:
        [..., N] ([..., I] for swiglu) of x's dtype. Accumulation in fp32; the bias added in fp32
        and the sum rounded once to the dtype. swiglu rounds as LlamaMLP: gate and up each rounded
        to the dtype, silu of the rounded gate computed in fp32 and rounded, the product of the two
        rounded values computed in fp32 and rounded.

    Raises:
        ValueError: before any launch, for dtypes other than bf16 and fp16, x, weight and bias of
            different dtypes or devices, x's last dim not weight's K, a non-contiguous or misaligned
            weight, K not a multiple of 8, bias not [N], an odd number of rows for swiglu, an
            unknown activation. TypeError for a non-tensor.
    """
    check_call(x, weight, bias, activation)
    rows, k = weight.shape
    m = x.numel() // k
    n = rows // 2 if activation == "swiglu" else rows
    if m == 0:
        return torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    if m > policy.MAX_ROWS:  # nothing to keep between calls: no instance
        return Linear(m, rows, k, x.dtype, activation).run(x, weight, bias)
    op = instance(lambda: Linear(m, rows, k, x.dtype, activation), Linear, m, rows, k, x.dtype, activation,
                  device=x.device)
    return op.run(x, weight, bias)


__all__ = ["Linear", "linear", "reference"]
