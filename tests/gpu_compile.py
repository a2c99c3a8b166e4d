"""Compiles kernels for a Hopper GPU (sm_90) on a machine without one: `python -m tests.gpu_compile`.

Catches type and lowering errors of the GPU path (inline PTX, NVSHMEM declarations, linking
libnvshmem_device.bc, ptxas) before any GPU time is spent. Each case names a kernel, its argument
types and its constexprs; the module is run in a subprocess by tests/test_gpu_compile.py because
the backend is fixed when tridist is imported.

    python -m tests.gpu_compile [NAME...]              every case, or those of the kernels named
    python -m tests.gpu_compile --ptx DIR [NAME...]    the same, and each case's PTX in DIR/<case>.ptx
    python -m tests.gpu_compile --compare NAME...      whole against cut device library (one line each)

`--ptx` writes the PTX without its debug information (`normalised_ptx`), so that a kernel moved to
another file, or a line moved, gives the same file: `diff -r` of two such folders shows only what
changed in the code. A case's file is named after its kernel (`case_names`); DIR/cases.txt says
which constexprs each name stands for.
"""
import concurrent.futures
import functools
import multiprocessing
import os
import re
import sys
import tempfile
import time

os.environ["TRIDIST_BACKEND"] = "nvshmem"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tridist.bench import primitives  # noqa: E402
from tridist.ops import sync, protocol, sizing# noqa: E402
from tridist.ops.attention import combine, rotary, split_kv  # noqa: E402
from tridist.ops.attention import policy as attention_policy  # noqa: E402
from tridist.ops.collectives import _copy_engine, _packets, allgather, allreduce, reducescatter  # noqa: E402
from tridist.ops.gemm import allgather_gemm, shard_gather  # noqa: E402
from tridist.ops.gemm.gemm_all_reduce import ll as gemm_ar_ll, one_shot as gemm_ar_one_shot  # noqa: E402
from tridist.ops.gemm.gemm_reduce_scatter import one_shot as gemm_rs_one_shot, two_d as gemm_rs_two_d  # noqa: E402
from tridist.ops.gemm import grouped  # noqa: E402
from tridist.ops.gemm.linear_gemm import policy as linear_policy, split_k  # noqa: E402
from tridist.ops.gemm import persistent as gemm  # noqa: E402
from tridist.ops.moe import _exchange as exchange  # noqa: E402
from tridist.ops.moe import _sort as sort  # noqa: E402
from tridist.ops.moe.all_to_all import staged as alltoall  # noqa: E402
from tridist.ops.moe.expert_parallel import _staging as ep_staging  # noqa: E402
from tridist.ops.moe.expert_parallel import low_latency as ep_low_latency  # noqa: E402
from tridist.ops.moe.expert_parallel import normal as ep_normal  # noqa: E402
from tridist.ops.moe.local import experts as local_experts, policy as local_policy, router as local_router  # noqa: E402
from tridist.ops.moe.tensor_parallel import ag_moe, moe_rs  # noqa: E402
from tridist.ops.moe.tensor_parallel import routing as tp_routing  # noqa: E402
from tridist.ops.norm import ll as norm_ll, local as norm_local, one_shot as norm_one_shot  # noqa: E402
from tridist.ops.norm import policy as norm_policy  # noqa: E402
from tridist.ops.stencil import fused as jacobi_fused, host_loop as jacobi_host_loop  # noqa: E402
from tridist.ops.stencil import policy as stencil_policy  # noqa: E402
from tridist.runtime import device_library  # noqa: E402
from tridist.runtime.nvshmem import find_device_library  # noqa: E402

from . import test_groups as groups  # noqa: E402
from . import test_language as lang  # noqa: E402
from . import test_shmem as shmem  # noqa: E402
from .harness import load_script  # noqa: E402

CUDA = torch.device("cuda")


def _gemm_cases():
    """The GEMM kernels at the GPU's configs of the big tile (FLATTEN on and off), TMA descriptors
    included, for bf16 operands and for fp8 (b's descriptor over its transpose, scales)."""
    cases = []
    for dtype in (torch.bfloat16, gemm.FP8):
        fp8 = dtype == gemm.FP8
        for config in [c for c in gemm.configs(CUDA, dtype=dtype) if (c["BLOCK_M"], c["BLOCK_N"]) == (128, 256)]:
            flat = config["FLATTEN"]
            config = dict(config)
            options = {"num_warps": config.pop("num_warps"), "num_stages": config.pop("num_stages")}
            element = "fp8e4nv" if fp8 else "bf16"
            a = f"tensordesc<{element}[{config['BLOCK_M']}, {config['BLOCK_K']}]>"
            b_block = (config["BLOCK_N"], config["BLOCK_K"]) if fp8 else (config["BLOCK_K"], config["BLOCK_N"])
            b = f"tensordesc<{element}[{b_block[0]}, {b_block[1]}]>"
            operands = {"a_desc": a, "b_desc": b, "scale_a_ptr": "*fp32" if fp8 else "constexpr",
                        "scale_b_ptr": "*fp32" if fp8 else "constexpr"}
            if not fp8:  # no scales: the kernels specialise on None
                config.update(scale_a_ptr=None, scale_b_ptr=None)
            blocks = {name: "constexpr" for name in config if name.isupper()}
            world = {"group": "constexpr"}  # the overlapped GEMMs' kernels, for the world (group None)
            collective = {**config, "group": None}
            ag_flags = (("*i32", 1, False), ("*i64", 4, True))
            cases += [
                (gemm.matmul_kernel, {**operands, "out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", **blocks},
                 config, options),
                *[(allgather_gemm.ag_gemm_kernel, {"own_desc": a, **operands, "out_ptr": "*bf16", "flags_ptr": flags,
                                                   "calls_ptr": "*i64", "m_shard": "i32", "N": "i32", "K": "i32",
                                                   "slot_rows": "i32", "FLAGS_PER_SHARD": "constexpr",
                                                   "EPOCH_FLAGS": "constexpr", **blocks, **world},
                   {"FLAGS_PER_SHARD": per_shard, "EPOCH_FLAGS": epochs, **collective}, options)
                  for flags, per_shard, epochs in ag_flags],
                *[(kernel, {**operands, "out_ptr": "*bf16", "tiles_ptr": "*bf16", "flags_ptr": "*i64",
                            "calls_ptr": "*i64", "M": "i32", "N": "i32", "K": "i32", "local_world_size": "i32",
                            **blocks, **world}, collective, options)
                  for kernel in ((gemm_rs_one_shot.gemm_rs_kernel,) if flat else
                                 (gemm_rs_one_shot.gemm_rs_kernel, gemm_ar_one_shot.gemm_ar_kernel))],
                *[(gemm_ar_ll.gemm_ar_ll_kernel, {**operands, "out_ptr": "*i32", "own_ptr": "*bf16",
                                                  "packets_ptr": "*i64", "calls_ptr": "*i64", "M": "i32", "N": "i32",
                                                  "K": "i32", "row": "i32", "slot_numel": "i32",
                                                  "DTYPE": "constexpr", "STEP": "constexpr", **blocks, **world},
                   {"DTYPE": tl.bfloat16, "STEP": 2048, **collective}, options) for _ in (() if flat else (1,))],
                *[(gemm_rs_two_d.gemm_rs_2d_kernel, {**operands, "out_ptr": "*bf16", "tiles_ptr": "*bf16",
                                                     "flags_ptr": "*i64", "calls_ptr": "*i64", "M": "i32", "N": "i32",
                                                     "K": "i32", "local_world_size": "i32", **blocks, **world},
                   collective, options)
                  for _ in (() if flat else (1,))],
            ]
    return cases


def _gemm_group_cases():
    """The overlapped GEMMs' kernels within a group (`group` a `tridist.Group`, a pointer to its
    int32 table): each kernel's first case of the world's (bf16, FLATTEN where it takes it), its
    `group` a pointer instead of None."""
    firsts = {}
    for kernel, signature, constexprs, options in _gemm_cases():
        if "group" in signature:
            firsts.setdefault(kernel, (kernel, {**signature, "group": "*i32"},
                                       {name: value for name, value in constexprs.items() if name != "group"},
                                       options))
    return list(firsts.values())


