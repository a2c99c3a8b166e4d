"""Tensor-parallel linear layers: a layer's weight split over the ranks (of the world, or of a
process group: `group=`) by output columns (`ColumnParallelLinear`) or by input rows
(`RowParallelLinear`), as in Megatron-LM and vLLM. "The world size" and "rank r" below are the
group's, with a group.

Each layer holds this rank's part of the weight in the layout its kernel reads, laid out once when
the layer is built: with the tokens replicated on every rank, torch.nn.Linear's `[out, in]` (the
decode GEMM `ops.linear` streams it: split-K over the SMs at decode rows, cuBLAS above); with
`sequence_parallel=True` (each rank holds some of the tokens), its transpose `[in, out]`,
row-major, as `ops.ag_gemm` and `ops.gemm_rs` take it. `from_linear` cuts a `torch.nn.Linear` that
every rank holds whole; `ColumnParallelLinear.from_linears` fuses several that read the same input
(q, k and v; gate and up) into one GEMM.

| layer | input | kernel |
| --- | --- | --- |
| column | replicated | `ops.linear` (with `activation="swiglu"`, SiLU(gate) * up in its epilogue) |
| column | sequence parallel (this rank's rows) | `ops.ag_gemm`: the all-gather of the rows hidden behind the GEMM |
| row | replicated, output summed | `ops.linear` then `ops.all_reduce` |
| row | replicated, `sum_output=False` | `ops.linear`: this rank's partial product, which the caller sums (e.g. inside `ops.all_reduce_rms_norm`) |
| row | sequence parallel (this rank's rows out) | `ops.gemm_rs` |

The kernel depends only on the layer and the shapes, so a decode step captures in one CUDA graph.
"""
import torch
import torch.nn.functional as F
from torch import nn

from tridist import ops
from tridist.ops.ranks import ranks_of

ACTIVATIONS = (None, "swiglu")


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


