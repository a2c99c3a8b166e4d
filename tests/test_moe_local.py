"""The local MoE (`tridist.ops.moe_local`, `moe_route`) against torch: the router against
transformers' routing (the same expert ids, the weights within a rounding), the experts against a
float32 reference of the whole block as transformers computes it, at T of 0, 1, 3 and 17 in both
row layouts (dense and sorted), ids of no expert among them, outputs poisoned, the same bits on a
second call; bad input refused; the MoE layers at world size 1 through the local path (no
exchange); the custom ops under torch.compile; `tridist bench moe_local`'s checks. A local op: world 1
only."""
import argparse

import pytest
import torch
import torch.nn.functional as F

import tridist
import tridist.nn
from tridist import ops
from tridist.bench.results import relative_error
from tridist.ops import checks
from tridist.ops.moe import local
from tridist.ops.moe.local import policy

transformers = pytest.importorskip("transformers")

# y rounds each expert's h to bf16 (as transformers) and the token's fp32 sum once: errors relative to
# the largest value of the block's output.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3}
EXPERTS, HIDDEN, INNER = 8, 32, 24
POISON = 1e4


def _generator(seed):
    return torch.Generator().manual_seed(seed)


def _block(top_k: int, norm: bool, seed: int, dtype=torch.bfloat16):
    """transformers' Qwen3MoeSparseMoeBlock of the tiny dims, random weights, in `dtype` on the CPU."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe as qwen3_moe

    config = qwen3_moe.Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INNER, num_experts=EXPERTS,
                                      num_experts_per_tok=top_k, norm_topk_prob=norm, hidden_act="silu")
    block = qwen3_moe.Qwen3MoeSparseMoeBlock(config)
    g = _generator(seed)
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(EXPERTS, HIDDEN, generator=g))
        block.experts.gate_up_proj.copy_(torch.randn(EXPERTS, 2 * INNER, HIDDEN, generator=g) / HIDDEN ** 0.5)
        block.experts.down_proj.copy_(torch.randn(EXPERTS, HIDDEN, INNER, generator=g) / INNER ** 0.5)
    return block.to(dtype)


def _layer_weights(block):
    """tridist's layout: x @ w."""
    return (block.experts.gate_up_proj.detach().transpose(1, 2).contiguous(),
            block.experts.down_proj.detach().transpose(1, 2).contiguous())


def _route(w, logits, top_k, norm):
    idx, weights = ops.moe_route(logits.to(w.device), top_k, norm)
    return idx.cpu(), weights.cpu()


def _same_choice(idx, want_idx, probs, what):
    """idx is a top-k of probs as torch.topk's want_idx is: the same probabilities in the same order,
    the same ids where they do not tie, the lowest id first among equal ones."""
    chosen = probs.gather(1, idx)
    assert torch.equal(chosen, probs.gather(1, want_idx)), f"{what}: ids {idx.tolist()} != {want_idx.tolist()}"
    tied = chosen[:, 1:] == chosen[:, :-1]
    assert (idx[:, 1:] > idx[:, :-1])[tied].all(), f"{what}: equal probabilities not in order of id: {idx.tolist()}"
    untied = (probs[:, None, :] == chosen[:, :, None]).sum(-1) == 1
    assert torch.equal(idx[untied], want_idx[untied]), f"{what}: ids {idx.tolist()} != {want_idx.tolist()}"


def _router(w):
    for top_k, norm in ((2, True), (3, False), (8, True)):
        for tokens in (0, 1, 3, 17):
            block = _block(top_k, norm, seed=tokens + 10 * top_k)
            x = torch.randn(tokens, HIDDEN, generator=_generator(tokens)).to(torch.bfloat16)
            logits, want_weights, want_idx = block.gate(x)
            idx, weights = _route(w, logits, top_k, norm)
            _same_choice(idx, want_idx, logits.float().softmax(-1), f"top-{top_k} of {tokens}")
            # Each weight rounded to bf16: one bf16 rounding apart at most.
            assert torch.allclose(weights, want_weights.float(), rtol=2 ** -7, atol=0), \
                f"top-{top_k} of {tokens}: weights {weights} != {want_weights}"
    # Ties: the lowest id first (torch.topk does not say).
    tied = torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0, 0.0, 0.0, 0.0]], dtype=torch.bfloat16)
    idx, _ = _route(w, tied, 3, True)
    assert idx.tolist() == [[1, 2, 4]]
    # float32 logits, weights rounded to fp16
    logits = torch.randn(5, EXPERTS, generator=_generator(7))
    idx, weights = ops.moe_route(logits.to(w.device), 2, True, torch.float16)
    want_weights, want_idx = torch.topk(logits.softmax(-1), 2)
    assert torch.equal(idx.cpu(), want_idx)
    assert torch.allclose(weights.cpu(), (want_weights / want_weights.sum(-1, keepdim=True)).half().float(), rtol=1e-3)


