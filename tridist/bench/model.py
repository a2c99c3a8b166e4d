"""`tridist bench model`: whole decoder steps of a transformers model sharded by `tridist.nn`, against
the same model run tensor- and expert-parallel with torch + NCCL in the same run.

Models (random weights from a fixed seed, bf16; nothing is downloaded), the real dimensions with
`--layers` of their decoder layers (8 by default, so that the default run fits about 6 minutes with
compiles; the result records how many of how many):
- dense: Qwen3-8B (hidden 4096, MLP 12288, 32 query heads over 8 KV heads of 128, vocabulary 151936,
  36 layers);
- moe: Qwen3-30B-A3B (hidden 2048, 32 query heads over 4 KV heads of 128, 128 experts of 768, top-8,
  vocabulary 151936, 48 layers).

Systems, each a fresh copy of the model from the same seed:
- `tridist`: `tridist.nn.parallelize(model, moe=...)` (`--moe ep,tp` for both MoE modes);
- `megatron`: the same shards with torch's GEMMs and NCCL: an all-reduce after each row-parallel
  layer, an all-gather of the vocabulary-parallel logits and of the MoE blocks' token shares, and
  for the experts the pairs sorted by expert, the counts exchanged and read on the host, NCCL
  `all_to_all_single` there and back, `torch._grouped_mm` for the local experts;
- `hf_tp`: transformers' own tensor parallelism (`tp_plan="auto"`: DTensor over NCCL), loaded from
  a checkpoint of the same weights saved to a temporary folder; where transformers refuses or
  fails, the row says why.

Every system's logits are checked first against the whole model's (a prefill of 2 x 16 tokens and
two decode steps with a `DynamicCache`, within `TOLERANCE` of the largest logit). Then, timed:
- prefill of `--prefill` tokens (one sequence; the last position's logits), eagerly;
- a decode step at each `--decode` batch over a `StaticCache` of `CONTEXT` positions, captured in a
  CUDA graph (5 steps a replay); the megatron MoE step reads its splits on the host, which a graph
  cannot capture, so it is timed eagerly, as is any system whose capture fails (the row says so).
`us per layer` is the step's time over the decoder layers run (embedding and logits included).
`--kernels` prints where each step's GPU time goes, by kernel.

Attention is the same in every system unless `--tridist-attention` says otherwise for tridist's:
transformers' SDPA attention, with a decode step's grouped-query attention reading each KV head where
it is (`--attention grouped`, the default: `grouped_decode_attention`) rather than as transformers
before its `pack_gqa` ran it (`--attention sdpa` on such a version), which copied every KV head for
each of its query heads over the whole static cache at every step, most of a large-batch step
(benchmarks/NOTES.md, "The model's decode step"); or tridist's split-KV decode kernel
(`--attention split_kv`: `split_kv_decode_attention`), which spreads each sequence's positions over
the SMs where SDPA's kernel has one query block a KV head to spread (NOTES, "The model's decode step,
second look").
"""
import argparse
import copy
import shutil
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tridist
import tridist.nn
from tridist.nn import ColumnParallelLinear, ExpertParallelMoE, ParallelSparseMoeBlock, RowParallelLinear
from tridist.nn.moe import free_buffers, gated

from . import shared_gpu
from .ep import torch_combine, torch_dispatch
from .results import relative_error, save, table
from .timing import captured, print_kernels, slowest, time_us