def _parameter(shape, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class ColumnParallelLinear(nn.Module):
    """y = x @ W.T + b with W's output rows split over the ranks: rank r holds rows r * out_local
    ... (r + 1) * out_local - 1 of W (and of b) and returns those columns of y. A layer fused from
    several linears (`from_linears`) holds each one's part, one after another: its output columns
    are this rank's columns of the first, then of the second, ... (`parts`).

    Args:
        in_features: columns of x.
        out_features: columns of the whole layer's output; a multiple of the world size.
        bias: whether the layer adds a bias (this rank's part of it).
        sequence_parallel: x holds this rank's rows only (`[tokens_shard, in_features]`, every
            rank the same number): the call gathers every rank's rows while it multiplies
            (`ops.ag_gemm`) and returns all of them. Otherwise x is the same on every rank
            (replicated) and the call is a local GEMM.
        gather_output: return every rank's columns (`ops.all_gather`), the same on every rank.
        activation: None, or `"swiglu"`: the layer is [gate; up] (out_features = 2 I) and returns
            SiLU(x @ W_gate.T) * (x @ W_up.T), this rank's I / world_size columns of it (in the
            GEMM's epilogue, replicated).
        group: a `torch.distributed.ProcessGroup` or `tridist.Group` whose members hold the
            layer's parts (they build and call it together; the other ranks take no part), None
            for the world.
        dtype: of the weight (bf16 or fp16 for the tridist GEMMs).
        device: of the weight; the world's device by default.

    Attributes:
        weight: this rank's rows of W: `[out_local, in_features]` (torch.nn.Linear's layout),
            or its transpose `[in_features, out_local]` row-major with sequence_parallel.
        bias: `[out_local]` or None.
        parts: the columns of this rank's output that each fused linear gives (one part unless
            built by `from_linears`).

    Raises:
        ValueError: out_features not a multiple of the world size; an unknown activation, or one
            with gather_output; a `group` this rank is not a member of.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, sequence_parallel: bool = False,
                 gather_output: bool = False, activation: str | None = None, group=None,
                 dtype: torch.dtype | None = None, device: torch.device | None = None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        if activation and gather_output:
            raise ValueError("gather_output gathers a plain layer's columns; a gated layer's output is the next "
                             "layer's input, this rank's columns of it")
        ranks = ranks_of(group)
        self.world_size, self.rank, self.group = ranks.world_size, ranks.rank, ranks.group
        self.in_features, self.out_features = in_features, out_features
        self.out_local = split(out_features, ranks.world_size, "out_features")
        self.parts = (self.out_local,)
        self.sequence_parallel, self.gather_output, self.activation = sequence_parallel, gather_output, activation
        device = ranks.device if device is None else device
        shape = (in_features, self.out_local) if sequence_parallel else (self.out_local, in_features)
        self.weight = _parameter(shape, dtype, device)
        self.bias = _parameter(self.out_local, dtype, device) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs) -> "ColumnParallelLinear":
        """This rank's part of a `torch.nn.Linear` that every rank holds whole (the same weights), on
        the linear's device unless `device` is given; `kwargs` as the constructor's."""
        return cls.from_linears([linear], **kwargs)

    @classmethod
    def from_linears(cls, linears: list[nn.Linear], **kwargs) -> "ColumnParallelLinear":
        """One layer of several `torch.nn.Linear`s that read the same input (every rank holding them
        whole), each split over the ranks by its own output rows, this rank's parts one after
        another: q, k and v as one GEMM (split by heads, each a multiple of the world size), or
        gate and up with `activation="swiglu"`. `kwargs` as the constructor's.

        Raises:
            ValueError: linears of different input sizes, dtypes or bias; an output size that does
                not split over the ranks (the message names which); for swiglu, not two linears of
                one size.
        """
        first = linears[0]
        if any(l.in_features != first.in_features or l.weight.dtype != first.weight.dtype
               or (l.bias is None) != (first.bias is None) for l in linears):
            raise ValueError("from_linears fuses linears of one input size, dtype and bias (or none)")
        if kwargs.get("activation") == "swiglu" and (len(linears) != 2 or linears[0].out_features
                                                     != linears[1].out_features):
            raise ValueError("a swiglu layer fuses two linears of one size: gate, then up")
        if len(linears) > 1 and kwargs.get("gather_output"):
            raise ValueError("gather_output takes one linear: a fused layer's output is this rank's parts")
        kwargs.setdefault("device", first.weight.device)
        ranks = ranks_of(kwargs.get("group"))
        local = [split(l.out_features, ranks.world_size, f"out_features of linear {i}") for i, l in enumerate(linears)]
        layer = cls(first.in_features, sum(l.out_features for l in linears), first.bias is not None,
                    dtype=first.weight.dtype, **kwargs)
        layer.parts = tuple(local)
        mine = [slice(layer.rank * n, (layer.rank + 1) * n) for n in local]
        weight = torch.cat([l.weight[part] for l, part in zip(linears, mine)])
        with torch.no_grad():
            layer.weight.copy_(weight.t() if layer.sequence_parallel else weight)
            if layer.bias is not None:
                layer.bias.copy_(torch.cat([l.bias[part] for l, part in zip(linears, mine)]))
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: `[..., in_features]` (replicated), or `[tokens_shard, in_features]` with
        sequence_parallel. Returns `[..., out_local]` (`[world_size * tokens_shard, out_local]`
        with sequence_parallel; half that many columns with swiglu), or every rank's columns with
        gather_output."""
        if self.sequence_parallel:
            if x.dim() != 2:
                raise ValueError(f"a sequence-parallel ColumnParallelLinear takes [tokens_shard, in_features], got "
                                 f"shape {tuple(x.shape)}")
            y = (ops.ag_gemm(x.contiguous(), self.weight, group=self.group) if x.shape[0]
                 else x.new_empty(0, self.out_local))
            if self.bias is not None:
                y = y + self.bias
            if self.activation:
                gate, up = y.chunk(2, dim=-1)
                y = F.silu(gate) * up
            return y
        y = ops.linear(x, self.weight, self.bias, activation=self.activation)
        if self.gather_output:
            gathered = (ops.all_gather(rows(y), group=self.group) if y.numel()
                        else y.new_empty(self.world_size * y.shape[0], 0))
            y = gathered.view(self.world_size, -1, self.out_local).permute(1, 0, 2).reshape(
                *y.shape[:-1], self.out_features)
        return y

    def extra_repr(self) -> str:
        """The sizes, in the module's printout."""
        return (f"in_features={self.in_features}, out_features={self.out_features} ({self.out_local} on this rank"
                f"{', parts ' + str(self.parts) if len(self.parts) > 1 else ''}), bias={self.bias is not None}, "
                f"activation={self.activation}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """y = x @ W.T + b with W's input columns split over the ranks: rank r holds columns
    r * in_local ... (r + 1) * in_local - 1 of W and takes those columns of x (what a
    `ColumnParallelLinear` before it returns); the partial products are summed over the ranks,
    here or, with `sum_output=False`, by the caller's next op.

    Args:
        in_features: columns of the whole layer's weight; a multiple of the world size.
        out_features: columns of the output.
        bias: whether the layer adds a bias (whole on every rank, added once to the sum).
        sequence_parallel: return this rank's rows of the sum only (`ops.gemm_rs`, the rows a
            multiple of the world size); otherwise every rank gets all of it.
        sum_output: False: return this rank's partial product (the bias added on rank 0 only, so
            that the sum holds it once) and leave the sum over the ranks to the caller, who fuses
            it into its next op (`ops.all_reduce_rms_norm`). Not with sequence_parallel.
        group: a `torch.distributed.ProcessGroup` or `tridist.Group` whose members hold the
            layer's parts (they build and call it together; the other ranks take no part), None
            for the world.
        dtype: of the weight (bf16 or fp16 for the tridist GEMMs).
        device: of the weight; the world's device by default.

    Attributes:
        weight: this rank's columns of W: `[out_features, in_local]` (torch.nn.Linear's layout),
            or its transpose `[in_local, out_features]` row-major with sequence_parallel.
        bias: `[out_features]` or None.

    Raises:
        ValueError: in_features not a multiple of the world size; sum_output=False with
            sequence_parallel; a `group` this rank is not a member of.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, sequence_parallel: bool = False,
                 sum_output: bool = True, group=None, dtype: torch.dtype | None = None,
                 device: torch.device | None = None):
        super().__init__()
        if sequence_parallel and not sum_output:
            raise ValueError("a sequence-parallel RowParallelLinear sums its output (gemm_rs): sum_output=False "
                             "takes replicated outputs")
        ranks = ranks_of(group)
        self.world_size, self.rank, self.group = ranks.world_size, ranks.rank, ranks.group
        self.in_features, self.out_features = in_features, out_features
        self.in_local = split(in_features, ranks.world_size, "in_features")
        self.sequence_parallel, self.sum_output = sequence_parallel, sum_output
        device = ranks.device if device is None else device
        shape = (self.in_local, out_features) if sequence_parallel else (out_features, self.in_local)
        self.weight = _parameter(shape, dtype, device)
        self.bias = _parameter(out_features, dtype, device) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs) -> "RowParallelLinear":
        """This rank's part of a `torch.nn.Linear` that every rank holds whole (the same weights), on
        the linear's device unless `device` is given; `kwargs` as the constructor's."""
        kwargs.setdefault("device", linear.weight.device)
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, dtype=linear.weight.dtype,
                    **kwargs)
        weight = linear.weight[:, layer.rank * layer.in_local:(layer.rank + 1) * layer.in_local]
        with torch.no_grad():
            layer.weight.copy_(weight.t() if layer.sequence_parallel else weight)
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: `[..., in_local]`, this rank's columns. Returns `[..., out_features]`: the sum, the
        same on every rank (with sum_output=False this rank's partial product); with
        sequence_parallel `[rows / world_size, out_features]`, this rank's rows of the sum."""
        if self.sequence_parallel:
            a = rows(x)
            if a.shape[0] % self.world_size:
                raise ValueError(f"a sequence-parallel RowParallelLinear needs rows ({a.shape[0]}) that are a "
                                 f"multiple of the world size ({self.world_size}): pad the tokens")
            y = ops.gemm_rs(a, self.weight, group=self.group) if a.shape[0] else a.new_empty(0, self.out_features)
            return y if self.bias is None else y + self.bias
        if not self.sum_output:
            return ops.linear(x, self.weight, self.bias if self.rank == 0 else None)
        y = ops.linear(x, self.weight)
        if y.numel():
            y = ops.all_reduce(y.contiguous(), group=self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        """The sizes, in the module's printout."""
        return (f"in_features={self.in_features} ({self.in_local} on this rank), out_features={self.out_features}, "
                f"bias={self.bias is not None}, sum_output={self.sum_output}, "
                f"sequence_parallel={self.sequence_parallel}")