# (dtype, top_k, tokens), each in both row layouts
EXPERT_CASES = [(torch.bfloat16, 2, tokens) for tokens in (0, 1, 3, 17)] + [(torch.bfloat16, 3, 17),
                                                                            (torch.float16, 3, 3)]


def _experts(w):
    for dtype, top_k, tokens in EXPERT_CASES:
        for dense_tokens in (policy.DENSE_TOKENS, 0):  # dense rows, then sorted ones
            _check_experts(w, dtype, top_k, tokens, dense_tokens, again=tokens == 17)
    if w.backend == "emulator":  # the down kernel's sums in two slices of its 16 columns (the GPU's tiles have 4)
        from triton import language as tl

        from tridist.ops.moe.local import experts
        saved, experts.SUM_COLUMNS = experts.SUM_COLUMNS, tl.constexpr(8)
        try:
            for dense_tokens in (policy.DENSE_TOKENS, 0):
                _check_experts(w, torch.bfloat16, 3, 17, dense_tokens, again=True)
        finally:
            experts.SUM_COLUMNS = saved


def _check_experts(w, dtype, top_k, tokens, dense_tokens, again):
    block = _block(top_k, True, seed=tokens + top_k, dtype=dtype)
    x = torch.randn(tokens, HIDDEN, generator=_generator(100 + tokens)).to(dtype)
    _, weights, idx = block.gate(x)
    weights = weights.float()
    w_gate_up, w_down = _layer_weights(block)
    if tokens > 2:  # the reference against transformers' whole block
        want = block(x[None]).float()[0]
        assert relative_error(local.moe_local_reference(x, idx, weights, w_gate_up, w_down), want) <= TOLERANCE[dtype]
        idx[1, :] = -1  # a token routed nowhere: zeros
        idx[2, -1] = -1  # a pair of none
    expected = local.moe_local_reference(x, idx, weights, w_gate_up, w_down)
    saved, policy.DENSE_TOKENS = policy.DENSE_TOKENS, dense_tokens
    try:
        out = torch.full((tokens, HIDDEN), POISON, dtype=dtype, device=w.device)
        args = [t.to(w.device) for t in (x, idx, weights, w_gate_up, w_down)]
        got = ops.moe_local(*args, out=out).cpu()
        second = ops.moe_local(*args).cpu() if again else got
    finally:
        policy.DENSE_TOKENS = saved
    what = f"{dtype} top-{top_k}, {tokens} tokens, {'dense' if dense_tokens else 'sorted'}"
    assert torch.equal(got, second), f"{what}: a second call gave other bits"
    if tokens > 2:
        assert (got[1] == 0).all(), f"{what}: a token routed nowhere is not zero"
    if tokens:
        error = relative_error(got.float(), expected)
        assert error <= TOLERANCE[dtype], f"{what}: relative error {error:.2e}"


def _duplicates(w):
    """An expert named twice by one token counts twice (its weights added), in both layouts."""
    block = _block(3, True, seed=5)
    x = torch.randn(4, HIDDEN, generator=_generator(5)).to(torch.bfloat16)
    idx = torch.tensor([[1, 1, 2], [3, 4, 3], [0, 5, 6], [7, 7, 7]])
    weights = torch.rand(4, 3, generator=_generator(6))
    w_gate_up, w_down = _layer_weights(block)
    expected = local.moe_local_reference(x, idx, weights, w_gate_up, w_down)
    for dense_tokens in (policy.DENSE_TOKENS, 0):
        saved, policy.DENSE_TOKENS = policy.DENSE_TOKENS, dense_tokens
        try:
            got = ops.moe_local(*[t.to(w.device) for t in (x, idx, weights, w_gate_up, w_down)]).cpu()
        finally:
            policy.DENSE_TOKENS = saved
        assert relative_error(got.float(), expected) <= TOLERANCE[torch.bfloat16]


