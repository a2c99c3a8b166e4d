"""The kernel library, grouped by family: [`collectives`][tridist.ops.collectives] (all-gather,
reduce-scatter, all-reduce), [`gemm`][tridist.ops.gemm] (the persistent GEMM and the GEMMs
overlapped with communication, and the grouped GEMM of MoE layers), [`moe`][tridist.ops.moe]
(expert-parallel all-to-alls and dispatch/combine, tensor-parallel MoE layers),
[`attention`][tridist.ops.attention] (flash decoding over a KV cache split across ranks),
[`norm`][tridist.ops.norm] (the all-reduce, residual add and RMSNorm of a decoder layer, fused) and
[`stencil`][tridist.ops.stencil] (a Jacobi solver whose halo exchange runs inside its kernels).
Each family is a folder: a thin front per op (check, choose, method), a `policy` module, a module
per method; what the families share sits beside them (`protocol`, `checks`, `instances`, `sizing`,
`copy_engines`, `sync`, `method`, `ranks`). The [architecture](../guide/architecture.md) page walks
through it.

What holds for every op:

- **A function and a class.** The functions (`all_gather(x)`, ...) keep one instance of their
  op per shape, dtype, method and stream, built at the first call. The classes
  (`AllGather(numel, dtype)`, ...) are those instances: build one on every rank at once (it
  allocates symmetric memory), call it any number of times on one stream, and `free()` it (on
  every rank) to give its buffers back. One instance must not serve two streams at once.
- **Collective.** Every rank calls an op with the same shapes, dtypes and options, in the same
  order, also when the calls are on several streams. The ops start on the GPU in the order they
  were called, whatever their streams ([`call_order`][tridist.ops.call_order]: an op called on
  another stream than the previous op waits for what that stream had queued), since a kernel
  that waits holds its SMs: if one rank started op A's kernel and a peer op B's, each could wait
  for a kernel its peer has no room to start. So two ops on two streams do not overlap each other;
  each overlaps compute on other streams as before. Kernels whose programs wait on each other
  (`gemm_rs`, the `2d` all-gather across nodes) launch co-resident (`kernel[grid](...,
  coresident=True)`, see `tridist.coresident_programs`) and shrink their persistent grid to what
  can be resident at their first call, also when ranks share a GPU.
- **Within a process group: `group=`.** Every op function and class but the local `matmul`,
  `grouped_gemm` and `linear` takes `group=None`, its last keyword argument: a `torch.distributed.ProcessGroup`
  (`dist.new_group(ranks)`, a DeviceMesh's `mesh.get_group("tp")`) or a
  [`tridist.Group`][tridist.Group], None for the world. The op then runs among the group's members
  only, as if they were the world: "rank" and "world size" in every op's documentation are the
  group's (rank r of the group, the group's size of shards, `in_splits` entries, experts' ranks),
  its buffers are allocated by the members only, and "every rank" of the rules here means every
  member. Other groups run their own ops at the same time, on their own data, and the ranks
  outside a group neither take part nor wait. A group within one node reaches its members
  through pointers; one across nodes (as many members on each) through NVSHMEM, like a world of
  several nodes (so the one-node methods refuse it). A rank passing a group it is not a member of
  gets a `ValueError` before anything is allocated or launched; members passing different groups
  are caught with the other arguments they must share. Each group's instances are its own (the
  functions key theirs on the group). For example: `all_reduce(x, group=tp)`, `all_gather(x,
  group=tp)`, `reduce_scatter(x, group=tp)`, `ag_gemm(a_shard, b, group=tp)`, `gemm_rs(a, b,
  group=tp)`, `gemm_ar(a, b, group=tp)`, `all_to_all_v(x, in_splits, out, group=ep)`,
  `EPBuffer(num_experts, hidden, max_tokens_per_rank, group=ep)` (the experts spread over the
  group's ranks), `ag_moe(x_shard, topk_idx_shard, w_shard, group=tp)`, `moe_rs(h, w_shard, handle,
  topk_weights_shard, group=tp)`, `flash_decode(q, k_cache, v_cache, seqlens, group=sp)`,
  `Jacobi2D(rows, cols, group=g)`.
- **Back to back, and in CUDA graphs.** Calls need no host synchronisation: each instance counts
  its calls on the device (call epochs) and alternates two sets of buffers and flags. Ops can be
  captured in CUDA graphs (no host sync, allocation or `.item()` inside a call). A function's
  first call on a stream builds its instance, which allocates symmetric memory and so cannot
  happen during a capture: call it once on the capture stream first (`torch.cuda.graph(g,
  stream=s)` after a warm-up on `s`), or capture an instance of the class.
- **`method="auto"`** picks by size and topology from crossovers measured on H200s (written down
  in `choose_all_gather`, `choose_reduce_scatter`, `choose_all_reduce` and `choose_gemm_ar`, listed
  on the family pages). Methods marked "one node" reach peers through pointers or copy engines
  and refuse worlds of several nodes.
- **Symmetric tensors are used in place.** Where an op takes a symmetric tensor (from
  `tridist.symm_empty`: `all_gather`'s `out`, `all_reduce`'s `x` with `out=x`), every rank must
  pass a symmetric tensor, the same one, or none; in the emulator and with `TRIDIST_DEBUG=1` a
  mismatch raises on every rank.
- **Bad input fails before any launch, on every rank**, with a `ValueError` (a `TypeError` for a
  non-tensor) that says what to change: dtype, device, layout, shape, method, a one-node method on
  several nodes. Each op indexes its buffers with 32-bit offsets and refuses a size that would
  pass 2^31 elements. The ranks check together (`checks.agree`): every rank learns every
  rank's outcome and raises the same error, naming the rank(s) and what they passed, also where
  ranks pass shapes, dtypes or options that differ. See "What each op checks" below.
- **Empty is allowed.** Zero-size inputs are normal wherever the result is defined: empty
  tensors on every rank make the collectives no-ops that return empty results (in every method,
  eager and captured), a rank of `all_to_all_v` or `EPBuffer` may send or receive nothing, and
  an `EPBuffer` rank may have no tokens.

## What each op checks

| where | when | what |
| --- | --- | --- |
| host, this rank | every call | the arguments' types, dtypes, devices, layouts, shapes, options, sizes |
| host, every rank together | in the emulator and with `TRIDIST_DEBUG=1` every call; on GPUs otherwise at the first call of each new shape (which builds the op's instance, a collective anyway), so that later calls take no host round trip; never while a CUDA graph is captured | that no rank's arguments failed, and that every rank passed the same shapes, dtypes and options (and the same symmetric tensor, where one is taken) |
| host, values | where reading them costs no synchronisation (CPU tensors: the emulator) or one is allowed (`TRIDIST_DEBUG=1`, not while a graph is captured) | `EPBuffer`: expert ids in -1 ... E-1; `ag_moe`: expert ids in 0 ... E-1; `grouped_gemm`: `offs` non-decreasing within the rows of x; `flash_decode`: `seqlens` within the cache, and the block-table entries they use within its blocks |
| device (`dl.check`) | always in the emulator (`DeviceCheckError`); on GPUs with `TRIDIST_DEBUG=1` (one line, then a trap) | `all_to_all_v*`: splits that reach past the rows of x, more rows arriving than `out` holds; `EPBuffer.low_latency_dispatch`: more pairs for one expert from one rank than `max_tokens_per_rank` (a token routed twice to an expert) |

Where a value is not checked (GPUs without `TRIDIST_DEBUG`), each op still does something
defined, never an access outside its buffers but where said: `EPBuffer` treats an expert id out of
range as -1 (the token is not sent to that expert) and counts it in `EPBuffer.dropped_expert_ids`;
`ag_moe` drops it likewise (the pair goes to no expert and has no row of h; `moe_rs` leaves it out
of its token's sum) and counts it in `AllGatherMoE.dropped_expert_ids` (also the handle's
`dropped_expert_ids`); `grouped_gemm` clamps `offs` into the rows of x (out-of-order ends give wrong
products, never an access outside x or out); the `all_to_all_v` family drops the rows past `out`
(the returned splits still say how many came) and sends no row past x; the low-latency dispatch
drops the pairs past `max_tokens_per_rank`; `flash_decode` reads whatever memory a `seqlens` or
block-table entry out of range points at.
- **`torch.compile`.** Importing `tridist.ops` registers the functions as PyTorch custom ops,
  with shape-only fake implementations so that `torch.compile` can trace through them:
  `torch.ops.tridist.all_gather(x, method="auto")`,
  `torch.ops.tridist.reduce_scatter(x, method="auto")`,
  `torch.ops.tridist.all_reduce(x, method="auto")`, `torch.ops.tridist.all_reduce_(x, method="auto")` (in
  place, declared as mutating x),
  `torch.ops.tridist.ag_gemm(a_shard, b, comm="auto")`, `torch.ops.tridist.gemm_rs(a, b)`,
  `torch.ops.tridist.gemm_ar(a, b, method="auto")` (the GEMMs also with `scale_a`, `scale_b` for
  fp8), the MoE and all-to-all ops (their family pages list them), and a decoder layer's local
  ops: `torch.ops.tridist.linear(x, weight, bias=None, activation=None)`,
  `torch.ops.tridist.rotary_qkv(qkv, cos, sin, num_heads, num_kv_heads, q_norm=None, k_norm=None,
  eps=1e-6)`, `torch.ops.tridist.rotary_qkv_cache(..., num_kv_heads, k_cache, v_cache, index,
  q_norm=None, k_norm=None, eps=1e-6)` (k and v written into the caches, declared as mutating them;
  returns q), `torch.ops.tridist.decode_attention(q, k_cache, v_cache, seqlens, block_table=None,
  sm_scale=None, mask=None)`, `add_rms_norm` and `all_reduce_rms_norm`; all in
  [`torch_ops`][tridist.ops.torch_ops]. Each returns new tensors (no `out=`, nothing in place) but
  `all_reduce_` and `rotary_qkv_cache`, the GEMMs run their default config, and all of them run on
  the world.
"""
from .attention import FlashDecode, decode_attention, flash_decode, rotary_qkv
from .collectives import AllGather, AllReduce, ReduceScatter, all_gather, all_reduce, all_reduce_, reduce_scatter
from .gemm import (AllGatherGEMM, GemmAllReduce, GemmReduceScatter, Linear, ag_gemm, gemm_ar, gemm_rs, grouped_gemm,
                   linear, matmul)
