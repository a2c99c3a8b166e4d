"""Tensor-parallel linear layers: a layer's weight split over the ranks (of the world, or of a
process group: `group=`) by output columns (`ColumnParallelLinear`) or by input rows
(`RowParallelLinear`), as in Megatron-LM and vLLM. "The world size" and "rank r" below are the
group's, with a group.

Both keep their weight in the layout tridist's GEMMs read, `in_features x out_features` row-major
(the transpose of `torch.nn.Linear.weight`), holding this rank's part only; `from_linear` cuts a
`torch.nn.Linear` that every rank holds whole.

Each call picks its kernel from the number of rows (tokens), which is static for a given shape, so
a decode step still captures in one CUDA graph:

| layer | input | rows | kernel |
| --- | --- | --- | --- |
| column | replicated | any | a local GEMM (torch) |
| column | sequence parallel (this rank's rows) | any | `ops.ag_gemm`: the all-gather of the rows hidden behind the GEMM |
| row | output replicated | up to `DECODE_ROWS` | a local GEMM then `ops.all_reduce` (with `DECODE_KERNEL = "gemm_ar"`: `ops.gemm_ar`, the GEMM's tiles summed over the ranks as they are made) |
| row | output replicated | more, a multiple of the world size | `ops.gemm_rs` then `ops.all_gather` |
| row | output replicated | more, otherwise | a local GEMM then `ops.all_reduce` |
| row | sequence parallel (this rank's rows out) | any | `ops.gemm_rs` |
"""
import torch
from torch import nn

from tridist import ops
from tridist.ops.ranks import ranks_of

# Rows up to which a row-parallel layer with a replicated output runs its decode kernel
# (`DECODE_KERNEL`); larger M goes through `ops.gemm_rs`, made for prefill-sized M. Not a measured
# crossover: `tridist bench model` times both sides of it.
DECODE_ROWS = 256
# How a row-parallel layer with a replicated output runs those rows: "all_reduce" (torch's GEMM, then
# `ops.all_reduce`: its LL method at decode sizes) or "gemm_ar". gemm_ar overlaps the sum with the
# GEMM, but its GEMM at decode M is slower than cuBLAS's, and the whole decode step was faster with
# "all_reduce" at batch 1, 8 and 64 (benchmarks/NOTES.md, "The model's decode step, second look");
# `tridist bench model --row-decode` times either.
DECODE_KERNEL = "all_reduce"
DECODE_KERNELS = ("gemm_ar", "all_reduce")


def split(size: int, world_size: int, what: str, align: int = 1) -> int:
    """`size // world_size`, after checking that it divides, into parts that are multiples of `align`."""
    if size % (world_size * align):
        parts = f"parts that are multiples of {align}" if align > 1 else "equal parts"
        raise ValueError(f"{what} ({size}) must split over the {world_size} ranks into {parts}: a multiple of "
                         f"{world_size * align}")
    return size // world_size


def rows(x: torch.Tensor) -> torch.Tensor:
    """x as 2-D (all leading dimensions as rows), contiguous, as the GEMMs take it."""
    return x.reshape(-1, x.shape[-1]).contiguous()