def _bad_input(w):
    block = _block(2, True, seed=1)
    x = torch.randn(3, HIDDEN).to(torch.bfloat16).to(w.device)
    w_gate_up, w_down = (t.to(w.device) for t in _layer_weights(block))
    idx = torch.zeros(3, 2, dtype=torch.int64, device=w.device)
    weights = torch.ones(3, 2, device=w.device)
    cases = [((x, idx, weights, w_gate_up, w_down[:, :8].contiguous()), "w_gate_up must be"),
             ((x, idx.int(), weights, w_gate_up, w_down), "topk_idx has dtype"),
             ((x, idx[:2], weights[:2], w_gate_up, w_down), "must both be"),
             ((x.float(), idx, weights, w_gate_up, w_down), "x has dtype"),
             ((x, idx, weights, w_gate_up.half(), w_down), "w_gate_up has dtype")]
    if checks.host_reads(idx):  # the ids' values: read on the host in the emulator and in debug mode only
        cases.append(((x, idx + EXPERTS, weights, w_gate_up, w_down), "expert ids in -1"))
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            ops.moe_local(*args)
    with pytest.raises(ValueError, match="top_k must be"):
        ops.moe_route(torch.zeros(3, EXPERTS, device=w.device), EXPERTS + 1)


def _layers(w):
    """The MoE layers and the block at world size 1: the local path (no EPBuffer), against
    transformers' block."""
    from tridist.nn import moe as nn_moe

    for top_k in (2, 3):
        block = _block(top_k, True, seed=top_k)
        w_gate_up, w_down = _layer_weights(block)
        for tokens in (1, 17):
            x = torch.randn(1, tokens, HIDDEN, generator=_generator(tokens)).to(torch.bfloat16)
            want = block(x).float()
            for layer in (tridist.nn.ExpertParallelMoE(EXPERTS, HIDDEN, INNER, tokens),
                          tridist.nn.TensorParallelMoE(EXPERTS, HIDDEN, INNER)):
                layer.load(w_gate_up.to(w.device), w_down.to(w.device))
                sparse = tridist.nn.ParallelSparseMoeBlock(block.gate.weight.to(w.device), top_k, True, layer)
                got = sparse(x.to(w.device)).float().cpu()
                assert got.shape == want.shape
                error = relative_error(got, want)
                assert error <= TOLERANCE[torch.bfloat16], f"{type(layer).__name__} top-{top_k}: {error:.2e}"
    assert not nn_moe._shared, "an EP layer at world size 1 allocated an EPBuffer"
    # An activation other than SiLU: the experts unfused, the same meaning.
    block = _block(2, True, seed=9)
    w_gate_up, w_down = _layer_weights(block)
    x = torch.randn(5, HIDDEN, generator=_generator(9)).to(torch.bfloat16)
    _, weights, idx = block.gate(x)
    idx[0, 1] = -1
    layer = tridist.nn.ExpertParallelMoE(EXPERTS, HIDDEN, INNER, 5, activation=F.gelu)
    layer.load(w_gate_up.to(w.device), w_down.to(w.device))
    got = layer(x.to(w.device), idx.to(w.device), weights.float().to(w.device)).float().cpu()
    expected = torch.zeros(5, HIDDEN)
    for t in range(5):
        for j in range(2):
            e = idx[t, j].item()
            if e >= 0:
                gate, up = (x[t].float() @ w_gate_up[e].float()).split(INNER)
                expected[t] += weights[t, j].float() * ((F.gelu(gate) * up).to(torch.bfloat16).float()
                                                        @ w_down[e].float())
    assert relative_error(got, expected) <= TOLERANCE[torch.bfloat16]
    tridist.barrier_all()


