"""GEMMs: the persistent TMA GEMM (`persistent`, `matmul`), the GEMMs overlapped with
communication that are built on it (AllGather-GEMM, GEMM-ReduceScatter, GEMM-AllReduce), and the
grouped GEMM of mixture-of-experts layers (`grouped`, `grouped_gemm`).

| op | computes | for |
| --- | --- | --- |
| `ag_gemm(a_shard, b)`, `AllGatherGEMM` | `all_gather(a_shard) @ b`, the gather hidden behind the GEMM | a column-parallel layer |
| `gemm_rs(a, b)`, `GemmReduceScatter` | `reduce_scatter(a @ b)`, partial tiles sent from the GEMM's epilogue | a row-parallel layer |
| `gemm_ar(a, b)`, `GemmAllReduce` | `all_reduce(a @ b)` | a row-parallel layer at decode-sized M |
| `matmul(a, b)` | `a @ b` with the same persistent GEMM, on one rank | |
| `linear(x, weight, bias=None, *, activation=None)`, `Linear` | `F.linear(x, weight, bias)`, or with `activation="swiglu"` LlamaMLP's `silu(gate) * up` from one weight, on one rank | decode-sized M: a split-K kernel that streams the weight over every SM |

Operands of all four:

- **bf16 or fp16**: a and b row-major, the result in the operands' dtype. K and N multiples of
  8: TMA needs rows that start on 16-byte boundaries.
- **fp8** (`torch.float8_e4m3fn`) with per-tensor scales, as `torch._scaled_mm` takes them:
  `scale_a=` and `scale_b=` one-element float32 tensors on the device, `out = scale_a * scale_b *
  (a @ b)` in bf16; b column-major (`w.t()` of a contiguous N x K weight `w`: Hopper reads fp8
  operands along K only); K a multiple of 16. `ag_gemm` gathers A whole, so every rank passes
  the same `scale_a`; in `gemm_rs` and `gemm_ar` each rank's partial product is scaled by its
  own scales before the sum. The kernels read the scales, so they may change between calls and
  under CUDA-graph replay.
- Sums over ranks accumulate in fp32; partial tiles travel in the output dtype.

Groups: the three overlapped GEMMs and their classes take `group=`, a `torch.distributed`
process group (`dist.new_group(ranks)`, a DeviceMesh's `mesh.get_group("tp")`), a
`tridist.Group`, or None for the world. The op then runs among the group's members only, while
the other ranks do something else: the shards, rows and sums above are the group's (rank r of
the group, world_size its size), its buffers are allocated among its members, and the methods
that work within one node ("ce", "ll") need a group within one node, whatever the world spans.
Every member calls with the same group; a rank outside it gets a ValueError before anything is
allocated or launched. `config="tune"` times the configs among the members.

Modules, one per method of each op: `persistent` (the GEMM itself, its configs and checks) and
`grouped` (the grouped GEMM), local; `allgather_gemm` (ag_gemm's GEMM) with `shard_gather` (its
two feeders, comm "ce" and "sm", which ag_moe shares); `gemm_reduce_scatter/` (`one_shot`,
`two_d`) and `gemm_all_reduce/` (`one_shot`, `ll`), each package's `__init__` the op's front;
`_tiles` (what the tile-exchanging methods of both share: sending and reading partial tiles,
their workspace plan and launch); `policy` (every choice and threshold); `linear_gemm/` (`linear`'s
front, its split-K kernel `split_k` and, beside them, its own `policy` of configs).

Configs: the overlapped GEMMs take `config=`, a dict from
[`configs(device, dtype=...)`][tridist.ops.gemm.configs], None for
[`default_config`][tridist.ops.gemm.default_config], or `"tune"` to time every config on the op
itself with `tridist.tune` (every rank together; the choice is cached on disk); `matmul` takes a
dict or None.
"""
from .allgather_gemm import AllGatherGEMM, ag_gemm
from .gemm_all_reduce import GemmAllReduce, gemm_ar
from .gemm_reduce_scatter import GemmReduceScatter, gemm_rs
from .grouped import grouped_gemm
from .linear_gemm import Linear, linear
from .persistent import FP8, configs, default_config, matmul, out_dtype

__all__ = ["AllGatherGEMM", "ag_gemm", "GemmAllReduce", "GemmReduceScatter", "gemm_ar", "gemm_rs", "FP8", "configs",
           "default_config", "matmul", "out_dtype", "grouped_gemm", "Linear", "linear"]
