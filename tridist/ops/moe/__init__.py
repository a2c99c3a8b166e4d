"""Mixture of experts, a folder per kind of op, each holding its fronts and their methods:

Expert parallel (each rank holds some experts, tokens travel to them):
- `all_to_all`: `all_to_all_v`, `all_to_all_v_2d`, `all_to_all_v_2d_offset` (`AllToAllV`):
  all-to-all-v with the splits on the device, in PyTorch's `all_to_all_vdev*` layouts;
- `expert_parallel`: `EPBuffer`, dispatch and combine for top-k routing, normal and low-latency
  modes (DeepEP's API).

Tensor parallel (every rank holds a slice of every expert), `tensor_parallel`: `ag_moe`
(all-gather + grouped GEMM) and `moe_rs` (grouped GEMM + top-k sum + reduce-scatter), with the
routing they share.

Local (every expert on this rank, no exchange), `local`: `moe_route` (softmax, top-k and
renormalisation in one kernel) and `moe_local` (the experts' gated MLPs, weighted and summed per
token, in two kernels).

Process groups: every op takes `group=None` (the last argument): a `torch.distributed` process group
(`dist.new_group(ranks)`, a DeviceMesh's `get_group("ep")`), a `tridist.Group`, or None for the
world. The op then runs among the group's members alone, which are its world: rank r is rank r of
the group, splits and experts are spread over group.size() ranks (`EPBuffer(..., group=ep)`: rank r
of the group holds experts r * E_local ... (r + 1) * E_local - 1), and other groups may run their
own calls at the same time. A rank outside the group gets a ValueError before anything is
allocated or launched.

What expert and tensor parallelism share: the all-to-alls' protocol and device helpers (`_exchange`), a stable
counting sort on the device that both families route with (`_sort`: each token's or pair's place
among those of its rank or expert), and the family's choices (`policy`).

Custom ops for `torch.compile`: `torch.ops.tridist.all_to_all_v(x, in_splits, out_rows)`,
`all_to_all_v_2d(x, in_splits, out_rows, major_align=1)` and
`all_to_all_v_2d_offset(x, in_splits_offsets, out_rows)` return `(out, out_splits_offsets)`;
`torch.ops.tridist.ag_moe` and `moe_rs` as their functions; all of them on the world (they take no
group).
"""
from .all_to_all.op import AllToAllV, all_to_all_v, all_to_all_v_2d, all_to_all_v_2d_offset
from .expert_parallel.buffer import EPBuffer, EPHandle
from .tensor_parallel.ag_moe import AllGatherMoE, ag_moe
from .tensor_parallel.moe_rs import MoEReduceScatter, moe_rs
from .tensor_parallel.routing import MoEHandle
from .local import moe_local, moe_route

__all__ = ["AllToAllV", "all_to_all_v", "all_to_all_v_2d", "all_to_all_v_2d_offset", "EPBuffer", "EPHandle",
           "AllGatherMoE", "ag_moe", "MoEReduceScatter", "moe_rs", "MoEHandle", "moe_local", "moe_route"]