def _custom_ops(w):
    """The block through the custom ops under torch.compile (their fakes give the shapes)."""
    block = _block(2, True, seed=4)
    w_gate_up, w_down = (t.to(w.device) for t in _layer_weights(block))
    router = block.gate.weight.detach().to(w.device)
    x = torch.randn(3, HIDDEN, generator=_generator(4)).to(torch.bfloat16)

    def moe(x):
        idx, weights = torch.ops.tridist.moe_route(F.linear(x, router), 2, True)
        return torch.ops.tridist.moe_local(x, idx, weights, w_gate_up, w_down)

    got = torch.compile(moe, backend="eager", fullgraph=True)(x.to(w.device)).float().cpu()
    assert relative_error(got, block(x[None]).float()[0]) <= TOLERANCE[torch.bfloat16]


@pytest.mark.worlds("1")
def test_router_matches_transformers(world):
    world.run(_router)


@pytest.mark.worlds("1")
def test_experts_match_the_block(world):
    world.run(_experts)
    world.run(_duplicates)


@pytest.mark.worlds("1")
def test_moe_local_bad_input(world):
    world.run(_bad_input)


@pytest.mark.worlds("1")
def test_layers_at_world_size_1(world):
    world.run(_layers)


@pytest.mark.worlds("1")
def test_custom_ops_under_torch_compile(world):
    world.run(_custom_ops)


# Qwen3-30B-A3B's expert shapes (E, hidden, I, top-k): its decode batches and a prefill, on GPUs only
# (the emulator would take minutes). On 2026-12-07 the bench's batch-1 decode step of that model
# failed its check on an H100 after a 4096-token prefill, while every test at the tiny dims passed.
REAL = (128, 2048, 768, 8)


def _real_shapes(w):
    experts, hidden, inner, top_k = REAL
    g = _generator(7)
    w_gate_up = (torch.randn(experts, hidden, 2 * inner, generator=g) / hidden ** 0.5).to(torch.bfloat16).to(w.device)
    w_down = (torch.randn(experts, inner, hidden, generator=g) / inner ** 0.5).to(torch.bfloat16).to(w.device)
    weights_before = [t.clone() for t in (w_gate_up, w_down)]
    for tokens in (1, 2, 8, 64, 65, 4096, 1):  # the last 1 after a prefill's sorted rows
        x = torch.randn(tokens, hidden, generator=_generator(tokens)).to(torch.bfloat16).to(w.device)
        idx, weights = ops.moe_route(torch.randn(tokens, experts, generator=_generator(tokens + 1)).to(w.device), top_k)
        inputs = [t.clone() for t in (x, idx, weights)]
        out = torch.full((tokens, hidden), POISON, dtype=torch.bfloat16, device=w.device)
        ops.moe_local(x, idx, weights, w_gate_up, w_down, out=out)
        expected = local.moe_local_reference(x, idx, weights, w_gate_up, w_down)
        error = relative_error(out.float(), expected)
        assert error <= TOLERANCE[torch.bfloat16], f"{tokens} tokens: relative error {error:.2e}"
        assert all(torch.equal(a, b) for a, b in zip(inputs, (x, idx, weights))), f"{tokens} tokens: inputs changed"
    assert all(torch.equal(a, b) for a, b in zip(weights_before, (w_gate_up, w_down))), "the weights changed"


@pytest.mark.worlds("1")
def test_experts_at_the_real_model_shapes(world):
    if world.backend == "emulator":
        pytest.skip("the real model's shapes take minutes in the emulator: GPUs only")
    world.run(_real_shapes)


def _bench(w):
    """`tridist bench moe_local`'s checks on its emulator layer: the dense rows and the sorted rows,
    the policy's tiles and the sweep's, each against the reference and the same bits twice."""
    from tridist.bench import moe_local as bench

    layer = bench.Layer(*bench.EMULATOR_LAYER, w.device)
    rows = bench.run(layer, [1, 70], timed=False)
    assert [row["rows"] for row in rows] == ["dense", "sorted"], rows
    assert all(row["rel err"] <= bench.TOLERANCE and row["same bits"] for row in rows), rows
    every, best = bench.sweep(layer, [3, 70], timed=False)
    assert len(best) == 2 and len(every) == 4 and not any("error" in row for row in every), every
    with pytest.raises(argparse.ArgumentTypeError, match="four positive integers"):
        bench.parse_layer("128x2048x768")


@pytest.mark.worlds("1")
def test_moe_local_bench_checks(world):
    world.run(_bench)
