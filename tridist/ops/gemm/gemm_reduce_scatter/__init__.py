"""GEMM-ReduceScatter: `reduce_scatter(a @ b)`, the partial products of a row-parallel layer summed
over the ranks while the GEMM runs, each rank keeping its own rows.

Shapes: a is M x K_local, b is K_local x N on every rank; the partial product a @ b is M x N, and
rank r gets rows [r * M/world, (r+1) * M/world) of the sum over ranks. With `group=`, the ranks,
world and sum are the group's: rank r of the group gets its rows of the sum over the members.

Each method is one persistent kernel in which every rank computes every output tile of its
partial product and sends it, from the GEMM's epilogue, towards the rank that owns its rows.
Partial tiles travel in the output dtype (bf16 for fp8 operands, each rank's partial scaled by its
own scales); sums accumulate in fp32. There is no `method=`: the topology (of the group, if
given) picks (`policy.choose_gemm_rs`).

| method | module | where |
| --- | --- | --- |
| `"one_shot"` | `one_shot`: every partial tile straight to its owner | one node |
| `"2d"` | `two_d`: tiles summed on each node first, one put per node carries the node's sum | several nodes |
"""
import torch


from ...ranks import ranks_of
from .. import persistent, policy
from .one_shot import OneShot
from .two_d import TwoD

METHODS = {method.name: method for method in (OneShot, TwoD)}


class GemmReduceScatter:
    """`reduce_scatter(a @ b)` for a of m x k and b of k x n, with its own symmetric buffers: rank
    r gets rows `[r * m / world_size, (r + 1) * m / world_size)` of the sum over ranks.

    One persistent kernel: every rank computes every output tile of its partial product, and
    sends the tiles of rank s's rows to rank s from the GEMM's epilogue (stores through `symm_at`
    and a flag per tile on one node, a put with signal across nodes); each rank takes the shards
    in the order rank+1, rank+2, ..., its own last, and adds the partials it received to its own
    in fp32. Across nodes the tiles are summed on the node first, and one put per node carries
    the node's sum. Needs its whole grid resident (one program per SM): nothing else may occupy
    the SMs while it runs.

    Build it on every rank (of `group`) at once; call it back to back on one stream, also in CUDA
    graphs; `free()` it on every rank (of `group`). `tridist.ops.gemm_rs` keeps one per shape,
    group and stream.

    Args:
        m: rows of a (all of the product's rows), a multiple of the world size.
        k: columns of a (this rank's part of the layer's K), rows of b.
        n: columns of b.
        dtype: bf16, fp16 or fp8.
        config: a dict from [`configs`][tridist.ops.gemm.configs], None for the default, or
            `"tune"`. Across nodes only configs without `FLATTEN`.
        group: a `torch.distributed` process group (`dist.new_group`, a DeviceMesh's
            `mesh.get_group("tp")`), a `tridist.Group`, or None for the world: the ranks whose
            partial products are summed and scattered, world_size being the group's size and
            rank r its r-th member. Build it on every member (only).

    Raises:
        ValueError: a dtype it does not take, K or N not a multiple of 8 (16 for fp8), m not a
            multiple of the world size (the group's size), a `FLATTEN` config across nodes, this
            rank not a member of `group`.
    """

    def __init__(self, m: int, k: int, n: int, dtype: torch.dtype, config: dict | str | None = None, group=None):
        self.ranks = w = ranks_of(group)
        persistent.check_sizes("gemm_rs", dtype, k, n)
        if m % w.world_size:
            where = "the world size" if w.group is None else "the group's size"
            raise ValueError(f"gemm_rs splits the M = {m} rows of the product over {w.world_size} ranks: make M a "
                             f"multiple of {where}")
        self.method = policy.choose_gemm_rs(w)
        chosen = METHODS[self.method]
        if not chosen.flatten:
            persistent.refuse_flatten(config, "gemm_rs across nodes")
        self.m, self.k, self.n, self.dtype = m, k, n, dtype
        self.config = persistent.resolve_config(
            config, "gemm_rs", (m, k, n, str(dtype), self.method),
            lambda c: GemmReduceScatter(m, k, n, dtype, config=c, group=group),
            lambda: persistent.random_operands(m, k, n, dtype, w.device), w.device, m, n, flatten=chosen.flatten,
            dtype=dtype, group=w.group)  # every rank computes all m rows
        self.impl = chosen(m, k, n, dtype, self.config, w)

    def __call__(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None,
                 scale_a: torch.Tensor | None = None, scale_b: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's rows of the sum over ranks of `a @ b`, into `out`.

        Args:
            a: m x k of `dtype` (as built), row-major, on this rank's device.
            b: k x n of `dtype` (column-major for fp8).
            out: m / world_size x n (world_size: the group's size, with a group), of the output
                dtype (bf16 for fp8); a new tensor if None.
            scale_a: fp8 only: this rank's scale of a (a one-element float32 tensor).
            scale_b: fp8 only: this rank's scale of b.

        Returns:
            `out`.

        Raises:
            ValueError: operands, scales or `out` not what this instance was built for.
        """
        out = persistent.check_call(a, b, scale_a, scale_b, out, self.m // self.ranks.world_size,
                                    built=("gemm_rs", (self.m, self.k), (self.k, self.n), self.dtype),
                                    group=self.ranks.group)
        self.impl.launch(a, b, out, scale_a, scale_b)
        return out

    def free(self) -> None:
        """Give the symmetric buffers back (collective: every rank, in the same order)."""
        self.impl.free()


def gemm_rs(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, config: dict | str | None = None,
            scale_a: torch.Tensor | None = None, scale_b: torch.Tensor | None = None, group=None) -> torch.Tensor:
    """`reduce_scatter(a @ b)` over the ranks (of `group`, if given), overlapped with the GEMM: the
    row-parallel layer of tensor parallelism, handing each rank back its own rows.

    A collective: every rank (every member of `group`) calls it with the same shapes. Keeps one
    [`GemmReduceScatter`][tridist.ops.GemmReduceScatter] per shape, dtype, config, group and
    stream.

    Args:
        a: M x K_local (this rank's columns of the activations), row-major; bf16, fp16 or fp8.
            M a multiple of the world size (the group's size).
        b: K_local x N (this rank's rows of the weight; column-major for fp8).
        out: M / world_size x N (world_size: the group's size); a new tensor if None.
        config: a dict from [`configs`][tridist.ops.gemm.configs], None for the default, or
            `"tune"`.
        scale_a: fp8 only: this rank's scale of a.
        scale_b: fp8 only: this rank's scale of b.
        group: a `torch.distributed` process group, a `tridist.Group`, or None for the world: the
            ranks the product is summed over and scattered to (rank r of the group gets rows
            `[r * M / size, (r + 1) * M / size)`).

    Returns:
        `out`: this rank's rows of the sum over ranks of `a @ b`.

    Raises:
        ValueError: before any launch, for operands, scales, `out` or config it does not take, or
            on a rank that is not a member of `group`.
    """
    return persistent.cached(GemmReduceScatter, a, b, config, group=group)(a, b, out, scale_a, scale_b)
