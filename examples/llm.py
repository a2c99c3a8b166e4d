"""A transformers decoder sharded with `tridist.nn.parallelize`, generating greedily:
`tridist run -n 2 examples/llm.py` (a tiny Qwen3-MoE; `--model llama` or `qwen3` for dense ones,
`--config path/config.json` for a real model's dimensions, `--moe tp` for tensor-parallel experts).

Every rank builds the model from its config with the same seed (random weights: nothing is
downloaded), shards it, and runs a prefill and `--new-tokens` greedy decode steps with transformers'
own KV cache. Rank 0 then runs the whole model (kept before sharding) on the same tokens and checks
each step's logits (within `LOGITS_TOLERANCE` of the largest, bf16) and greedy tokens (the same,
except where the whole model's best two are closer than that tolerance); every rank exits non-zero
if rank 0 found a difference. Tokens per second are those of the sharded model's decode steps.
"""
import argparse
import copy
import json
import sys
import time

import torch

import tridist
import tridist.nn
from tridist import ops

# bf16 logits of the sharded model against the whole one's: the row-parallel layers sum the ranks'
# partial products in fp32 and round once, one GPU's GEMM sums the whole K in its own order; a
# difference of up to this fraction of the largest logit is rounding.
LOGITS_TOLERANCE = 3e-2

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=128, max_position_embeddings=256)
TINY_MOE = dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)


def tiny_config(model: str):
    """A few-thousand-parameter config of `model` ("llama", "qwen3" or "qwen3-moe"), for the emulator."""
    import transformers

    if model == "llama":
        return transformers.LlamaConfig(**TINY)
    if model == "qwen3":
        return transformers.Qwen3Config(**TINY)
    return transformers.Qwen3MoeConfig(**TINY, **TINY_MOE)


def load_config(path: str):
    """The transformers config of a model's config.json (its `model_type` names the class)."""
    import transformers

    with open(path) as f:
        fields = json.load(f)
    return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)


def build_model(config, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """The causal LM of `config` with random weights drawn from `seed` (the same on every rank), in bf16
    on `device`, for inference."""
    import transformers

    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(torch.bfloat16).eval()


def with_cache(model) -> dict:
    """A new `DynamicCache` as the keyword argument `model`'s forward takes it: `cache` in transformers
    from 5.24 (which warns that `past_key_values` is deprecated), `past_key_values` before."""
    import inspect

    from transformers import DynamicCache

    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: DynamicCache(), "use_cache": True}


@torch.no_grad()
def generate(model, prompt: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, list[torch.Tensor], float]:
    """Greedy decoding: a prefill of `prompt` ([B, P]), then `new_tokens` decode steps with a
    `DynamicCache`. Returns (tokens [B, new_tokens + 1], every step's last-position logits
    [B, vocab], seconds of the decode steps)."""
    cache = with_cache(model)
    logits = model(prompt, **cache).logits[:, -1]
    tokens, steps = [logits.argmax(-1)], [logits]
    sync(prompt.device)
    start = time.perf_counter()
    for _ in range(new_tokens):
        logits = model(tokens[-1][:, None], **cache).logits[:, -1]
        tokens.append(logits.argmax(-1))
        steps.append(logits)
    sync(prompt.device)
    return torch.stack(tokens, dim=1), steps, time.perf_counter() - start


@torch.no_grad()
def teacher_forced(model, prompt: torch.Tensor, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Every step's last-position logits of `model` fed the prompt, then `tokens` one at a time (those
    the sharded model chose), so that the steps compare one to one."""
    cache = with_cache(model)
    steps = [model(prompt, **cache).logits[:, -1]]
    for i in range(tokens.shape[1] - 1):
        steps.append(model(tokens[:, i:i + 1], **cache).logits[:, -1])
    return steps


def compare(steps: list[torch.Tensor], expected: list[torch.Tensor]) -> tuple[float, int]:
    """(the largest logit difference over all steps as a fraction of the largest expected logit, the
    number of steps whose greedy tokens differ where the expected best two are not a near tie)."""
    error, wrong = 0.0, 0
    for got, want in zip(steps, expected):
        got, want = got.float().cpu(), want.float().cpu()
        scale = want.abs().max().item()
        error = max(error, (got - want).abs().max().item() / scale)
        best = want.topk(2, dim=-1).values
        clear = (best[:, 0] - best[:, 1]) > LOGITS_TOLERANCE * scale
        wrong += int(((got.argmax(-1) != want.argmax(-1)) & clear).any())
    return error, wrong


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["llama", "qwen3", "qwen3-moe"], default="qwen3-moe",
                        help="the tiny config's model (default qwen3-moe)")
    parser.add_argument("--config", help="a transformers config.json (real dimensions) instead of the tiny config")
    parser.add_argument("--moe", choices=["ep", "tp"], default="ep", help="how MoE layers are split (default ep)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=4)
    args = parser.parse_args(argv)

    w = tridist.init()
    config = load_config(args.config) if args.config else tiny_config(args.model)
    model = build_model(config, w.device)
    whole = copy.deepcopy(model) if w.rank == 0 else None
    tridist.nn.parallelize(model, moe=args.moe)
    prompt = torch.randint(0, config.vocab_size, (args.batch, args.prompt_tokens),
                           generator=torch.Generator().manual_seed(1)).to(w.device)
    tokens, steps, seconds = generate(model, prompt, args.new_tokens)

    verdict = torch.zeros(1, dtype=torch.int32, device=w.device)
    if w.rank == 0:
        error, wrong = compare(steps, teacher_forced(whole, prompt, tokens))
        ok = error < LOGITS_TOLERANCE and wrong == 0
        verdict.fill_(int(not ok))
        moe = f", moe={args.moe}" if getattr(config, "num_experts", None) else ""  # dense models have no experts
        print(f"{type(model).__name__} on {w.world_size} rank{'s' * (w.world_size > 1)} ({w.backend}){moe}: tokens "
              f"{tokens[0].tolist()}; logits within {error:.1e} of the largest (tolerance {LOGITS_TOLERANCE:.0e}), "
              f"{wrong} steps with other tokens: {'ok' if ok else 'WRONG'}")
    failed = ops.all_gather(verdict).sum().item()  # rank 0's verdict, on every rank
    print(f"rank {w.rank}: {args.batch * args.new_tokens / seconds:.1f} tokens/s over {args.new_tokens} decode "
          f"steps of batch {args.batch}")
    tridist.finalize()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
