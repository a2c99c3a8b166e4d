"""Tensor- and expert-parallel layers over tridist's kernels, tridist's own decoder layer, and
`parallelize`, which runs a Hugging Face `transformers` decoder with them (also on one GPU).

- [`parallelize(model, group=None, moe="ep")`][tridist.nn.parallelize]: a `LlamaForCausalLM`,
  `Qwen3ForCausalLM` or `Qwen3MoeForCausalLM` run by tridist's decoder layers, sharded in place;
  its logits stay those of the whole model, on every rank, and transformers' `generate` works
  with its dynamic and static caches.
- [`ParallelDecoderLayer`][tridist.nn.ParallelDecoderLayer] (`tridist.nn.decoder`): attention
  (`ParallelAttention`: one QKV GEMM, `rotary_qkv`, `decode_attention` over the cache in place)
  and MLP (`ParallelGatedMLP`, or an MoE block), each row-parallel sum fused with the next norm
  (`ops.all_reduce_rms_norm`); model families as plans in `tridist.nn.families`.
- [`ColumnParallelLinear`][tridist.nn.ColumnParallelLinear] and
  [`RowParallelLinear`][tridist.nn.RowParallelLinear]: a linear layer split by output columns or
  by input rows (`ops.linear`, `ag_gemm`, `gemm_rs`, `all_reduce`).
- [`ExpertParallelMoE`][tridist.nn.ExpertParallelMoE] (`EPBuffer` + `grouped_gemm`) and
  [`TensorParallelMoE`][tridist.nn.TensorParallelMoE] (`ag_moe` + `moe_rs`): MoE layers of gated
  experts.
- [`DecodeAttention`][tridist.nn.DecodeAttention]: decode attention over a KV cache split by
  position across the ranks (`flash_decode`).

Every layer is built on every rank at once (their kernels allocate symmetric memory), and its calls
are collectives: every rank calls it with the same shapes, in the same order. Every layer and
`parallelize` take `group=`: a `torch.distributed.ProcessGroup` (`dist.new_group(ranks)`, a
DeviceMesh's `mesh.get_group("tp")`) or `tridist.Group` whose members split the layer among
themselves, passed on to every op the layer calls; "every rank" and "the world size" are then its
members and their number, and the other ranks take no part (they may run their own groups' layers
at the same time). None, the default, is the world.
"""
from .attention import DecodeAttention
from .decoder import ParallelAttention, ParallelDecoderLayer, ParallelGatedMLP
from .linear import ColumnParallelLinear, RowParallelLinear
from .moe import ExpertParallelMoE, ParallelSparseMoeBlock, TensorParallelMoE
from .parallelize import parallelize

__all__ = ["parallelize", "ParallelDecoderLayer", "ParallelAttention", "ParallelGatedMLP", "ColumnParallelLinear",
           "RowParallelLinear", "ExpertParallelMoE", "TensorParallelMoE", "ParallelSparseMoeBlock", "DecodeAttention"]