from .moe import (AllGatherMoE, AllToAllV, EPBuffer, EPHandle, MoEHandle, MoEReduceScatter, ag_moe, all_to_all_v,
                  all_to_all_v_2d, all_to_all_v_2d_offset, moe_local, moe_route, moe_rs)
from .norm import AllReduceRMSNorm, add_rms_norm, all_reduce_rms_norm
from .stencil import Jacobi2D, jacobi_reference
from . import torch_ops  # noqa: F401,E402 - registers torch.ops.tridist.*

__all__ = ["AllGatherGEMM", "ag_gemm", "AllGather", "all_gather", "AllReduce", "all_reduce", "all_reduce_",
           "ReduceScatter", "reduce_scatter", "matmul", "GemmReduceScatter", "gemm_rs", "GemmAllReduce", "gemm_ar",
           "grouped_gemm", "AllToAllV", "all_to_all_v", "all_to_all_v_2d", "all_to_all_v_2d_offset", "EPBuffer",
           "EPHandle", "AllGatherMoE", "ag_moe", "MoEReduceScatter", "moe_rs", "MoEHandle", "moe_local",
           "moe_route", "FlashDecode",
           "flash_decode", "decode_attention", "rotary_qkv", "Jacobi2D", "jacobi_reference", "Linear", "linear",
           "AllReduceRMSNorm", "all_reduce_rms_norm", "add_rms_norm"]