MODELS = {
    "dense": ("Qwen3-8B", "Qwen3Config", dict(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False)),
    "moe": ("Qwen3-30B-A3B", "Qwen3MoeConfig", dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False)),
}
LAYERS = 8
PREFILL = (4096, 16384)
DECODE = (1, 8, 64)
CONTEXT = 4096  # positions of the static cache a decode step attends over
SYSTEMS = ("tridist", "megatron", "hf_tp")
# bf16 logits against the whole model's, over the largest. Splitting the row-parallel sums over 2 ranks
# alone moves 8 random bf16 layers' logits by 2.3e-2 (plain torch); transformers' TP by 3.1e-2 (NOTES:
# "the dense model's wrong logits"). Ranks that sharded different weights were off by 1.5.
TOLERANCE = 5e-2
CHECK_BATCH, CHECK_TOKENS, CHECK_STEPS = 2, 16, 2
GRAPH_STEPS = 5  # decode steps in one CUDA-graph replay
NOTES = {"megatron moe decode": "eager: its splits are read on the host, which a CUDA graph cannot capture"}
GROUPED = "tridist_bench_grouped_decode"  # the name `grouped_decode_attention` is registered under in transformers
SPLIT_KV = "tridist_bench_split_kv_decode"  # and `split_kv_decode_attention`'s
ATTENTION = {"grouped": GROUPED, "sdpa": "sdpa", "split_kv": SPLIT_KV}
_own_groups: dict = {}  # world rank -> a process group of that rank alone (`_own_group`)


