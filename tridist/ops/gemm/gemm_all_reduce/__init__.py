"""GEMM-AllReduce: `all_reduce(a @ b)`, the partial products of a row-parallel layer summed over the
ranks while the GEMM runs, for decode-sized M.

Shapes: a is M x K_local, b is K_local x N on every rank; every rank gets the M x N sum over ranks
of a @ b, the same bits on every rank (every rank sums the partials in rank order). With `group=`,
the sum is over the group's members, in group rank order.

Each method is one persistent kernel in which every rank computes every output tile of its
partial product and sends it to every peer from the GEMM's epilogue, then sums each tile over the
ranks. Partial tiles travel in the output dtype (bf16 for fp8 operands, each rank's partial scaled
by its own scales); sums accumulate in fp32.

| method | module | where |
| --- | --- | --- |
| `"one_shot"` | `one_shot`: tiles stored to every peer, a flag per tile | any topology |
| `"ll"` | `ll`: tiles in low-latency packets, the data its own flag | one node |
| `"auto"` | `policy.choose_gemm_ar` | |
"""
import torch

from ... import checks
from ...ranks import ranks_of
from .. import persistent, policy
from .ll import LowLatency
from .one_shot import OneShot

CHOSEN = {method.name: method for method in (OneShot, LowLatency)}
METHODS = ("auto", *CHOSEN)


class GemmAllReduce:
    """`all_reduce(a @ b)` for a of m x k and b of k x n, with its own symmetric buffers; made for
    decode-sized m (up to a few hundred rows). Every rank computes every tile of its partial
    product and sends it to every peer; a second pass sums the partials of ranks 0, 1, ... in that
    order, so every rank ends with the same bits.

    | method | how | where |
    | --- | --- | --- |
    | `"one_shot"` | tiles stored to every peer, a flag per tile | any topology |
    | `"ll"` | the tiles in low-latency packets: each 4-byte word of two outputs travels with the call's epoch as its flag, twice the bytes and no flag round trip | one node |
    | `"auto"` | [`choose_gemm_ar`][tridist.ops.gemm.policy.choose_gemm_ar]: `ll` up to 128 rows on one node, else `one_shot` | |

    Build it on every rank (of `group`) at once; call it back to back on one stream, also in CUDA
    graphs; `free()` it on every rank (of `group`). `tridist.ops.gemm_ar` keeps one per shape,
    group and stream.

    Args:
        m: rows of a and of the product.
        k: columns of a (this rank's part of the layer's K), rows of b.
        n: columns of b.
        dtype: bf16, fp16 or fp8.
        method: one of the methods above.
        config: a dict from [`configs`][tridist.ops.gemm.configs] without `FLATTEN`, None for
            the default, or `"tune"`.
        group: a `torch.distributed` process group (`dist.new_group`, a DeviceMesh's
            `mesh.get_group("tp")`), a `tridist.Group`, or None for the world: the ranks whose
            partial products are summed (the methods' "one node" is then the group's nodes).
            Build it on every member (only).

    Raises:
        ValueError: an unknown method, a dtype it does not take, K or N not a multiple of 8 (16
            for fp8), a `FLATTEN` config, `"ll"` on several nodes (a group that spans several),
            this rank not a member of `group`.
    """

    def __init__(self, m: int, k: int, n: int, dtype: torch.dtype, method: str = "auto",
                 config: dict | str | None = None, group=None):
        if method not in METHODS:
            raise checks.method_error("gemm_ar", method, METHODS)
        self.ranks = w = ranks_of(group)
        persistent.check_sizes("gemm_ar", dtype, k, n)
        self.method = policy.choose_gemm_ar(m, w) if method == "auto" else method
        chosen = CHOSEN[self.method]
        if not chosen.flatten:
            persistent.refuse_flatten(config, "gemm_ar")
        if chosen.one_node:
            checks.require_one_node(f"gemm_ar method '{self.method}'", "method='one_shot'", w)
        self.m, self.k, self.n, self.dtype = m, k, n, dtype
        self.config = persistent.resolve_config(
            config, "gemm_ar", (m, k, n, str(dtype), self.method),
            lambda c: GemmAllReduce(m, k, n, dtype, self.method, config=c, group=group),
            lambda: persistent.random_operands(m, k, n, dtype, w.device), w.device, m, n, flatten=chosen.flatten,
            dtype=dtype, group=w.group)
        self.impl = chosen(m, k, n, dtype, self.config, w)

    def __call__(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None,
                 scale_a: torch.Tensor | None = None, scale_b: torch.Tensor | None = None) -> torch.Tensor:
        """The sum over ranks of `a @ b`, into `out`.

        Args:
            a: m x k of `dtype` (as built), row-major, on this rank's device.
            b: k x n of `dtype` (column-major for fp8).
            out: m x n, of the output dtype (bf16 for fp8); a new tensor if None.
            scale_a: fp8 only: this rank's scale of a (a one-element float32 tensor).
            scale_b: fp8 only: this rank's scale of b.

        Returns:
            `out`.

        Raises:
            ValueError: operands, scales or `out` not what this instance was built for.
        """
        out = persistent.check_call(a, b, scale_a, scale_b, out, self.m,
                                    built=("gemm_ar", (self.m, self.k), (self.k, self.n), self.dtype),
                                    group=self.ranks.group)
        self.impl.launch(a, b, out, scale_a, scale_b)
        return out

    def free(self) -> None:
        """Give the symmetric buffers back (collective: every rank, in the same order)."""
        self.impl.free()


def gemm_ar(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, method: str = "auto",
            config: dict | str | None = None, scale_a: torch.Tensor | None = None,
            scale_b: torch.Tensor | None = None, group=None) -> torch.Tensor:
    """`all_reduce(a @ b)` over the ranks (of `group`, if given), overlapped with the GEMM: the
    row-parallel layer at decode-sized M.

    A collective: every rank (every member of `group`) calls it with the same shapes. Keeps one
    [`GemmAllReduce`][tridist.ops.GemmAllReduce] per shape, dtype, method, config, group and
    stream.

    Args:
        a: M x K_local, row-major; bf16, fp16 or fp8.
        b: K_local x N (column-major for fp8).
        out: M x N; a new tensor if None.
        method: `"auto"`, `"one_shot"` or `"ll"` (see `GemmAllReduce`).
        config: a dict from [`configs`][tridist.ops.gemm.configs] without `FLATTEN`, None for
            the default, or `"tune"`.
        scale_a: fp8 only: this rank's scale of a.
        scale_b: fp8 only: this rank's scale of b.
        group: a `torch.distributed` process group, a `tridist.Group`, or None for the world: the
            ranks the product is summed over.

    Returns:
        `out`: the sum over ranks (of `group`) of `a @ b`, the same bits on every rank.

    Raises:
        ValueError: before any launch, for operands, scales, `out`, method or config it does not
            take, or on a rank that is not a member of `group`.
    """
    return persistent.cached(GemmAllReduce, a, b, config, group=group, method=method)(a, b, out, scale_a, scale_b)