def _tutorial_cases():
    """The kernels of tutorials/, which users run on GPUs as they are."""
    t = {name[:2]: load_script("tutorials", name) for name in (
        "01-signals-and-waits", "02-all-gather-push-pull", "03-all-gather-across-nodes", "04-low-latency-packets",
        "05-reduce-scatter", "06-allgather-gemm", "07-gemm-reduce-scatter", "11-groups")}
    queue = {"queue_ptr": "*fp32", "full_ptr": "*i64", "free_ptr": "*i64"}
    sizes = {"SLOTS": "constexpr", "ITEM": "constexpr"}
    gemm = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32}
    return [
        (t["01"].produce, {**queue, "first": "i32", "items": "i32", "consumer": "i32", **sizes}, {"SLOTS": 4, "ITEM": 64}),
        (t["01"].consume, {**queue, "out_ptr": "*fp32", "first": "i32", "items": "i32", "producer": "i32", **sizes},
         {"SLOTS": 4, "ITEM": 64}),
        (t["02"].all_gather_push, {"shard_ptr": "*fp32", "out_ptr": "*fp32", "flags_ptr": "*i64", "n": "i32",
                                   "epoch": "i32", "BLOCK": "constexpr"}, {"BLOCK": 256}),
        (t["02"].all_gather_pull, {"shard_ptr": "*fp32", "out_ptr": "*fp32", "staging_ptr": "*fp32",
                                   "flags_ptr": "*i64", "n": "i32", "epoch": "i32", "BLOCK": "constexpr"},
         {"BLOCK": 256}),
        (t["03"].all_gather_puts, {"out_ptr": "*fp32", "flags_ptr": "*i64", "n": "i32", "epoch": "i32"}, {}),
        (t["03"].all_gather_2d, {"out_ptr": "*fp32", "flags_ptr": "*i64", "n": "i32", "epoch": "i32",
                                 "local_world_size": "i32", "BLOCK": "constexpr"}, {"BLOCK": 256}),
        (t["04"].all_reduce_ll, {"x_ptr": "*fp32", "out_ptr": "*fp32", "packets_ptr": "*i64", "n": "i32",
                                 "epoch": "i32", "BLOCK": "constexpr"}, {"BLOCK": 512}),
        (t["05"].reduce_scatter, {"x_ptr": "*bf16", "out_ptr": "*bf16", "staging_ptr": "*bf16", "flags_ptr": "*i64",
                                  "calls_ptr": "*i64", "m": "i32", "BLOCK": "constexpr"}, {"BLOCK": 256}),
        (t["06"].ag_gemm, {"a_shard_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*fp32", "gathered_ptr": "*bf16",
                           "flags_ptr": "*i64", "m_shard": "i32", "N": "i32", "K": "i32", "epoch": "i32",
                           **{name: "constexpr" for name in (*gemm, "COPY_BLOCK")}}, {**gemm, "COPY_BLOCK": 1024}),
        (t["07"].gemm_rs, {"a_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*fp32", "partials_ptr": "*fp32",
                           "flags_ptr": "*i64", "rows_per_rank": "i32", "N": "i32", "K": "i32", "epoch": "i32",
                           **{name: "constexpr" for name in gemm}}, gemm),
        (t["11"].all_gather_push, {"shard_ptr": "*fp32", "out_ptr": "*fp32", "flags_ptr": "*i64", "n": "i32",
                                   "epoch": "i32", "group": "*i32", "BLOCK": "constexpr"}, {"BLOCK": 256}),
    ]


def _group_cases():
    """Kernels within a process group (a `tridist.Group` argument, a pointer to its int32 table):
    through symm_at and notify, through a put with signal, and dl.shmem's other forms."""
    return [
        *[(groups.group_allgather_kernel, {"shard_ptr": "*i64", "out_ptr": "*i64", "flags_ptr": "*i64", "n": "i32",
                                           "epoch": "i32", "group": "*i32", "ACROSS": "constexpr",
                                           "BLOCK": "constexpr"}, {"ACROSS": across, "BLOCK": 64})
          for across in (False, True)],
        (groups.group_forms_kernel, {"words_ptr": "*i64", "counter_ptr": "*i64", "out_ptr": "*i64", "group": "*i32"},
         {}),
        (groups.group_get_kernel, {"words_ptr": "*i64", "out_ptr": "*i64", "group": "*i32"}, {}),
    ]


def _shipped(configs, decode: bool = True):
    """Of a grouped GEMM's configs, those the cases compile: the big tile with FLATTEN and without
    (as `_gemm_cases`), and the first decode tile."""
    big = [c for c in configs if (c["BLOCK_M"], c["BLOCK_N"]) == (128, 256)]
    return big + [c for c in configs if c["BLOCK_M"] == 64 and c["GROUP_M"] == 1][:1 if decode else 0]


def _grouped_cases():
    """The grouped GEMM at its big tile (FLATTEN on and off) and its decode tile, for bf16 and for
    fp8 (w's descriptor over its transpose per expert, scales)."""
    cases = []
    for dtype in (torch.bfloat16, gemm.FP8):
        fp8 = dtype == gemm.FP8
        element = "fp8e4nv" if fp8 else "bf16"
        for config in _shipped(grouped.configs(CUDA, dtype)):
            config = dict(config)
            options = {"num_warps": config.pop("num_warps"), "num_stages": config.pop("num_stages")}
            w_block = (config["BLOCK_N"], config["BLOCK_K"]) if fp8 else (config["BLOCK_K"], config["BLOCK_N"])
            signature = {"x_desc": f"tensordesc<{element}[{config['BLOCK_M']}, {config['BLOCK_K']}]>",
                         "w_desc": f"tensordesc<{element}[1, {w_block[0]}, {w_block[1]}]>",
                         "scale_a_ptr": "*fp32" if fp8 else "constexpr", "scale_b_ptr": "*fp32" if fp8 else "constexpr",
                         "out_ptr": "*bf16", "offs_ptr": "*i32", "T": "i32", "E": "i32", "N": "i32", "K": "i32",
                         "E_PAD": "constexpr", "ZERO_TAIL": "constexpr", **{name: "constexpr" for name in config}}
            constexprs = {"E_PAD": 256 if fp8 else 32, "ZERO_TAIL": False, **config}
            if not fp8:
                constexprs.update(scale_a_ptr=None, scale_b_ptr=None)
            cases.append((grouped.grouped_gemm_kernel, signature, constexprs, options))
    return cases


def _linear_cases():
    """The decode GEMM (`linear`) at each of its policy's GPU configs, for the most rows each takes:
    plain with several splits (partials, counters) and with one, swiglu with several and a bias."""
    cases = []
    for most_rows, plain, fused in linear_policy.GPU_CONFIGS:
        for config, swiglu, split in ((plain, False, True), (plain, False, False), (fused, True, True)):
            signature = {"x_ptr": "*bf16", "w_ptr": "*bf16",
                         "w_desc": f"tensordesc<bf16[{config['BLOCK_N']}, {config['BLOCK_K']}]>" if config["TMA"]
                         else "constexpr", "bias_ptr": "*bf16" if swiglu else "constexpr", "out_ptr": "*bf16",
                         "partials_ptr": "*fp32" if split else "constexpr",
                         "counters_ptr": "*i32" if split else "constexpr",
                         **{name: "i32" for name in ("M", "N", "ROWS", "K", "stride_xm", "k_per_split")},
                         "splits": "i32" if split else "constexpr",
                         **{name: "constexpr" for name in ("SWIGLU", "DOT", "BLOCK_M", "BLOCK_N", "BLOCK_K")}}
            constexprs = {"SWIGLU": swiglu, "DOT": config["DOT"], "BLOCK_M": split_k.block_m(most_rows, config["DOT"]),
                          "BLOCK_N": config["BLOCK_N"], "BLOCK_K": config["BLOCK_K"]}
            constexprs.update({name: None for name, ty in signature.items() if ty == "constexpr" and
                               name not in constexprs and name != "splits"})
            if not split:
                constexprs["splits"] = 1
            cases.append((split_k.linear_split_k_kernel, signature, constexprs,
                          {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}))
    return cases