class _ShardedLinear(nn.Module):
    """What the two tensor-parallel linear layers share: building one from a whole `torch.nn.Linear`."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs):
        """This rank's part of a `torch.nn.Linear` that every rank holds whole (the same weights), on
        the linear's device unless `device` is given; `kwargs` as the constructor's."""
        kwargs.setdefault("device", linear.weight.device)
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, dtype=linear.weight.dtype,
                    **kwargs)
        weight, bias = layer._mine(linear.weight, linear.bias)
        with torch.no_grad():
            layer.weight.copy_(weight)
            if bias is not None:
                layer.bias.copy_(bias)
        return layer


class ColumnParallelLinear(_ShardedLinear):
    """y = x @ W + b with W's output columns split over the ranks: rank r holds columns
    r * out_local ... (r + 1) * out_local - 1 (and those of b) and returns them.

    Args:
        in_features: columns of x.
        out_features: columns of the whole layer's output; a multiple of the world size.
        bias: whether the layer adds a bias (this rank's part of it).
        sequence_parallel: x holds this rank's rows only (`[tokens_shard, in_features]`, every
            rank the same number): the call gathers every rank's rows while it multiplies
            (`ops.ag_gemm`) and returns all of them. Otherwise x is the same on every rank
            (replicated) and the call is a local GEMM.
        gather_output: return every rank's columns (`ops.all_gather`), the same on every rank.
        group: a `torch.distributed.ProcessGroup` or `tridist.Group` whose members hold the
            layer's parts (they build and call it together; the other ranks take no part), None
            for the world.
        dtype: of the weight (bf16 or fp16 for the tridist GEMMs).
        device: of the weight; the world's device by default.

    Attributes:
        weight: `[in_features, out_features / world_size]`, row-major: this rank's columns.
        bias: `[out_features / world_size]` or None.

    Raises:
        ValueError: out_features not a multiple of the world size; a `group` this rank is not a
            member of.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, sequence_parallel: bool = False,
                 gather_output: bool = False, group=None, dtype: torch.dtype | None = None,
                 device: torch.device | None = None):
        super().__init__()
        ranks = ranks_of(group)
        self.world_size, self.rank, self.group = ranks.world_size, ranks.rank, ranks.group
        self.in_features, self.out_features = in_features, out_features
        self.out_local = split(out_features, ranks.world_size, "out_features")
        self.sequence_parallel, self.gather_output = sequence_parallel, gather_output
        device = ranks.device if device is None else device
        self.weight = nn.Parameter(torch.empty(in_features, self.out_local, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(self.out_local, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)

    def _mine(self, weight: torch.Tensor, bias: torch.Tensor | None):
        """This rank's parts of a whole `torch.nn.Linear` weight ([out, in]) and bias, in this layer's layout."""
        mine = slice(self.rank * self.out_local, (self.rank + 1) * self.out_local)
        return weight[mine].t(), None if bias is None else bias[mine]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: `[..., in_features]` (replicated), or `[tokens_shard, in_features]` with
        sequence_parallel. Returns `[..., out_local]` (`[world_size * tokens_shard, out_local]`
        with sequence_parallel), or every rank's columns with gather_output."""
        if self.sequence_parallel:
            if x.dim() != 2:
                raise ValueError(f"a sequence-parallel ColumnParallelLinear takes [tokens_shard, in_features], got "
                                 f"shape {tuple(x.shape)}")
            y = (ops.ag_gemm(x.contiguous(), self.weight, group=self.group) if x.shape[0]
                 else x.new_empty(0, self.out_local))
        else:
            y = x @ self.weight
        if self.bias is not None:
            y = y + self.bias
        if self.gather_output:
            gathered = (ops.all_gather(rows(y), group=self.group) if y.numel()
                        else y.new_empty(self.world_size * y.shape[0], 0))
            y = gathered.view(self.world_size, -1, self.out_local).permute(1, 0, 2).reshape(
                *y.shape[:-1], self.out_features)
        return y

    def extra_repr(self) -> str:
        """The sizes, in the module's printout."""
        return (f"in_features={self.in_features}, out_features={self.out_features} ({self.out_local} on this rank), "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(_ShardedLinear):
    """y = x @ W + b with W's input rows split over the ranks: rank r holds rows
    r * in_local ... (r + 1) * in_local - 1 and takes those columns of x (what a
    `ColumnParallelLinear` before it returns); the partial products are summed over the ranks.

    Args:
        in_features: rows of the whole layer's weight; a multiple of the world size.
        out_features: columns of the output.
        bias: whether the layer adds a bias (whole on every rank, added once after the sum).
        sequence_parallel: return this rank's rows of the sum only (`ops.gemm_rs`, the rows a
            multiple of the world size); otherwise every rank gets all of it, by the rows'
            number as the module docstring's table says.
        group: a `torch.distributed.ProcessGroup` or `tridist.Group` whose members hold the
            layer's parts (they build and call it together; the other ranks take no part), None
            for the world.
        dtype: of the weight (bf16 or fp16 for the tridist GEMMs).
        device: of the weight; the world's device by default.

    Attributes:
        weight: `[in_features / world_size, out_features]`, row-major: this rank's rows.
        bias: `[out_features]` or None.

    Raises:
        ValueError: in_features not a multiple of the world size; a `group` this rank is not a
            member of.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, sequence_parallel: bool = False,
                 group=None, dtype: torch.dtype | None = None, device: torch.device | None = None):
        super().__init__()
        ranks = ranks_of(group)
        self.world_size, self.rank, self.group = ranks.world_size, ranks.rank, ranks.group
        self.in_features, self.out_features = in_features, out_features
        self.in_local = split(in_features, ranks.world_size, "in_features")
        self.sequence_parallel = sequence_parallel
        device = ranks.device if device is None else device
        self.weight = nn.Parameter(torch.empty(self.in_local, out_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)

    def _mine(self, weight: torch.Tensor, bias: torch.Tensor | None):
        """This rank's parts of a whole `torch.nn.Linear` weight ([out, in]) and bias, in this layer's layout."""
        mine = slice(self.rank * self.in_local, (self.rank + 1) * self.in_local)
        return weight[:, mine].t(), bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: `[..., in_local]`, this rank's columns. Returns `[..., out_features]`, the same on
        every rank; with sequence_parallel `[rows / world_size, out_features]`, this rank's rows."""
        a = rows(x)
        m = a.shape[0]
        if self.sequence_parallel:
            if m % self.world_size:
                raise ValueError(f"a sequence-parallel RowParallelLinear needs rows ({m}) that are a multiple of "
                                 f"the world size ({self.world_size}): pad the tokens")
            y = ops.gemm_rs(a, self.weight, group=self.group) if m else a.new_empty(0, self.out_features)
        else:
            if m == 0:
                y = a.new_empty(0, self.out_features)
            elif m <= DECODE_ROWS and DECODE_KERNEL not in DECODE_KERNELS:
                raise ValueError(f"tridist.nn.linear.DECODE_KERNEL is {DECODE_KERNEL!r}: set it to one of "
                                 f"{', '.join(DECODE_KERNELS)}")
            elif m <= DECODE_ROWS and DECODE_KERNEL == "gemm_ar":
                y = ops.gemm_ar(a, self.weight, group=self.group)
            elif m <= DECODE_ROWS:
                y = ops.all_reduce(a @ self.weight, group=self.group)
            elif m % self.world_size == 0:
                y = ops.all_gather(ops.gemm_rs(a, self.weight, group=self.group), group=self.group)
            else:
                y = ops.all_reduce(a @ self.weight, group=self.group)
            y = y.view(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            y = y + self.bias
        return y

    def extra_repr(self) -> str:
        """The sizes, in the module's printout."""
        return (f"in_features={self.in_features} ({self.in_local} on this rank), out_features={self.out_features}, "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}")
