"""# 12. Sharding a model with tridist.nn

The earlier tutorials built single ops. A model strings them together: a decoder layer is an
attention block and an MLP (or a mixture of experts), each a few linear layers around a
nonlinearity, and tensor parallelism splits each block over the ranks with one collective per block.

The MLP `down(act(gate(x)) * up(x))` splits by the inner dimension. `gate` and `up` are
**column-parallel**: rank r holds columns `r * I/n ... (r+1) * I/n - 1` of their weights and computes
those columns of `act(gate(x)) * up(x)` with no communication, since the activation works column by
column. `down` is **row-parallel**: rank r holds the matching rows of its weight, so its product is
a partial sum of the output, and a sum over the ranks finishes the block. Attention splits the same
way by heads: q, k and v are column-parallel (a rank holds whole heads, and with grouped-query
attention whole groups: a query head's KV head lives on its rank), each rank attends over its own
heads, and the output projection `o_proj` is row-parallel. Each rank's KV cache holds its heads only.

`tridist.nn` has these layers over tridist's kernels. `ColumnParallelLinear` is a local GEMM,
`ops.linear` (or, when each rank holds only some of the tokens, `ag_gemm`, which gathers them while
it multiplies); `from_linears` fuses layers that read the same input, q, k and v, or gate and up
with SiLU(gate) * up in the GEMM's epilogue. `RowParallelLinear` is a local GEMM and an all-reduce,
or, with `sum_output=False`, leaves the sum to the next op: tridist's decoder layer sums it inside
the next norm (`ops.all_reduce_rms_norm`, the exchange, the residual add and the RMSNorm in one
kernel). Nothing depends on values on the host, so a decode step captures in a CUDA graph. Mixtures of experts get
`ExpertParallelMoE` (whole experts per rank: `EPBuffer`'s dispatch and combine around grouped GEMMs,
the low-latency mode for decode) and `TensorParallelMoE` (a slice of every expert: `ag_moe` and
`moe_rs`).

`tridist.nn.parallelize(model)` builds tridist's own decoder layers from a Hugging Face
`transformers` model's (Llama, Qwen3, Qwen3-MoE) and puts them in place, so the model's own loop,
masks, caches and `generate` run around them and every rank returns the whole model's logits. This tutorial splits an MLP by hand, then shards a tiny
Qwen3-MoE and generates with it.

Run: `tridist run -n 2 tutorials/12-sharding-a-model.py`
"""
# %%
# An MLP by hand. Every rank builds the same whole layers from one seed (a model loaded from a
# checkpoint is the same on every rank too), and `from_linear` keeps this rank's part, in
# torch.nn.Linear's layout: `gate.weight` here is [128 / n, 64]. The input is the same on every
# rank; so is the output: the row-parallel layer's sum over the ranks.
import copy
import sys

import torch
import torch.nn.functional as F

import tridist
import tridist.nn
from tridist.nn import ColumnParallelLinear, RowParallelLinear


def mlp_by_hand(w) -> bool:
    torch.manual_seed(0)
    gate, up, down = (torch.nn.Linear(64, 128, bias=False), torch.nn.Linear(64, 128, bias=False),
                      torch.nn.Linear(128, 64, bias=False))
    for linear in (gate, up, down):
        linear.to(device=w.device, dtype=torch.bfloat16)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)).to(w.device, torch.bfloat16)
    whole = down(F.silu(gate(x)) * up(x))

    gate_r, up_r = ColumnParallelLinear.from_linear(gate), ColumnParallelLinear.from_linear(up)
    down_r = RowParallelLinear.from_linear(down)
    assert gate_r.weight.shape == (128 // w.world_size, 64)
    sharded = down_r(F.silu(gate_r(x)) * up_r(x))
    return (sharded.float() - whole.float()).abs().max().item() <= 2e-2 * whole.float().abs().max().item()


# %%
# A whole model. A tiny Qwen3-MoE from its config (random weights from a fixed seed: nothing is
# downloaded), kept whole for the check, then sharded: `moe="ep"` spreads its 4 experts over the
# ranks, `moe="tp"` would split each of them. Printing a layer shows what each rank now holds.
def tiny_model(w):
    import transformers

    config = transformers.Qwen3MoeConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                                         moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(config).to(w.device, torch.bfloat16).eval()


# %%
# Generation with transformers' own KV cache: a prefill of the prompt, then greedy decode steps of
# one token each. The whole model on every rank, fed the same tokens, gives the reference logits; the
# sharded model's are within bf16 rounding of them (the ranks' partial sums are added in fp32 in
# another order than one GPU adds them), and the same on every rank.
@torch.no_grad()
def generate(model, prompt, tokens):
    """The last position's logits after the prompt and after each of `tokens` fed one at a time."""
    from transformers import DynamicCache

    cache = DynamicCache()
    steps = [model(prompt, past_key_values=cache, use_cache=True).logits[:, -1]]
    for token in tokens:
        steps.append(model(token.view(1, 1), past_key_values=cache, use_cache=True).logits[:, -1])
    return torch.stack(steps)


def sharded_model(w) -> bool:
    model = tiny_model(w)
    whole = copy.deepcopy(model)
    tridist.nn.parallelize(model, moe="ep")
    if w.rank == 0:
        print(model.model.layers[0])
    prompt = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(2)).to(w.device)
    tokens = [torch.tensor(t, device=w.device) for t in (5, 17, 99)]
    got, expected = generate(model, prompt, tokens).float(), generate(whole, prompt, tokens).float()
    error = (got - expected).abs().max().item() / expected.abs().max().item()
    print(f"rank {w.rank}: logits within {error:.1e} of the largest, greedy tokens "
          f"{got.argmax(-1).view(-1).tolist()} (whole model: {expected.argmax(-1).view(-1).tolist()})")
    return error < 3e-2


# %%
def main():
    import warnings

    warnings.filterwarnings("ignore", message=".*past_key_values.*")  # transformers 5.24 renames it `cache`
    w = tridist.init()
    results = {"MLP by hand": mlp_by_hand(w), "sharded Qwen3-MoE": sharded_model(w)}
    if w.rank == 0:
        for name, ok in results.items():
            print(f"{name}: {'ok' if ok else 'WRONG'}")
    tridist.finalize()
    if not all(results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