def grouped_decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' SDPA attention, but for a decode step (one query per sequence) of grouped-query
    attention: the query heads that share a KV head become the rows of one query block against that
    head (query [B, Hq, 1, D] -> [B, Hkv, Hq / Hkv, D]), so the cache is read where it is, never
    copied. The mask of one query ([B, 1, 1, S]) holds for every row. The same numbers as SDPA over
    the repeated heads; anything else (prefill, a per-head mask) goes to transformers' own."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, length, dim = query.shape
    if length != 1 or groups == 1 or (attention_mask is not None and attention_mask.shape[1] != 1):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    rows = query.reshape(batch, heads // groups, groups, dim)
    out = F.scaled_dot_product_attention(rows, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


def split_kv_decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                              **kwargs):
    """A decode step's attention by tridist's split-KV kernel (`ops.flash_decode` among this rank
    alone: each rank attends over the KV heads it holds), other steps by `grouped_decode_attention`.
    The cache `[B, Hkv, L, D]` is read in place as B * Hkv sequences of one KV head, each sequence's
    query heads its rows. Each sequence attends over its first n positions, n the positions its mask
    allows (all of them without a mask): the bench's caches hold no padding, so what a mask allows is
    always such a prefix. A mask with holes (left padding) would be misread: not for general use."""
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    masks_one_row = attention_mask is None or (attention_mask.shape[1] == 1 and attention_mask.shape[2] == 1)
    if length != 1 or dropout or not masks_one_row or query.dtype not in (torch.bfloat16, torch.float16) \
            or dim not in (64, 128) or not key.is_contiguous() or not value.is_contiguous():
        return grouped_decode_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                        **kwargs)
    positions = key.shape[2]
    if attention_mask is None:
        seqlens = torch.full((batch,), positions, dtype=torch.int32, device=query.device)
    else:
        allowed = attention_mask[:, 0, 0, :positions]
        allowed = allowed if allowed.dtype == torch.bool else allowed == 0
        seqlens = allowed.sum(-1, dtype=torch.int32)
    rows = query.reshape(batch * kv_heads, heads // kv_heads, dim)
    out = tridist.ops.flash_decode(rows, key.view(batch * kv_heads, positions, 1, dim),
                                   value.view(batch * kv_heads, positions, 1, dim),
                                   seqlens.repeat_interleave(kv_heads), sm_scale=scaling, group=_own_group())
    return out.view(batch, 1, heads, dim), None


def _own_group():
    """A process group of this rank alone, made with every rank's (torch.distributed makes groups
    collectively) at the first call, which every rank makes at once (a model's first decode step)."""
    if not _own_groups:
        _own_groups.update({rank: dist.new_group([rank]) for rank in range(dist.get_world_size())})
    return _own_groups[dist.get_rank()]


def use_attention(config, attention: str):
    """`config` set to run `attention` ("grouped", "sdpa" or "split_kv", `ATTENTION`), registered with
    transformers first where it is ours, with SDPA's masks (a name without a mask function of its own
    gets no mask, and a decode step over a static cache would attend to its empty positions); returns
    transformers' name of it."""
    import transformers
    from transformers.masking_utils import sdpa_mask

    ours = {"grouped": grouped_decode_attention, "split_kv": split_kv_decode_attention}
    if attention in ours:
        transformers.AttentionInterface.register(ATTENTION[attention], ours[attention])
        transformers.AttentionMaskInterface.register(ATTENTION[attention], sdpa_mask)
    config._attn_implementation = ATTENTION[attention]
    return ATTENTION[attention]


# ---- the torch + NCCL baseline: tridist.nn's shards, torch's GEMMs and NCCL's collectives ----------
class NcclRowParallelLinear(RowParallelLinear):
    """The partial product, then NCCL's all-reduce."""

    def forward(self, x):
        y = x @ self.weight
        dist.all_reduce(y)
        return y if self.bias is None else y + self.bias


class NcclColumnParallelLinear(ColumnParallelLinear):
    """The local GEMM; the output's columns gathered with NCCL."""

    def forward(self, x):
        y = x @ self.weight
        if self.bias is not None:
            y = y + self.bias
        if not self.gather_output:
            return y
        return nccl_all_gather(y.reshape(-1, self.out_local)).view(self.world_size, -1, self.out_local).permute(
            1, 0, 2).reshape(*y.shape[:-1], self.out_features)


class NcclSparseMoeBlock(ParallelSparseMoeBlock):
    """The token shares' outputs gathered with NCCL."""

    def gather(self, y):
        return nccl_all_gather(y)


class NcclExpertParallelMoE(ExpertParallelMoE):
    """Expert parallelism as frameworks run it on NCCL: the (token, expert) pairs sorted by expert (so
    by rank), the counts exchanged and read on the host, `all_to_all_single` of the rows and their
    experts, the local experts by `torch._grouped_mm`, and back."""

    def forward(self, x, topk_idx, topk_weights):
        topk_idx = topk_idx.clamp(min=0)  # padding (-1, weight 0) to expert 0, where it adds nothing
        rows, order = torch_dispatch(x, topk_idx)
        experts = topk_idx.reshape(-1)[order]
        counts = torch.bincount(experts // self.local_experts, minlength=self.world_size)
        arriving = torch.empty_like(counts)
        dist.all_to_all_single(arriving, counts)
        sent, received = counts.tolist(), arriving.tolist()
        recv = rows.new_empty(sum(received), self.hidden_size)
        dist.all_to_all_single(recv, rows, received, sent)
        recv_experts = experts.new_empty(sum(received))
        dist.all_to_all_single(recv_experts, experts, received, sent)
        local = recv_experts - self.rank * self.local_experts
        by_expert = local.argsort(stable=True)
        offs = torch.bincount(local, minlength=self.local_experts).cumsum(0).to(torch.int32)
        h = torch._grouped_mm(recv[by_expert], self.w_gate_up, offs=offs)
        y = torch.empty_like(recv)
        y[by_expert] = torch._grouped_mm(gated(h, self.activation), self.w_down, offs=offs)
        back = y.new_empty(sum(sent), self.hidden_size)
        dist.all_to_all_single(back, y, sent, received)
        return torch_combine(back, order, topk_weights)


NCCL_CLASSES = {RowParallelLinear: NcclRowParallelLinear, ColumnParallelLinear: NcclColumnParallelLinear,
                ParallelSparseMoeBlock: NcclSparseMoeBlock, ExpertParallelMoE: NcclExpertParallelMoE}


def nccl_all_gather(y: torch.Tensor) -> torch.Tensor:
    out = y.new_empty(dist.get_world_size() * y.shape[0], *y.shape[1:])
    dist.all_gather_into_tensor(out, y.contiguous())
    return out


def megatron(model):
    """The model sharded as `tridist.nn.parallelize(model, moe="ep")` shards it, its layers computing
    with torch and NCCL instead (the same weights, the same shards)."""
    tridist.nn.parallelize(model, moe="ep")
    for module in model.modules():
        module.__class__ = NCCL_CLASSES.get(type(module), type(module))
    return model


# ---- models and steps -----------------------------------------------------------------------------
def make_config(kind: str, layers: int, dims: dict | None = None):
    """The transformers config of `kind` with `layers` decoder layers (`dims` overrides sizes: tests)."""
    import transformers

    _, class_name, sizes = MODELS[kind]
    return getattr(transformers, class_name)(**{**sizes, **(dims or {}), "num_hidden_layers": layers})


def build(config, device) -> torch.nn.Module:
    """The model of `config` with weights drawn from seed 0 (the same on every rank), bf16, for inference."""
    import transformers

    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(torch.bfloat16).eval()


@torch.no_grad()
def check_logits(model, prompt: torch.Tensor) -> list[torch.Tensor]:
    """The last position's logits after the prompt and after each of CHECK_STEPS greedy steps (each
    step fed the token the whole model chose: `prompt`'s last column)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    steps = [model(prompt[:, :CHECK_TOKENS], past_key_values=cache, use_cache=True).logits[:, -1]]
    for i in range(CHECK_STEPS):
        token = prompt[:, CHECK_TOKENS + i:CHECK_TOKENS + i + 1]
        steps.append(model(token, past_key_values=cache, use_cache=True).logits[:, -1])
    return steps


def prefill_step(model, tokens: int, vocab: int, device):
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(tokens)).to(device)

    @torch.no_grad()
    def run():
        return model(ids, use_cache=False, logits_to_keep=1).logits
    return run


def decode_step(model, batch: int, vocab: int, device):
    """One decode step of `batch` sequences at position CONTEXT - 1 of a `StaticCache`, on static
    tensors: a step a CUDA graph can capture (each replay writes the same cache position)."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=CONTEXT)
    ids = torch.randint(0, vocab, (batch, 1), generator=torch.Generator().manual_seed(batch)).to(device)
    position = torch.full((batch, 1), CONTEXT - 1, device=device)
    cache_position = torch.full((1,), CONTEXT - 1, device=device)

    @torch.no_grad()
    def run():
        return model(ids, position_ids=position, cache_position=cache_position, past_key_values=cache,
                     use_cache=True, logits_to_keep=1).logits
    return run


def hf_tensor_parallel(folder: str, attention: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto", dtype=torch.bfloat16,
                                                             attn_implementation=attention).eval()


# ---- the run --------------------------------------------------------------------------------------
def run(kind: str, layers: int, prefill, decode, moe_modes, systems, timed: bool, kernels: bool = False,
        dims: dict | None = None, attention: str = "grouped", tridist_attention: str | None = None) -> list[dict]:
    """Each system of `systems` built, checked and (if `timed`) timed, every model with `attention`
    (`ATTENTION`) but tridist's with `tridist_attention` where given; a row per (system, step), or
    one saying why a system did not run."""
    w = tridist.world()
    config = make_config(kind, layers, dims)
    use_attention(config, attention)
    tridist_config = config
    if tridist_attention not in (None, attention):
        tridist_config = copy.deepcopy(config)
        use_attention(tridist_config, tridist_attention)
    # Its own config: save_pretrained writes into the model's config (its dtype), and the systems built
    # from `config` afterwards must draw the same weights on every rank, also where only rank 0 saved.
    whole = build(copy.deepcopy(config), w.device)
    prompt = torch.randint(0, config.vocab_size, (CHECK_BATCH, CHECK_TOKENS + CHECK_STEPS),
                           generator=torch.Generator().manual_seed(1)).to(w.device)
    expected = check_logits(whole, prompt)
    folder = _save_checkpoint(whole) if "hf_tp" in systems and w.device.type == "cuda" else None
    del whole
    variants = [(system, moe) for system in systems
                for moe in (moe_modes if system == "tridist" and kind == "moe" else [None])]
    rows = []
    try:
        for system, moe in variants:
            name = system if moe is None else f"{system} moe={moe}"
            why = _unavailable(system, w)
            if why:
                rows.append({"model": kind, "system": name, "skipped": why})
                continue
            own = tridist_config if system == "tridist" else config
            try:
                rows += _system(kind, name, _shard(system, moe, own, folder, w.device), own, prompt, expected,
                                timed, prefill, decode, kernels, layers)
            except Exception as error:  # noqa: BLE001 - recorded: transformers' TP may refuse or fail on a model
                if system != "hf_tp":
                    raise
                rows.append({"model": kind, "system": name, "skipped": f"{type(error).__name__}: {error}"[:300]})
    finally:
        if folder and w.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
    return _ratios(rows)


def _system(kind, name, model, config, prompt, expected, timed, prefill, decode, kernels, layers) -> list[dict]:
    """One system's model checked against the whole model's logits, then timed."""
    error = slowest(max(relative_error(got, want) for got, want in zip(check_logits(model, prompt), expected)))
    if error > TOLERANCE:
        raise AssertionError(f"{kind} {name}: logits off by {error:.2e} of the largest (tolerance {TOLERANCE})")
    if tridist.world().rank == 0:
        print(f"{kind} {name}: logits within {error:.1e} of the whole model's", flush=True)
    rows = _timings(kind, name, model, config, prefill, decode, kernels, layers) if timed else []
    _free(model)
    return rows


def _unavailable(system: str, w) -> str | None:
    if system in ("megatron", "hf_tp") and not dist.is_initialized():
        return "needs torch.distributed (NCCL on GPUs)"
    if system == "hf_tp" and w.device.type != "cuda":
        return "transformers' tensor parallelism needs GPUs"
    return None


def _shard(system: str, moe, config, folder, device):
    if system == "hf_tp":
        return hf_tensor_parallel(folder, config._attn_implementation)
    model = build(config, device)
    return megatron(model) if system == "megatron" else tridist.nn.parallelize(model, moe=moe or "ep")


def _save_checkpoint(model) -> str:
    """The whole model saved by rank 0 to a temporary folder every rank reads (one host)."""
    folder = [tempfile.mkdtemp(prefix="tridist-bench-model-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder)
    if dist.get_rank() == 0:
        model.save_pretrained(folder[0])
    dist.barrier()
    return folder[0]


def _free(model) -> None:
    """The MoE layers' symmetric buffers given back (a collective), the model's memory released."""
    free_buffers()
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _timings(kind, name, model, config, prefill, decode, kernels: bool, layers: int) -> list[dict]:
    w = tridist.world()
    rows = []
    for tokens in prefill:
        step = prefill_step(model, tokens, config.vocab_size, w.device)
        us = slowest(time_us(step, inner=1, repetitions=5, warmup=2))
        rows.append({"model": kind, "system": name, "step": f"prefill {tokens}", "us": us, "us per layer": us / layers})
        if kernels:
            print_kernels(f"{kind} {name} prefill {tokens}", step, w.rank)
    for batch in decode:
        step = decode_step(model, batch, config.vocab_size, w.device)
        step()  # the static cache's first update allocates it
        timing = "cuda graph"
        if name == "megatron" and kind == "moe":
            timing = NOTES["megatron moe decode"]
            us = slowest(time_us(step, inner=GRAPH_STEPS, repetitions=10, warmup=2))
        else:
            try:
                us = slowest(time_us(step, inner=GRAPH_STEPS, repetitions=10, warmup=2, graph=True))
            except RuntimeError as error:  # a capture transformers' code does not allow: timed eagerly
                timing = f"eager (capture failed: {error})"[:200]
                torch.cuda.synchronize()
                us = slowest(time_us(step, inner=GRAPH_STEPS, repetitions=10, warmup=2))
        rows.append({"model": kind, "system": name, "step": f"decode {batch}", "us": us, "us per layer": us / layers,
                     "timing": timing})
        if kernels:  # in the graph the step is timed in: eagerly, waits for the peer's launches would count
            graphed = timing == "cuda graph"
            print_kernels(f"{kind} {name} decode {batch}", captured(step) if graphed else step, w.rank,
                          "cuda graph" if graphed else "eager")
        if w.rank == 0:
            print(f"  {kind} {name} decode {batch}: {us:.1f} us ({timing})", flush=True)
    return rows


def _ratios(rows: list[dict]) -> list[dict]:
    """Each tridist row's speed-up over each baseline's row of the same step: baseline us / tridist us."""
    times = {(row["system"], row.get("step")): row["us"] for row in rows if "us" in row}
    for row in rows:
        if row["system"].startswith("tridist") and "us" in row:
            for baseline in ("megatron", "hf_tp"):
                if (baseline, row["step"]) in times:
                    row[f"{baseline} / tridist"] = times[(baseline, row["step"])] / row["us"]
    return rows


def parse_ints(text: str) -> list[int]:
    """'4096,16384' -> [4096, 16384] ('' -> []); an argparse `type`."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = [0]
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: write positive integers, comma separated, e.g. 1,8,64")
    return values


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tridist bench model", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="dense,moe", help="dense, moe or both (default %(default)s)")
    parser.add_argument("--layers", type=int, default=LAYERS, help="decoder layers of each model (default %(default)s)")
    parser.add_argument("--prefill", type=parse_ints, default=list(PREFILL),
                        help="prefill tokens, comma separated, '' for none (default %(default)s)")
    parser.add_argument("--decode", type=parse_ints, default=list(DECODE),
                        help="decode batches, comma separated, '' for none (default %(default)s)")
    parser.add_argument("--moe", default="ep", help="tridist's MoE modes: ep, tp or ep,tp (default %(default)s)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="of %(default)s")
    parser.add_argument("--kernels", action="store_true", help="also print where each step's GPU time goes, by kernel")
    parser.add_argument("--row-decode", choices=tridist.nn.linear.DECODE_KERNELS,
                        default=tridist.nn.linear.DECODE_KERNEL,
                        help="how tridist's row-parallel layers end a decode step (tridist.nn.linear.DECODE_KERNEL; "
                             "default %(default)s)")
    parser.add_argument("--attention", choices=sorted(ATTENTION), default="grouped",
                        help="every system's attention (default %(default)s: a decode step reads GQA's KV heads in "
                             "place; sdpa: transformers' own; split_kv: tridist's split-KV decode kernel)")
    parser.add_argument("--tridist-attention", choices=sorted(ATTENTION), default=None,
                        help="tridist's attention, where it differs from the others' (default: --attention's)")
    parser.add_argument("--out", default="benchmarks/results", help="folder for JSON results (default %(default)s)")
    args = parser.parse_args(argv)
    kinds, moe_modes, systems = (v.split(",") for v in (args.models, args.moe, args.systems))
    for values, allowed, what in ((kinds, MODELS, "--models"), (moe_modes, ("ep", "tp"), "--moe"),
                                  (systems, SYSTEMS, "--systems")):
        if not values or not set(values) <= set(allowed):
            parser.error(f"{what} takes a comma separated list of {', '.join(allowed)}")
    if args.layers < 1:
        parser.error("--layers takes a positive integer")
    warnings.filterwarnings("ignore", message=".*past_key_values.*")  # transformers 5.24 renames it `cache`
    tridist.nn.linear.DECODE_KERNEL = args.row_decode
    w = tridist.init()
    shared = shared_gpu.announce("tridist bench model", w.rank)
    timed = w.backend == "nvshmem" and not shared
    rows = []
    for kind in kinds:
        rows += run(kind, args.layers, args.prefill, args.decode, moe_modes, systems, timed, args.kernels,
                    attention=args.attention, tridist_attention=args.tridist_attention)
    if w.rank == 0 and not timed:
        print(f"model: every check passed; nothing timed ({'ranks share a GPU' if shared else 'no GPU'})")
    elif w.rank == 0:
        columns = []
        for row in rows:
            columns += [c for c in row if c not in columns]
        print(table(rows, columns))
        extra = {"world_size": w.world_size, "timed": timed, "context": CONTEXT, "tolerance": TOLERANCE,
                 "attention": args.attention, "tridist attention": args.tridist_attention or args.attention,
                 "row-parallel decode": args.row_decode,
                 "models": {kind: {"like": MODELS[kind][0], "layers": f"{args.layers} of "
                                   f"{MODELS[kind][2]['num_hidden_layers']}", **MODELS[kind][2]} for kind in kinds},
                 "graph steps per replay": GRAPH_STEPS, "notes": NOTES}
        print(f"saved {save('model', rows, args.out, extra)}")
    tridist.finalize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
