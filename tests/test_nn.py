"""tridist.nn: transformers decoders sharded with `parallelize` (tiny configs, built by
examples/llm.py as users run it) against the whole model, prefill and decode with transformers'
KV cache; and the inputs it refuses."""
import copy
import warnings

import pytest
import torch

import tridist
import tridist.nn
from tridist.nn import linear, moe as nn_moe

from .harness import load_script

pytest.importorskip("transformers")


def _matches_whole_model(w, model, moe, batch, prompt_tokens, new_tokens, decode_rows, low_latency_tokens):
    """Every step's logits within the example's tolerance of the whole model's (fed the same tokens),
    the same greedy tokens; returns the logits, which must be the same bits on every rank.
    `decode_rows` and `low_latency_tokens` stand in for the layers' thresholds so that a prefill of a
    few tokens runs the prefill kernels (gemm_rs, EP's normal mode) and a decode step the decode ones."""
    warnings.filterwarnings("ignore", message=".*past_key_values.*")  # transformers 5.24 renames it to `cache`
    example = load_script("examples", "llm")
    thresholds = linear.DECODE_ROWS, nn_moe.LOW_LATENCY_TOKENS
    linear.DECODE_ROWS, nn_moe.LOW_LATENCY_TOKENS = decode_rows, low_latency_tokens
    try:
        sharded = example.build_model(example.tiny_config(model), w.device)
        whole = copy.deepcopy(sharded)
        tridist.nn.parallelize(sharded, moe=moe)
        prompt = torch.randint(0, 128, (batch, prompt_tokens), generator=torch.Generator().manual_seed(1))
        tokens, steps, _ = example.generate(sharded, prompt.to(w.device), new_tokens)
    finally:
        linear.DECODE_ROWS, nn_moe.LOW_LATENCY_TOKENS = thresholds
    error, wrong = example.compare(steps, example.teacher_forced(whole, prompt.to(w.device), tokens))
    assert error < example.LOGITS_TOLERANCE and wrong == 0, \
        f"rank {w.rank}: logits off by {error:.2e} of the largest, {wrong} steps with other tokens"
    return [step.cpu() for step in steps]


# Dense: Llama with a prefill of 2 x 3 rows through gemm_rs + all-gather, Qwen3 with 5 rows (not a
# multiple of the world size) through a GEMM + all_reduce; decode steps of 2 and 1 rows through gemm_ar.
# MoE: a prefill of 3 tokens a rank in EP's normal mode, decode steps of one token a rank in its
# low-latency mode; tensor-parallel experts (ag_moe, moe_rs) the same way.
CASES = {"llama": dict(model="llama", moe="ep", batch=2, prompt_tokens=3, new_tokens=2),
         "qwen3": dict(model="qwen3", moe="ep", batch=1, prompt_tokens=5, new_tokens=1),
         "qwen3-moe-ep": dict(model="qwen3-moe", moe="ep", batch=1, prompt_tokens=6, new_tokens=2),
         "qwen3-moe-tp": dict(model="qwen3-moe", moe="tp", batch=1, prompt_tokens=6, new_tokens=1)}


@pytest.mark.worlds("2")
@pytest.mark.parametrize("case", CASES)
def test_parallelize_matches_the_whole_model(world, case):
    results = world.run(_matches_whole_model, **CASES[case], decode_rows=2, low_latency_tokens=2)
    for rank, steps in enumerate(results[1:], start=1):
        assert all(torch.equal(a, b) for a, b in zip(results[0], steps)), f"rank {rank}'s logits differ from rank 0's"


def _refuses(w):
    example = load_script("examples", "llm")
    config = example.tiny_config("qwen3-moe")
    config.num_key_value_heads = 1
    with pytest.raises(ValueError, match="num_key_value_heads"):
        tridist.nn.parallelize(example.build_model(config, w.device))
    model = example.build_model(example.tiny_config("qwen3-moe"), w.device)
    q_proj = model.model.layers[0].self_attn.q_proj
    with pytest.raises(ValueError, match="moe must be one of"):
        tridist.nn.parallelize(model, moe="dp")

    class Half:
        def size(self):
            return 1

    with pytest.raises(NotImplementedError, match="group"):
        tridist.nn.parallelize(model, group=Half())
    assert model.model.layers[0].self_attn.q_proj is q_proj, "a refused model must be left as it was"
    with pytest.raises(ValueError, match="multiple of the world size"):
        tridist.nn.ColumnParallelLinear(64, 3)


@pytest.mark.worlds("2")
def test_parallelize_refuses_what_it_cannot_split(world):
    world.run(_refuses)