def _moe_cases():
    """The tensor-parallel MoE kernels: the routing, ag_moe's GEMM (at the configs of `_shipped`,
    with the copy-engine flags in both tile orders, and at the first with the epoch flags of
    comm="sm"), moe_rs's GEMM (in both orders) and its two combines."""
    cases = [(tp_routing.route_kernel, {"idx_ptr": "*i64", "sorted_ptr": "*i32", "exchange_ptr": "*i32",
                                        "flags_ptr": "*i64", "calls_ptr": "*i64", "layout_ptr": "*i32",
                                        "pairs": "i32", "E": "i32", "row": "i32", "slot_numel": "i32",
                                        "local_world_size": "i32", "E_PAD": "constexpr"},
              {"E_PAD": 256}, {"num_warps": 8})]
    for index, config in enumerate(_shipped(grouped.configs(CUDA, torch.bfloat16))):
        config = dict(config)
        options = {"num_warps": config.pop("num_warps"), "num_stages": config.pop("num_stages")}
        blocks = {name: "constexpr" for name in config}
        w_desc = f"tensordesc<bf16[1, {config['BLOCK_K']}, {config['BLOCK_N']}]>"
        for flags, per_shard, epochs, by_expert in (("*i32", 1, False, False), ("*i32", 1, False, True),
                                                    ("*i64", 4, True, False))[:3 if index == 0 else 2]:
            cases.append((ag_moe.ag_moe_kernel,
                          {"x_ptr": "*bf16",
                           "gathered": ag_moe.Gathered(rows="*bf16", flags=flags, calls="*i64", slot_rows="i32"),
                           "w_desc": w_desc, "out_ptr": "*bf16",
                           "segments": ag_moe.Segments(pair_of_row="*i32", counts="*i32", base="*i32"),
                           "tokens": "i32", "N": "i32", "K": "i32", "TOPK": "constexpr", "W_PAD": "constexpr",
                           "E_PAD": "constexpr", "FLAGS_PER_SHARD": "constexpr", "EPOCH_FLAGS": "constexpr",
                           "BY_EXPERT": "constexpr", **blocks},
                          {"TOPK": 2, "W_PAD": 8, "E_PAD": 32, "FLAGS_PER_SHARD": per_shard, "EPOCH_FLAGS": epochs,
                           "BY_EXPERT": by_expert, **config}, options))
        # moe_rs counts its tiles (COUNT) by source with peers, flattened or not; by expert or at one rank not.
        cases += [(moe_rs.moe_rs_gemm_kernel,
                   {"h_desc": f"tensordesc<bf16[{config['BLOCK_M']}, {config['BLOCK_K']}]>", "w_desc": w_desc,
                    "products_ptr": "*bf16", "counts_ptr": "*i32", "base_ptr": "*i32", "done_ptr": "*i64",
                    "calls_ptr": "*i64", "N": "i32", "K": "i32", "COUNT": "constexpr", "W_PAD": "constexpr",
                    "E_PAD": "constexpr", "BY_EXPERT": "constexpr", "ZERO_TAIL": "constexpr", **blocks},
                   {"COUNT": count, "W_PAD": 8, "E_PAD": 256, "BY_EXPERT": by_expert, "ZERO_TAIL": False, **config},
                   options)
                  for count, by_expert in ((False, False), (True, False), (False, True))
                  if count or config["FLATTEN"]]
    combine = {"gemm": moe_rs.Products(products="*bf16", done="*i64", tiles_n="i32"), "row_of_pair_ptr": "*i32",
               "counts_ptr": "*i32", "weights_ptr": "*fp32",
               "staging": moe_rs.CombineStaging(partials="*bf16", send="*bf16", exchange="*fp32", weights_row="i32",
                                                flags="*i64", calls="*i64", slot_numel="i32"),
               "out_ptr": "*bf16"}
    combine.update({name: "i32" for name in ("tokens", "K", "local_world_size", "spans", "span")})
    combine.update({name: "constexpr" for name in ("TOPK", "GEMM_BLOCK_M", "OWN", "W_PAD", "E_PAD", "BY_EXPERT",
                                                   "CHUNK", "BLOCK_C")})
    cases += [(moe_rs.moe_combine_kernel, dict(combine),
               {"TOPK": 8, "GEMM_BLOCK_M": 128, "OWN": own, "W_PAD": 8, "E_PAD": 32, "BY_EXPERT": by_expert,
                "CHUNK": moe_rs.CHUNK["cuda"], "BLOCK_C": moe_rs.BLOCK_C["cuda"]})
              for own, by_expert in ((False, False), (False, True), (True, False))]
    return cases


def _local_moe_cases():
    """The local MoE at Qwen3-30B-A3B's sizes (128 experts, top-8): the router; both kernels of the
    experts with the dense rows of a batch of 8 and with the sorted rows of prefill, at the tiles
    `local.policy` gives them; the sorted rows' order."""
    routing = local_experts.Routing(idx="*i64", weights="*fp32", order="*i32", offs="*i32", experts="i32")
    sizes = {name: "i32" for name in ("tokens", "hidden", "inner")}
    pads = {"TOPK": 8, "E_PAD": 128, "K_PAD": 8}
    cases = [(local_router.moe_route_kernel,
              {"logits_ptr": "*bf16", "idx_ptr": "*i64", "weights_ptr": "*fp32", "tokens": "i32", "E": "i32",
               **{name: "constexpr" for name in ("TOPK", "NORM", "DTYPE", "PRECISE", "E_PAD", "K_PAD", "BLOCK_T")}},
              {"TOPK": 8, "NORM": True, "DTYPE": tl.bfloat16, "PRECISE": True, "E_PAD": 128, "K_PAD": 8,
               "BLOCK_T": local_router.ROUTE_TOKENS}),
             (local_experts.moe_order_kernel, {"idx_ptr": "*i64", "positions_ptr": "*i32", "offs_ptr": "*i32",
                                               "order_ptr": "*i32", "pairs": "i32", "E": "i32", "BLOCK": "constexpr"},
              {"BLOCK": local_experts.ORDER_BLOCK})]
    dense_up = {"BLOCK_M": local_policy.dense_rows(8), "BLOCK_N": local_policy.DENSE_UP_COLUMNS[0],
                "BLOCK_K": local_policy.DENSE_BLOCK_K, "GROUP_M": 1, "num_warps": 4,
                "num_stages": local_policy.DENSE_STAGES}
    dense_down = {**dense_up, "BLOCK_N": local_policy.DENSE_DOWN_COLUMNS[0]}
    for dense, up, down in ((True, dense_up, dense_down), (False, local_policy.SORTED_UP, local_policy.SORTED_DOWN)):
        for kernel, config in ((local_experts.moe_gate_up_kernel, up), (local_experts.moe_down_kernel, down)):
            config = dict(config)
            options = {"num_warps": config.pop("num_warps"), "num_stages": config.pop("num_stages")}
            weights = f"tensordesc<bf16[1, {config['BLOCK_K']}, {config['BLOCK_N']}]>"
            if kernel is local_experts.moe_gate_up_kernel:
                head = {"x_ptr": "*bf16", "w_desc": weights, "h_ptr": "*bf16"}
                tail, constexprs = {"down_tiles": "i32"}, {"ZB": 1}
            else:
                head, tail, constexprs = {"h_ptr": "*bf16", "w_desc": weights, "parts_ptr": "*bf16"}, {}, {}
            constexprs.update(pads, DENSE=dense, P_PAD=64, **config)
            signature = {**head, "routing": routing, "counts_ptr": "*i32", "y_ptr": "*bf16", **sizes, **tail,
                         **{name: "constexpr" for name in constexprs}}
            cases.append((kernel, signature, constexprs, options))
    return cases


def _norm_cases():
    """all_reduce_rms_norm's kernels as they launch (no FMA contraction) at hidden 4096 in one pass, and
    at 32768 in two: the local kernel with and without a residual, and on fp32 sums ("two_shot"); the
    LL and one-shot kernels for the world and within a group; the LL kernel on fp32 rows."""
    rows = {"residual_ptr": "*bf16", "weight_ptr": "*bf16", "y_ptr": "*bf16", "new_residual_ptr": "*bf16"}
    scalars = {"eps": "fp32", "count": "fp32", "factor": "fp32", "DIVIDE": "constexpr", "BLOCK": "constexpr",
               "ONE_PASS": "constexpr"}
    cases = []
    for hidden in (4096, 32768):
        block, warps, one_pass = norm_policy.row_shape(hidden)
        shape = {"DIVIDE": False, "BLOCK": block, "ONE_PASS": one_pass}
        options = {"num_warps": warps, "enable_fp_fusion": False}
        for x, residual in (("*bf16", True), ("*bf16", False), ("*fp32", True))[:3 if hidden > 4096 else 2]:
            signature = {"x_ptr": x, **rows, "hidden": "i32", **scalars, "HAS_RESIDUAL": "constexpr"}
            constexprs = {**shape, "HAS_RESIDUAL": residual}
            if not residual:
                signature.update(residual_ptr="constexpr", new_residual_ptr="constexpr")
                constexprs.update(residual_ptr=None, new_residual_ptr=None)
            cases.append((norm_local.add_rms_norm_kernel, signature, constexprs, options))
        for group in ("constexpr", "*i32"):
            cases += [
                (norm_ll.all_reduce_rms_norm_ll_kernel,
                 {"x_words": "*i32", **rows, "packets_ptr": "*i64", "calls_ptr": "*i64", "tokens": "i32", "hidden": "i32",
                  "row": "i32", "slot_numel": "i32", **scalars, "DTYPE": "constexpr", "group": group},
                 {**shape, "DTYPE": tl.bfloat16, **({"group": None} if group == "constexpr" else {})}, options),
                (norm_one_shot.all_reduce_rms_norm_one_shot_kernel,
                 {"x_ptr": "*bf16", **rows, "staging_ptr": "*bf16", "flags_ptr": "*i64", "calls_ptr": "*i64",
                  "tokens": "i32", "hidden": "i32", "row": "i32", "slot_numel": "i32", "local_world_size": "i32",
                  **scalars, "group": group},
                 {**shape, **({"group": None} if group == "constexpr" else {})}, options)]
        if hidden == 4096:
            cases.append((norm_ll.all_reduce_rms_norm_ll_kernel,
                          {"x_words": "*i32", **{name: "*fp32" for name in rows}, "packets_ptr": "*i64",
                           "calls_ptr": "*i64", "tokens": "i32", "hidden": "i32", "row": "i32", "slot_numel": "i32",
                           **scalars, "DTYPE": "constexpr", "group": "constexpr"},
                          {**shape, "DTYPE": tl.float32, "group": None}, options))
    return cases


