"""Mixture of experts.

Expert parallel (each rank holds some experts, tokens travel to them):
- `all_to_all_v`, `all_to_all_v_2d`, `all_to_all_v_2d_offset` (`AllToAllV`): all-to-all-v with the
  splits on the device, in PyTorch's `all_to_all_vdev*` layouts;
- `EPBuffer`: dispatch and combine for top-k routing, normal and low-latency modes (DeepEP's API).

Tensor parallel (every rank holds a slice of every expert): `ag_moe` (all-gather + grouped GEMM)
and `moe_rs` (grouped GEMM + top-k sum + reduce-scatter), with the routing they share in
`tp_routing`.

Both families route with `sort`, a stable counting sort on the device (each token's or pair's place
among those of its rank or expert).

Custom ops for `torch.compile`: `torch.ops.tridist.all_to_all_v(x, in_splits, out_rows)`,
`all_to_all_v_2d(x, in_splits, out_rows, major_align=1)` and
`all_to_all_v_2d_offset(x, in_splits_offsets, out_rows)` return `(out, out_splits_offsets)`;
`torch.ops.tridist.ag_moe` and `moe_rs` as their functions.
"""
from .allgather_moe import AllGatherMoE, ag_moe
from .alltoall import AllToAllV, all_to_all_v, all_to_all_v_2d, all_to_all_v_2d_offset
from .expert_parallel import EPBuffer, EPHandle
from .moe_reduce import MoEReduceScatter, moe_rs
from .tp_routing import MoEHandle

__all__ = ["AllToAllV", "all_to_all_v", "all_to_all_v_2d", "all_to_all_v_2d_offset", "EPBuffer", "EPHandle",
           "AllGatherMoE", "ag_moe", "MoEReduceScatter", "moe_rs", "MoEHandle"]