def _rotary_cases():
    """rotary_qkv's kernel for D 64 and 128, with the per-head norms (Qwen3) and without (Llama), k and
    v written into a static cache at its device index and returned, in a decode step's tile and a
    prefill's."""
    cases = []
    for d in (64, 128):
        for norm in (True, False):
            for cache, tokens in ((True, 1), (False, 1), (False, 4096)):
                block_t, warps = rotary.tile(tokens, d)
                signature = {"qkv_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "q_norm_ptr": "*bf16",
                             "k_norm_ptr": "*bf16", "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16",
                             "index_ptr": "*i64" if cache else "*bf16", "eps": "fp32",
                             **{name: "i32" for name in ("tokens", "seq_len", "qkv_row", "cos_batch", "cos_token", "q_batch",
                                                         "q_head", "q_token", "kv_batch", "kv_head", "kv_token",
                                                         "q_heads", "kv_heads")},
                             "D": "constexpr", "NORM": "constexpr", "CACHE": "constexpr", "BLOCK_T": "constexpr"}
                cases.append((rotary.rotary_qkv_kernel, signature,
                              {"D": d, "NORM": norm, "CACHE": cache, "BLOCK_T": block_t}, {"num_warps": warps}))
    return cases


def _sort_cases(one_group: bool, groups: int):
    """The counting sort's two kernels (`_sort`), at the chunk of `groups` and the blocks it takes for
    a million items."""
    _, step, _, blocks = sort.sort_shape(10 ** 6, groups, one_group)
    sizes = {name: "i32" for name in ("items", "topk", "groups", "per_group", "per_block")}
    constexprs = {"GROUPS": groups, "STEP": step}
    return [(sort.block_counts_kernel,
             {"idx_ptr": "*i64", "block_counts_ptr": "*i32", **sizes, "ADD": "constexpr", "GROUPS": "constexpr",
              "STEP": "constexpr"}, {**constexprs, "ADD": one_group}),
            (sort.positions_kernel,
             {"idx_ptr": "*i64", "block_counts_ptr": "*i32", "positions_ptr": "*i32", "order_ptr": "*i32",
              "counts_ptr": "*i32", **sizes, "blocks": "i32", "ONE_GROUP": "constexpr", "ORDER": "constexpr",
              "GROUPS": "constexpr", "STEP": "constexpr", "BLOCKS": "constexpr"},
             {**constexprs, "ONE_GROUP": one_group, "ORDER": not one_group, "BLOCKS": triton.next_power_of_2(blocks)})]


def _expert_parallel_cases():
    """The all-to-all-v kernel (the expert-major layout: every branch but the given offsets), the
    routing both ways, and EPBuffer's four kernels (the low-latency dispatch as one launch, which
    holds both halves), at DeepSeek-like sizes: 8 ranks, 32 experts each, top-8, hidden 7168. And
    the all-to-all-v with given offsets in int8 rows of one expert a rank: 16-element copies beside
    the count matrix's narrowest side (`_exchange.matrix_pad`), which Triton 3.6 failed to lower
    at 8."""
    w_pad, e_pad = exchange.matrix_pad(8), exchange.matrix_pad(32)
    i32 = {"width": "i32", "max_tokens": "i32", "experts_local": "i32", "topk": "i32", "slot_numel": "i32",
           "local_world_size": "i32", "splits": "i32", "tokens": "i32", "hidden": "i32"}
    block_w = ep_staging.block_w(7168 // 2)
    blocks = {"BLOCK_R": ep_staging.BLOCK_R, "BLOCK_W": block_w}
    return [
        *[case for one, groups in ((True, 16), (False, 8)) for case in _sort_cases(one, groups)],
        # EPBuffer's ids (-1 is none), ag_moe's (-1 is dropped too)
        *[(sort.drop_ids_kernel, {"idx_ptr": "*i64", "kept_ptr": "*i64", "dropped_ptr": "*i64", "items": "i32",
                                  "limit": "i32", "LOWEST": "constexpr", "BLOCK": "constexpr"},
           {"LOWEST": lowest, "BLOCK": 1024}) for lowest in (-1, 0)],
        *[(alltoall.all_to_all_v_kernel,
           {"x_ptr": word, "splits_ptr": "*i64", "offsets_ptr": "*i64", "out_ptr": word, "result_ptr": "*i64",
            "staging": alltoall.Staging(rows=word, counts="*i32", flags="*i64", calls="*i64", slot_numel="i32"),
            "width": "i32", "region": "i32", "out_rows": "i32", "experts": "i32", "major_align": "i32",
            "local_world_size": "i32", "splits": "i32", "LAYOUT": "constexpr", "W_PAD": "constexpr",
            "G_PAD": "constexpr", "BLOCK_R": "constexpr", "BLOCK_W": "constexpr"},
           {"LAYOUT": layout, "W_PAD": w_pad, "G_PAD": g_pad, "BLOCK_R": alltoall.BLOCK_R,
            "BLOCK_W": alltoall.TILE // alltoall.BLOCK_R})
          for word, layout, g_pad in (("*i16", 1, e_pad), ("*i8", 2, exchange.matrix_pad(1)))],
        (ep_normal.dispatch_kernel,
         {"x_ptr": "*i32", "meta_ptr": "*i32", "positions_ptr": "*i32", "order_ptr": "*i32", "routed_ptr": "*i32",
          "staging": ep_normal.DispatchStaging(rows="*i32", meta="*i32", counts="*i32", arrivals="*i64",
                                               progress="*i64", claims="*i32", calls="*i64", slot_numel="i32",
                                               meta_slot="i32"),
          "recv": ep_normal.Received(x="*i32", idx="*i64", weights="*fp32", src="*i32", layout="*i32",
                                     per_expert="*i64"),
          **{k: i32[k] for k in ("tokens", "width", "max_tokens", "experts_local", "topk", "local_world_size",
                                 "splits")},
          "W_PAD": "constexpr", "E_PAD": "constexpr", "K_PAD": "constexpr", "BLOCK_R": "constexpr",
          "BLOCK_W": "constexpr", "CHUNK": "constexpr"},
         {"W_PAD": w_pad, "E_PAD": e_pad, "K_PAD": 32, **blocks, "CHUNK": ep_normal.CHUNK}, {"num_warps": 8}),
        (ep_normal.combine_kernel,
         {"y_ptr": "*bf16", "recv_src_ptr": "*i32", "recv_layout_ptr": "*i32", "positions_ptr": "*i32",
          "staging_ptr": "*bf16", "progress_ptr": "*i64", "claims_ptr": "*i32", "calls_ptr": "*i64",
          "out_ptr": "*bf16",
          **{k: i32[k] for k in ("tokens", "hidden", "max_tokens", "slot_numel", "local_world_size", "splits")},
          "WORLD": "constexpr", "BLOCK_R": "constexpr", "BLOCK_W": "constexpr", "CHUNK": "constexpr"},
         {"WORLD": 8, "BLOCK_R": ep_staging.BLOCK_R, "BLOCK_W": ep_staging.TILE // ep_staging.BLOCK_R,
          "CHUNK": ep_normal.CHUNK},
         {"num_warps": 8}),
        (ep_low_latency.ll_dispatch_kernel,
         {"x_ptr": "*i32", "idx_ptr": "*i64", "positions_ptr": "*i32", "routed_ptr": "*i32", "pair_ids_ptr": "*i32",
          "staging": ep_low_latency.DispatchStaging(rows="*i32", meta="*i32", counts="*i32", arrivals="*i64",
                                                    calls="*i64", slot_numel="i32", meta_slot="i32"),
          "recv": ep_low_latency.Received(x="*i32", src="*i32", count="*i32", layout="*i32"),
          **{k: i32[k] for k in ("tokens", "width", "max_tokens", "experts_local", "topk", "local_world_size",
                                 "splits")},
          "SEND": "constexpr", "RECEIVE": "constexpr", "W_PAD": "constexpr", "E_PAD": "constexpr",
          "BLOCK_R": "constexpr", "BLOCK_W": "constexpr"},
         {"SEND": True, "RECEIVE": True, "W_PAD": w_pad, "E_PAD": e_pad, **blocks}, {"num_warps": 8}),
        (ep_low_latency.ll_combine_kernel,
         {"y_ptr": "*bf16", "recv_src_ptr": "*i32", "recv_layout_ptr": "*i32", "idx_ptr": "*i64",
          "weights_ptr": "*fp32", "positions_ptr": "*i32",
          "staging": ep_low_latency.CombineStaging(rows="*bf16", arrivals="*i64", calls="*i64", slot_numel="i32"),
          "out_ptr": "*bf16",
          **{k: i32[k] for k in ("tokens", "hidden", "max_tokens", "experts_local", "local_world_size", "splits")},
          "TOPK": "constexpr", "W_PAD": "constexpr", "E_PAD": "constexpr", "BLOCK_R": "constexpr",
          "BLOCK_W": "constexpr"},
         {"TOPK": 8, "W_PAD": w_pad, "E_PAD": e_pad, "BLOCK_R": 1, "BLOCK_W": ep_staging.TILE},
         {"num_warps": 8}),
    ]


def _moe_group_cases():
    """The MoE family's kernels that communicate, within a process group (their `group` argument a
    pointer to the group's table): each at its first world case, ag_moe's GEMM at the epoch flags
    of comm="sm" (which crosses nodes), moe_rs's counting its tiles for the peers' combine."""
    grouped_kernels = {alltoall.all_to_all_v_kernel, ep_normal.dispatch_kernel, ep_normal.combine_kernel,
                       ep_low_latency.ll_dispatch_kernel, ep_low_latency.ll_combine_kernel, tp_routing.route_kernel,
                       ag_moe.ag_moe_kernel, moe_rs.moe_rs_gemm_kernel, moe_rs.moe_combine_kernel}
    picked = {}
    for kernel, signature, constexprs, *options in (*_expert_parallel_cases(), *_moe_cases()):
        wanted = constexprs.get("EPOCH_FLAGS", True) and constexprs.get("COUNT", True)
        if kernel in grouped_kernels and kernel not in picked and wanted:
            picked[kernel] = (kernel, {**signature, "group": "*i32"}, constexprs, *options)
    return list(picked.values())


_ITEMSIZE = {"*bf16": 2, "*fp16": 2, "*fp32": 4, "*u8": 1}


def _largest_step(pointer_type: str, step_bytes: int = sizing.STEP_BYTES) -> int:
    """The largest BLOCK `sizing.steps_for` gives elements of this type (the most registers)."""
    return step_bytes // _ITEMSIZE[pointer_type]


def _step_options(pointer_type: str, step_bytes: int = sizing.STEP_BYTES) -> dict:
    return {"num_warps": sizing.warps_for(_largest_step(pointer_type, step_bytes), _ITEMSIZE[pointer_type])}


def _attention_cases():
    """The split-KV kernel for D 64 and 128, contiguous and paged (GQA 4 on the default config, and
    GQA 32 on 8 warps: the most query rows it takes; GQA 4 with a mask), and the combine at one rank and with the exchange,
    at the shapes `combine_shape` gives for many and for few chunks."""
    kernel = split_kv.flash_decode_split_kernel
    signature = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "seqlens_ptr": "*i32", "table_ptr": "*i32",
                 "mask_ptr": "*u8", "partials_ptr": "*fp32", "sm_scale": "fp32", "seq_stride": "i32",
                 "row_stride": "i32", "head_stride": "i32", "table_stride": "i32", "mask_stride": "i32",
                 "splits": "i32", "kv_heads": "i32", "GROUP": "constexpr", "D": "constexpr", "BLOCK_N": "constexpr",
                 "PAGE": "constexpr", "MASKED": "constexpr"}
    config = attention_policy.configs(CUDA)[0]
    cases = []
    for group, head_dim, page, warps, masked in [(4, 128, 0, None, False), (4, 128, 16, None, False),
                                                 (4, 64, 0, None, False), (4, 64, 16, None, False),
                                                 (32, 128, 0, 8, False), (4, 128, 0, None, True)]:
        constexprs = {"GROUP": group, "D": head_dim, "BLOCK_N": config["BLOCK_N"], "PAGE": page, "MASKED": masked}
        # as FlashDecode launches it
        stages = config["num_stages"] + (attention_policy.PAGED_EXTRA_STAGES if page else 0)
        cases.append((kernel, signature, constexprs, {"num_warps": warps or config["num_warps"], "num_stages": stages}))
    for group, head_dim, splits, world, exchange in [(4, 128, 66, 1, False), (4, 128, 66, 2, True),
                                                     (32, 128, 128, 4, True), (4, 64, 2, 8, True)]:
        columns, rows, rank_rows = attention_policy.combine_shape(group, head_dim, splits, world)
        cases.append((combine.flash_decode_combine_kernel,
                      {"partials_ptr": "*fp32", "out_ptr": "*bf16", "staging_ptr": "*i64" if exchange else "*fp32",
                       "calls_ptr": "*i64" if exchange else "*i32",
                       "units": "i32", "splits": "i32", "slot_numel": "i32", "local_world_size": "i32",
                       "GROUP": "constexpr", "D": "constexpr", "COLUMNS": "constexpr", "ROWS": "constexpr",
                       "RANK_ROWS": "constexpr", "EXCHANGE": "constexpr"},
                      {"GROUP": group, "D": head_dim, "COLUMNS": columns, "ROWS": rows, "RANK_ROWS": rank_rows,
                       "EXCHANGE": exchange}, {"num_warps": attention_policy.COMBINE_WARPS, "launch_pdl": True}))
    return cases


# The collectives' kernels, which the ops launch with a group argument under `group=`.
_COLLECTIVES = (
    allgather.push.all_gather_push_kernel, allgather.two_d.all_gather_2d_kernel, allgather.ring.all_gather_ring_kernel,
    allgather.pull.all_gather_pull_kernel, allgather.ll.all_gather_ll_kernel, _copy_engine.all_gather_ce_kernel,
    _copy_engine.reduce_ce_kernel, _packets.reduce_ll_kernel, reducescatter.one_shot.reduce_scatter_kernel,
    reducescatter.ring.reduce_scatter_ring_kernel, reducescatter.two_d.reduce_scatter_2d_kernel,
    allreduce.one_shot.all_reduce_one_shot_kernel, allreduce.two_shot.all_reduce_two_shot_kernel,
    allreduce.two_shot_symmetric.all_reduce_symmetric_kernel)


def _within_groups(world_cases, kernels) -> list:
    """The first of `world_cases` of each of `kernels` again, within a process group: its `group`
    argument a `tridist.Group`, which passes as a pointer to the group's int32 table (the world
    cases leave `group` out: None, which compiles as the kernel did before groups). Appended after
    the world cases, so that those keep their names (`case_names`)."""
    first = {}
    for kernel, signature, *rest in world_cases:
        if kernel in kernels and kernel not in first:
            first[kernel] = (kernel, {**signature, "group": "*i32"}, *rest)
    return list(first.values())


def _attention_stencil_sync_group_cases():
    """flash_decode's combine (its exchange), the Jacobi kernels and the bounded barrier within a
    process group (`group=`: a `tridist.Group`, a pointer to its int32 table)."""
    columns, rows, rank_rows = attention_policy.combine_shape(4, 128, 66, 2)
    tile = dict(zip(("BLOCK_R", "BLOCK_C"), stencil_policy.tile_for(4096, 8192)))
    return [
        (combine.flash_decode_combine_kernel,
         {"partials_ptr": "*fp32", "out_ptr": "*bf16", "staging_ptr": "*i64", "calls_ptr": "*i64", "units": "i32",
          "splits": "i32", "slot_numel": "i32", "local_world_size": "i32", "GROUP": "constexpr", "D": "constexpr",
          "COLUMNS": "constexpr", "ROWS": "constexpr", "RANK_ROWS": "constexpr", "EXCHANGE": "constexpr",
          "group": "*i32"},
         {"GROUP": 4, "D": 128, "COLUMNS": columns, "ROWS": rows, "RANK_ROWS": rank_rows, "EXCHANGE": True},
         {"num_warps": attention_policy.COMBINE_WARPS, "launch_pdl": True}),
        (jacobi_host_loop.jacobi_step_kernel, {"planes_ptr": "*fp32", "signals_ptr": "*i64", "rows": "i32",
                                               "cols": "i32", "iteration": "i32", "BLOCK_R": "constexpr",
                                               "BLOCK_C": "constexpr", "group": "*i32"}, tile),
        (jacobi_fused.jacobi_fused_kernel, {"planes_ptr": "*fp32", "signals_ptr": "*i64", "barrier_ptr": "*i64",
                                            "rows": "i32", "cols": "i32", "first": "i32", "iterations": "i32",
                                            "BLOCK_R": "constexpr", "BLOCK_C": "constexpr", "group": "*i32"}, tile),
        (sync._bounded_barrier_kernel, {"slots_ptr": "*i64", "passed_ptr": "*i64", "group": "*i32"}, {}),
        (lang.group_stamp_kernel, {"slots_ptr": "*i64", "value": "i32", "group": "*i32"}, {}),
    ]


@functools.cache
def cases():
    """(kernel, signature, constexprs[, compile options]). Built once: `main`'s forked workers
    inherit the list and pick cases from it by index."""
    CE = sizing.CE_STEP_BYTES  # noqa: N806 - the kernels waiting on copy-engine flags step in these
    world = [
        *_gemm_cases(),
        *_attention_cases(),
        *_rotary_cases(),
        *_grouped_cases(),
        *_linear_cases(),
        *_expert_parallel_cases(),
        *_moe_cases(),
        *_norm_cases(),
        *_local_moe_cases(),
        (lang.identity_kernel, {"out_ptr": "*i32"}, {}),
        *[(allgather.push.all_gather_push_kernel,
           {"x_ptr": t, "out_ptr": t, "staging_ptr": t, "flags_ptr": "*i64", "calls_ptr": "*i64", "n": "i32",
            "row": "i32", "slot_numel": "i32", "local_world_size": "i32", "slices": "i32", "BLOCK": "constexpr"},
           {"BLOCK": _largest_step(t)}, _step_options(t)) for t in ("*bf16", "*fp32", "*u8")],
        # all_gather "2d" and "ring"; "2d" also as ag_gemm's comm="sm" launches it
        *[(allgather.two_d.all_gather_2d_kernel,
           {"x_ptr": "*bf16", "out_ptr": "*bf16", "staging_ptr": "*bf16", "flags_ptr": "*i64", "calls_ptr": "*i64",
            "n": "i32", "row": "i32", "slot_numel": "i32", "local_world_size": "i32", "COPY_OUT": "constexpr",
            "splits": "i32", "BLOCK": "constexpr", "group": "constexpr"},
           {"COPY_OUT": copy_out, "BLOCK": block, "group": None}, {"num_warps": warps})
          for copy_out, block, warps in ((True, _largest_step("*bf16"), _step_options("*bf16")["num_warps"]),
                                         (False, shard_gather.PUSH_BLOCK, 8))],
        (allgather.ring.all_gather_ring_kernel,
         {"x_ptr": "*bf16", "out_ptr": "*bf16", "staging_ptr": "*bf16", "flags_ptr": "*i64", "calls_ptr": "*i64",
          "n": "i32", "row": "i32", "slot_numel": "i32", "local_world_size": "i32", "splits": "i32",
          "BLOCK": "constexpr"}, {"BLOCK": _largest_step("*bf16")}, _step_options("*bf16")),
        (allgather.pull.all_gather_pull_kernel,
         {"x_ptr": "*bf16", "out_ptr": "*bf16", "staging_ptr": "*bf16", "flags_ptr": "*i64", "calls_ptr": "*i64",
          "n": "i32", "slot_numel": "i32", "splits": "i32", "BLOCK": "constexpr"},
         {"BLOCK": _largest_step("*bf16")}, _step_options("*bf16")),
        (allgather.ll.all_gather_ll_kernel,
         {"x_ptr": "*i32", "out_ptr": "*i32", "packets_ptr": "*i64", "calls_ptr": "*i64", "n": "i32", "row": "i32",
          "slot_numel": "i32", "splits": "i32", "BLOCK": "constexpr"},
         {"BLOCK": protocol.LL_BLOCK}),
        *[(_copy_engine.all_gather_ce_kernel,
           {"x_ptr": "*bf16", "out_ptr": "*bf16", "staging_ptr": "*bf16", "flags_ptr": "*i32", "n": "i32",
            "total": "i32", "row": "i32", "chunk": "i32", "chunks": "i32", "COPY_OWN": "constexpr", "splits": "i32",
            "BLOCK": "constexpr"},
           {"COPY_OWN": own, "BLOCK": _largest_step("*bf16", CE)}, _step_options("*bf16", CE))
          for own in (True, False)],
        (_copy_engine.reduce_ce_kernel,
         {"x_ptr": "*bf16", "out_ptr": "*bf16", "staging_ptr": "*bf16", "flags_ptr": "*i32", "n": "i32", "m": "i32",
          "row": "i32", "chunk": "i32", "chunks": "i32", "splits": "i32", "BLOCK": "constexpr"},
         {"BLOCK": _largest_step("*bf16", CE)}, _step_options("*bf16", CE)),
        *[(kernel, {"x_ptr": "*bf16", "out_ptr": "*bf16", "staging_ptr": "*bf16", "flags_ptr": "*i64",
                    "calls_ptr": "*i64", "m": "i32", "row": "i32", "slot_numel": "i32", "local_world_size": "i32",
                    "slices": "i32", "BLOCK": "constexpr"}, {"BLOCK": _largest_step("*bf16")}, _step_options("*bf16"))
          for kernel in (reducescatter.one_shot.reduce_scatter_kernel, allreduce.two_shot.all_reduce_two_shot_kernel)],
        *[(allreduce.two_shot_symmetric.all_reduce_symmetric_kernel,
           {"x_ptr": t, "flags_ptr": "*i64", "calls_ptr": "*i64", "n": "i32", "m": "i32", "slices": "i32",
            "BLOCK": "constexpr"},
           {"BLOCK": _largest_step(t)}, _step_options(t)) for t in ("*bf16", "*fp32")],
        (reducescatter.ring.reduce_scatter_ring_kernel,
         {"x_ptr": "*bf16", "out_ptr": "*bf16", "staging_ptr": "*fp32", "flags_ptr": "*i64", "calls_ptr": "*i64",
          "m": "i32", "row": "i32", "slot_numel": "i32", "local_world_size": "i32", "splits": "i32",
          "BLOCK": "constexpr"},
         {"BLOCK": _largest_step("*bf16")}, _step_options("*bf16")),
        (reducescatter.two_d.reduce_scatter_2d_kernel,
         {"x_ptr": "*bf16", "out_ptr": "*bf16", "staging_ptr": "*bf16", "sums_ptr": "*fp32", "flags_ptr": "*i64",
          "calls_ptr": "*i64", "m": "i32", "row": "i32", "slot_numel": "i32", "local_world_size": "i32",
          "splits": "i32", "BLOCK": "constexpr"},
         {"BLOCK": _largest_step("*bf16")}, _step_options("*bf16")),
        (allreduce.one_shot.all_reduce_one_shot_kernel,
         {"x_ptr": "*fp16", "out_ptr": "*fp16", "staging_ptr": "*fp16", "flags_ptr": "*i64", "calls_ptr": "*i64",
          "n": "i32", "row": "i32", "slot_numel": "i32", "local_world_size": "i32", "splits": "i32",
          "BLOCK": "constexpr"},
         {"BLOCK": _largest_step("*bf16")}, _step_options("*bf16")),
        *[(_packets.reduce_ll_kernel,
           {"x_ptr": "*i32", "out_ptr": "*i32", "packets_ptr": "*i64", "calls_ptr": "*i64", "n": "i32",
            "peer_stride": "i32", "row": "i32", "slot_numel": "i32", "DTYPE": "constexpr", "splits": "i32",
            "BLOCK": "constexpr"},
           {"DTYPE": dtype, "BLOCK": protocol.LL_BLOCK}) for dtype in (tl.bfloat16, tl.float32)],
        (lang.push_allgather_kernel, {"shard_ptr": "*fp32", "out_ptr": "*fp32", "flags_ptr": "*i64", "n": "i32",
                                      "epoch": "i32", "BLOCK": "constexpr"}, {"BLOCK": 128}),
        (lang.produce_kernel, {"data_ptr": "*i32", "flag_ptr": "*i64", "peer": "i32", "value": "i32", "n": "i32",
                               "BLOCK": "constexpr"}, {"BLOCK": 64}),
        (lang.consume_kernel, {"data_ptr": "*i32", "flag_ptr": "*i64", "out_ptr": "*i32", "value": "i32", "n": "i32",
                               "BLOCK": "constexpr"}, {"BLOCK": 64}),
        (lang.count_kernel, {"counter_ptr": "*i64", "adds": "i32", "INTRA_NODE": "constexpr"}, {"INTRA_NODE": True}),
        (lang.count_kernel, {"counter_ptr": "*i64", "adds": "i32", "INTRA_NODE": "constexpr"}, {"INTRA_NODE": False}),
        (lang.cas_xchg_kernel, {"word_ptr": "*i64", "out_ptr": "*i64"}, {}),
        (lang.notify_add_kernel, {"signal_ptr": "*i64", "rounds": "i32", "total": "i32"}, {}),
        (lang.signal_forms_kernel, {"signal_ptr": "*i64", "peer": "i32"}, {}),
        (lang.never_signalled_kernel, {"flag_ptr": "*i64"}, {}),
        (lang.stamp_kernel, {"slots_ptr": "*i64", "value": "i32"}, {}),
        (sync._barrier_kernel, {}, {}),
        (sync._bounded_barrier_kernel, {"slots_ptr": "*i64", "passed_ptr": "*i64"}, {}),
        (sync._sleep_kernel, {"duration_ns": "i64"}, {}),
        *[(kernel, {"src_ptr": "*i32", "dst_ptr": "*i32", "peer": "i32", "n": "i32", "BLOCK": "constexpr"},
           {"BLOCK": primitives.BLOCK}) for kernel in (primitives.put_kernel, primitives.get_kernel)],
        (primitives.putmem_kernel, {"src_ptr": "*i32", "dst_ptr": "*i32", "peer": "i32", "n": "i32"}, {}),
        (primitives.ll_kernel, {"src_ptr": "*i32", "packets_ptr": "*i64", "out_ptr": "*i32", "calls_ptr": "*i64",
                                "peer": "i32", "n": "i32", "BLOCK": "constexpr"}, {"BLOCK": primitives.BLOCK}),
        (primitives.p_latency_kernel, {"dest_ptr": "*i64", "peer": "i32", "rounds": "i32"}, {}),
        (primitives.g_latency_kernel, {"chain_ptr": "*i64", "out_ptr": "*i64", "peer": "i32", "rounds": "i32"}, {}),
        (primitives.fetch_add_latency_kernel, {"counter_ptr": "*i64", "out_ptr": "*i64", "peer": "i32",
                                               "rounds": "i32"}, {}),
        *[(kernel, {"dst_ptr": "*u8", "src_ptr": "*u8", "nbytes": "i32", "peer": "i32", "rounds": "i32"}, {})
          for kernel in (primitives.put_latency_kernel, primitives.get_latency_kernel)],
        *[(primitives.ping_pong_kernel, {"flag_ptr": "*i64", "peer": "i32", "rounds": "i32", "base": "i32",
                                         "initiator": "i32", "COMM_SCOPE": "constexpr"}, {"COMM_SCOPE": scope})
          for scope in ("gpu", "inter_node")],
        *[(shmem.ring_put_signal_kernel, {"src_ptr": "*fp32", "dst_ptr": "*fp32", "signal_ptr": "*i64",
                                          "nbytes": "i32", "epoch": "i32", "VARIANT": "constexpr"}, {"VARIANT": v})
          for v in range(len(shmem.PUT_SIGNAL_VARIANTS))],
        (shmem.putmem_signal_allgather_kernel, {"shard_ptr": "*fp32", "out_ptr": "*fp32", "flags_ptr": "*i64",
                                                "n": "i32", "epoch": "i32"}, {}),
        *[(shmem.put_get_kernel, {"src_ptr": "*i32", "put_dst_ptr": "*i32", "get_dst_ptr": "*i32", "nbytes": "i32",
                                  "VARIANT": "constexpr"}, {"VARIANT": v}) for v in range(len(shmem.COPY_VARIANTS))],
        (shmem.typed_p_g_kernel, {"i32_ptr": "*i32", "i64_ptr": "*i64", "f32_ptr": "*fp32", "out_ptr": "*fp64"}, {}),
        (shmem.remote_atomics_kernel, {"counter_ptr": "*i64", "word_ptr": "*i64", "flag_ptr": "*i64",
                                       "out_ptr": "*i64"}, {}),
        (shmem.shmem_ptr_kernel, {"buf_ptr": "*i32", "out_ptr": "*i32"}, {}),
        (lang.rotate_kernel, {"slots_ptr": "*i64", "out_ptr": "*i64", "counter_ptr": "*i64", "rounds": "i32",
                              "base": "i32", "SKIP_FIRST": "constexpr"}, {"SKIP_FIRST": False}),
        (jacobi_host_loop.jacobi_step_kernel, {"planes_ptr": "*fp32", "signals_ptr": "*i64", "rows": "i32",
                                               "cols": "i32", "iteration": "i32", "BLOCK_R": "constexpr",
                                               "BLOCK_C": "constexpr"},
         dict(zip(("BLOCK_R", "BLOCK_C"), stencil_policy.tile_for(4096, 8192)))),
        (jacobi_fused.jacobi_fused_kernel, {"planes_ptr": "*fp32", "signals_ptr": "*i64", "barrier_ptr": "*i64",
                                            "rows": "i32", "cols": "i32", "first": "i32", "iterations": "i32",
                                            "BLOCK_R": "constexpr", "BLOCK_C": "constexpr"},
         dict(zip(("BLOCK_R", "BLOCK_C"), stencil_policy.tile_for(4096, 8192)))),
        (shmem.ll_ping_pong_kernel, {"packets_ptr": "*i64", "src_ptr": "*i32", "out_ptr": "*i32", "peer": "i32",
                                     "rounds": "i32", "initiator": "i32", "n": "i32", "BLOCK": "constexpr"},
         {"BLOCK": 128}),
        *_tutorial_cases(),
        *_group_cases(),
        *_gemm_group_cases(),
        *_attention_stencil_sync_group_cases(),
        *_moe_group_cases(),
    ]
    return [*world, *_within_groups(world, _COLLECTIVES)]


def argument_types(signature: dict) -> list[tuple[tuple[int, ...], str]]:
    """(path, type) of every argument in `signature`, a tuple argument's elements each with its
    path ((2, 0): the first element of the third argument), as Triton addresses them in `attrs`. A
    tuple argument's type is a tuple of types: `{"workspace": ("*i64", "*i64", "i32")}`."""
    def walk(path, ty):
        return [leaf for i, t in enumerate(ty) for leaf in walk((*path, i), t)] if isinstance(ty, tuple) \
            else [(path, ty)]

    return walk((), tuple(signature.values()))


def compile_for_hopper(kernel, signature, constexprs, options=None, debug=False, library=None):
    # Pointers and ints divisible by 16, as Triton specialises them at launch when they are (tensors
    # always, sizes usually): the variant that moves data in 16-byte accesses.
    attrs = {path: [["tt.divisibility", 16]] for path, ty in argument_types(signature)
             if ty.startswith("*") or ty in ("i32", "i64")}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": 4, **(options or {}), "debug": debug,
               "extern_libs": {"libnvshmem_device": library or device_library.for_kernels(find_device_library())}}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


# Kernels whose bf16 data must move in 16-byte accesses, peers' memory included (through symm_at,
# whose pointers Triton knows nothing about unless told: 2-byte stores to peers, until 2026-11-23).
VECTORISED = {"all_gather_push_kernel",
              "all_reduce_two_shot_kernel", "all_reduce_symmetric_kernel", "flash_decode_split_kernel"}


def scalar_accesses(kernel, signature, compiled) -> list[str]:
    """The 2-byte global loads and stores of a bf16 kernel in VECTORISED (none expected)."""
    if kernel.__name__ not in VECTORISED or "*bf16" not in [ty for _, ty in argument_types(signature)]:
        return []
    return re.findall(r"\b(?:ld|st)\.global\.b16\b", compiled.asm["ptx"])


def aligned_barriers_in_asm(compiled) -> list[str]:
    """Aligned barriers (`bar.sync`, `barrier.sync.aligned`) in tridist's own inline PTX (none
    expected): LLVM may copy inline asm onto divergent paths (see `_gpu._sync_threads`), where an
    aligned barrier hangs."""
    blocks = re.findall(r"// begin inline asm\n(.*?)// end inline asm", compiled.asm["ptx"], re.S)
    return [block.strip() for block in blocks if re.search(r"\bbar\.sync\b|\bbarrier\.sync\.aligned\b", block)]


SHARED_MEMORY_LIMIT = 227 << 10  # bytes a block may use on sm_90 (H100, H200)


def unpipelined(signature, constexprs, options, compiled) -> bool:
    """A GEMM compiled with FLATTEN whose operands do not get a shared-memory buffer per stage: its
    loop was not fused and pipelined (a gpu.barrier in the loop was enough to stop it, 2026-11-23);
    or a GEMM (a case giving num_stages) whose operand loads were not pipelined: a pipelined loop
    loads each of its two operands in num_stages places (num_stages - 1 in the prologue), where a
    fused loop that Triton could not pipeline keeps one load and waits for it at once (a wait
    inside the tile loop on a pointer that the loads then used did that, 2026-11-25)."""
    if "num_stages" in options:
        ir = compiled.asm["ttgir"]
        sites = ir.count("ttng.async_tma_copy_global_to_local") + ir.count("ttg.async_copy_global_to_local")
        if sites < 2 * options["num_stages"]:
            return True
    if not constexprs.get("FLATTEN"):  # (the GEMM cases always give their num_stages)
        return False
    itemsize = 1 if "fp8" in next(t for _, t in argument_types(signature) if t.startswith("tensordesc")) else 2
    stage_bytes = itemsize * constexprs["BLOCK_K"] * (constexprs["BLOCK_M"] + constexprs["BLOCK_N"])
    return compiled.metadata.shared < options["num_stages"] * stage_bytes


# TRIDIST_DEBUG=1 changes only how waits compile (bounded, with a trap): one kernel per kind of wait.
DEBUG_SUBSET = {"consume_kernel", "notify_add_kernel", "ll_ping_pong_kernel", "all_gather_ll_kernel",
                "all_reduce_one_shot_kernel", "gemm_rs_kernel", "gemm_ar_kernel", "reduce_ll_kernel",
                "reduce_ce_kernel", "gemm_ar_ll_kernel", "_bounded_barrier_kernel", "rotate_kernel",
                "jacobi_fused_kernel", "flash_decode_combine_kernel", "route_kernel", "ag_moe_kernel",
                "moe_combine_kernel", "all_to_all_v_kernel", "ll_dispatch_kernel", "combine_kernel",
                "group_allgather_kernel"}


def normalised_ptx(ptx: str) -> str:
    """`ptx` without its debug information: the `.loc` and `.file` directives, the labels that only
    they and the DWARF sections refer to (`$L__tmp3:`, `$L__func_begin0:`), and the `.debug_*`
    sections, which LLVM puts after the code. What is left is what Triton emits with line info
    off (TRITON_DISABLE_LINE_INFO=1): the code, which names no file and no line."""
    code = ptx.split("\t.section\t.debug", 1)[0]
    lines = [line for line in code.splitlines()
             if not re.match(r"\s*\.(?:loc|file)\b|\$L__(?:tmp|func_begin|func_end)\d+:$", line)]
    return "\n".join(lines).rstrip() + "\n"


def case_names(selected: list[int]) -> list[str]:
    """A file name for each of these cases: the kernel's name, and where `cases()` holds several
    cases of that kernel, its ordinal among them (`ag_gemm_kernel-3`). Neither the module nor the
    signature is in it, so a kernel moved or given grouped arguments keeps its name."""
    names = [kernel.__name__ for kernel, *_ in cases()]
    ordinal = [names[:index].count(name) for index, name in enumerate(names)]
    return [names[i] if names.count(names[i]) == 1 else f"{names[i]}-{ordinal[i]}" for i in selected]


def _check(index: int, debug: bool, ptx_path: str | None = None) -> str:
    """Compiles case `index` of `cases()` and checks it: one line, "ok ..." or "FAIL ...". With
    `ptx_path`, writes the case's `normalised_ptx` there."""
    kernel, signature, constexprs, *options = cases()[index]
    start = time.monotonic()
    try:
        compiled = compile_for_hopper(kernel, signature, constexprs, *options, debug=debug)
        assert "cubin" in compiled.asm
        if ptx_path:
            with open(ptx_path, "w") as f:
                f.write(normalised_ptx(compiled.asm["ptx"]))
        scalar = scalar_accesses(kernel, signature, compiled)
        assert not scalar, f"{len(scalar)} 2-byte accesses ({scalar[0]}) where 16-byte ones were expected"
        aligned = aligned_barriers_in_asm(compiled)
        assert not aligned, f"an aligned barrier in inline PTX ({aligned[0]}): use the unaligned barrier.sync"
        assert compiled.metadata.shared <= SHARED_MEMORY_LIMIT, \
            f"{compiled.metadata.shared} bytes of shared memory: more than an sm_90 block may have"
        assert not unpipelined(signature, constexprs, options[0] if options else {}, compiled), \
            f"FLATTEN, but {compiled.metadata.shared} bytes of shared memory: the tile loop is not pipelined"
        return f"ok    {kernel.__name__} {constexprs or ''} ({time.monotonic() - start:.1f} s)"
    except Exception as error:  # noqa: BLE001 - every failure is listed
        return f"FAIL  {kernel.__name__} {constexprs or ''}: {type(error).__name__}: {error}"


def compare_libraries(names: list[str]) -> int:
    """`python -m tests.gpu_compile --compare NAME...`: each kernel compiled against NVSHMEM's whole
    device library and against the cut one (runtime/device_library.py), each in a fresh Triton
    cache; one line each, "same PTX" or "DIFFERENT PTX", with both times."""
    whole = find_device_library()
    cut = device_library.for_kernels(whole)
    if cut == whole:
        print("FAIL  the device library was not cut (see the warning above)")
        return 1
    failed = False
    for name in names:
        kernel, signature, constexprs, *options = next(c for c in cases() if c[0].__name__ == name)
        ptx, seconds = [], []
        for library in (whole, cut):
            knobs.cache.dir = tempfile.mkdtemp()
            start = time.monotonic()
            compiled = compile_for_hopper(kernel, signature, constexprs, *options, library=library)
            seconds.append(time.monotonic() - start)
            ptx.append(re.sub(r"//.*", "", compiled.asm["ptx"]))  # the library's source comments aside
        same = ptx[0] == ptx[1]
        failed |= not same
        print(f"{'same PTX' if same else 'DIFFERENT PTX'} {name}: whole library {seconds[0]:.2f} s, "
              f"cut {seconds[1]:.2f} s", flush=True)
    return 1 if failed else 0


def main() -> int:
    args = sys.argv[1:]
    if args[:1] == ["--compare"]:
        return compare_libraries(args[1:])
    ptx_dir = None
    if args[:1] == ["--ptx"]:
        if len(args) < 2:
            print("usage: python -m tests.gpu_compile --ptx DIR [NAME...]")
            return 2
        ptx_dir, args = args[1], args[2:]
    debug = os.environ.get("TRIDIST_DEBUG") == "1"
    only = args  # kernel names, to compile a few while working on them
    selected = [index for index, (kernel, *_) in enumerate(cases())
                if not ((debug and kernel.__name__ not in DEBUG_SUBSET) or (only and kernel.__name__ not in only))]
    paths = [None] * len(selected)
    if ptx_dir:
        os.makedirs(ptx_dir, exist_ok=True)
        names = case_names(selected)
        paths = [os.path.join(ptx_dir, f"{name}.ptx") for name in names]
        with open(os.path.join(ptx_dir, "cases.txt"), "w") as f:
            for name, index in zip(names, selected):
                kernel, _, constexprs, *options = cases()[index]
                f.write(f"{name}: {constexprs} {options[0] if options else {}}\n")
    library = device_library.for_kernels(find_device_library())  # cut once, before the workers fork
    print(f"NVSHMEM device library linked: {library}", flush=True)
    # A compile keeps one core busy (LLVM, then ptxas): one at a time per core. Forked workers
    # inherit the imports, and Triton's cache writes each entry whole, so they can share it.
    with concurrent.futures.ProcessPoolExecutor(os.cpu_count(), mp_context=multiprocessing.get_context("fork")) as pool:
        lines = list(pool.map(_check, selected, [debug] * len(selected), paths))
    for line in lines:
        print(line, flush=True)
    return 1 if any(line.startswith("FAIL") for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
