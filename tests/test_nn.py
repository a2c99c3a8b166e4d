"""tridist.nn: transformers decoders sharded with `parallelize` (tiny configs, built by
examples/llm.py as users run it) against the whole model, prefill and decode with transformers'
KV cache; the inputs it refuses; and the layers alone against torch."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tridist
import tridist.nn
from tridist.nn import moe as nn_moe

from .harness import GROUP_LAYOUTS, join_groups, load_script

transformers = pytest.importorskip("transformers")


def _in_group(w, layout):
    """(index of this rank's group, its process group, its size, this rank's index in it): those of
    `layout` (harness.GROUP_LAYOUTS), or of the world where layout is None."""
    if layout is None:
        return 0, None, w.world_size, w.rank
    index, members, made = join_groups(layout)
    return index, made[index], len(members), members.index(w.rank)


def _same_within_groups(results, layout):
    """Every rank's result (a list of tensors) the same bits as the first rank's of its group."""
    partition = GROUP_LAYOUTS[layout][0] if layout else [list(range(len(results)))]
    for members in partition:
        for rank in members[1:]:
            assert all(torch.equal(a, b) for a, b in zip(results[members[0]], results[rank])), \
                f"rank {rank}'s results differ from rank {members[0]}'s"


def _matches_whole_model(w, model, moe, batch, prompt_tokens, new_tokens, low_latency_tokens, layout=None):
    """Every step's logits within the example's tolerance of the whole model's (fed the same tokens),
    the same greedy tokens; returns the logits, which must be the same bits on every rank (of the
    group: with `layout`, each group shards and runs the model on its own prompt).
    `low_latency_tokens` stands in for the EP layer's threshold so that a prefill of a few tokens
    runs EP's normal mode and a decode step its low-latency one."""
    example = load_script("examples", "llm")
    index, group, _, _ = _in_group(w, layout)
    threshold, nn_moe.LOW_LATENCY_TOKENS = nn_moe.LOW_LATENCY_TOKENS, low_latency_tokens
    try:
        sharded = example.build_model(example.tiny_config(model), w.device)
        whole = copy.deepcopy(sharded)
        tridist.nn.parallelize(sharded, moe=moe, group=group)
        prompt = torch.randint(0, 128, (batch, prompt_tokens), generator=torch.Generator().manual_seed(1 + index))
        tokens, steps, _ = example.generate(sharded, prompt.to(w.device), new_tokens)
    finally:
        nn_moe.LOW_LATENCY_TOKENS = threshold
    error, wrong = example.compare(steps, example.teacher_forced(whole, prompt.to(w.device), tokens))
    assert error < example.LOGITS_TOLERANCE and wrong == 0, \
        f"rank {w.rank}: logits off by {error:.2e} of the largest, {wrong} steps with other tokens"
    return [step.cpu() for step in steps]


# MoE: a prefill of 3 tokens a rank in EP's normal mode, decode steps of one token a rank in its
# low-latency mode; tensor-parallel experts (ag_moe, moe_rs) the same way.
CASES = {"qwen3-moe-ep": dict(model="qwen3-moe", moe="ep", batch=1, prompt_tokens=6, new_tokens=2),
         "qwen3-moe-tp": dict(model="qwen3-moe", moe="tp", batch=1, prompt_tokens=6, new_tokens=1)}


@pytest.mark.worlds("2")
@pytest.mark.parametrize("case", CASES)
def test_parallelize_matches_the_whole_model(world, case):
    results = world.run(_matches_whole_model, **CASES[case], low_latency_tokens=2)
    _same_within_groups(results, None)


@pytest.mark.worlds("4")
def test_parallelize_in_groups(world):
    """Two groups each shard the MoE model (its attention, experts and lm_head over the pair) and
    run it on their own prompt at once."""
    results = world.run(_matches_whole_model, **CASES["qwen3-moe-ep"], low_latency_tokens=2, layout="pairs")
    _same_within_groups(results, "pairs")


def _generates_like_the_whole_model(w, model, moe, cache, padded):
    """transformers' own `generate` (greedy, `cache` "static" or "dynamic") on the sharded model gives
    the whole model's tokens, up to the first step where the whole model's best two logits are a near
    tie; every step's logits until then within the example's tolerance. With `padded`, the second of
    two prompts is left-padded (its attention mask zero there), which tridist's decode attention
    must skip. Returns the tokens, which must be the same on every rank."""
    example = load_script("examples", "llm")
    sharded = example.build_model(example.tiny_config(model), w.device)
    whole = copy.deepcopy(sharded)
    tridist.nn.parallelize(sharded, moe=moe)
    assert sharded.generation_config.disable_compile, "generate() would compile tridist's kernels with TorchInductor"
    prompt = torch.randint(1, 128, (2, 5), generator=torch.Generator().manual_seed(3)).to(w.device)
    mask = torch.ones_like(prompt)
    if padded:
        prompt[1, :2], mask[1, :2] = 0, 0
    options = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0, output_logits=True,
                   return_dict_in_generate=True, **({"cache_implementation": "static"} if cache == "static" else {}))
    got, want = sharded.generate(prompt, **options), whole.generate(prompt, **options)
    same = (got.sequences == want.sequences).all(dim=0)
    steps = int(same[prompt.shape[1]:].long().cumprod(0).sum()) + 1  # up to the first step that differs
    error, wrong = example.compare(list(got.logits[:steps]), list(want.logits[:steps]))
    assert error < example.LOGITS_TOLERANCE and wrong == 0, \
        f"rank {w.rank}: logits off by {error:.2e} of the largest, {wrong} steps with other tokens"
    nn_moe.free_buffers()
    return got.sequences.cpu()


GENERATE_CASES = {"llama-static": ("llama", "ep", "static", False), "llama-dynamic-padded": ("llama", "ep", "dynamic", True),
                  "qwen3-static-padded": ("qwen3", "ep", "static", True), "qwen3-dynamic": ("qwen3", "ep", "dynamic", False),
                  "qwen3-moe-ep-static": ("qwen3-moe", "ep", "static", False),
                  "qwen3-moe-tp-dynamic": ("qwen3-moe", "tp", "dynamic", True)}


@pytest.mark.worlds("1", "2")
@pytest.mark.parametrize("case", GENERATE_CASES)
def test_generate_matches_the_whole_model(world, case):
    model, moe, cache, padded = GENERATE_CASES[case]
    results = world.run(_generates_like_the_whole_model, model=model, moe=moe, cache=cache, padded=padded)
    assert all(torch.equal(results[0], tokens) for tokens in results[1:]), "the ranks generated different tokens"


def _refuses(w):
    example = load_script("examples", "llm")
    config = example.tiny_config("qwen3-moe")
    config.num_key_value_heads = 1
    with pytest.raises(ValueError, match="num_key_value_heads"):
        tridist.nn.parallelize(example.build_model(config, w.device))
    config = example.tiny_config("qwen3-moe")
    config.moe_intermediate_size = 24  # 12 a rank
    with pytest.raises(ValueError, match="moe_intermediate_size .* multiples of 8"):
        tridist.nn.parallelize(example.build_model(config, w.device), moe="tp")
    model = example.build_model(example.tiny_config("qwen3-moe"), w.device)
    q_proj = model.model.layers[0].self_attn.q_proj
    with pytest.raises(ValueError, match="moe must be one of"):
        tridist.nn.parallelize(model, moe="dp")
    with pytest.raises(TypeError, match="group must be a torch.distributed.ProcessGroup"):
        tridist.nn.parallelize(model, group=w.world_size)
    alone = dist.new_group([0])  # every rank makes it; rank 1 is not a member
    if w.rank:
        with pytest.raises(ValueError, match="rank 1 is not a member"):
            tridist.nn.parallelize(model, group=alone)
    # Each rank's own weights (as when a rank built from a config another rank had changed): every rank
    # refuses, naming the first parameter that differs.
    config = example.tiny_config("qwen3")
    torch.manual_seed(w.rank)
    with torch.device(w.device):
        mixed = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    with pytest.raises(ValueError, match="weights differ between ranks, first in model.embed_tokens.weight"):
        tridist.nn.parallelize(mixed)
    assert model.model.layers[0].self_attn.q_proj is q_proj, "a refused model must be left as it was"
    with pytest.raises(ValueError, match="must split over the 2 ranks"):
        tridist.nn.ColumnParallelLinear(64, 3)


@pytest.mark.worlds("2")
def test_parallelize_refuses_what_it_cannot_split(world):
    world.run(_refuses)


def _refuses_configs(w):
    """What tridist's layers cannot run is refused before anything changes, saying what."""
    example = load_script("examples", "llm")
    model = example.build_model(example.tiny_config("qwen3"), w.device)
    with pytest.raises(ValueError, match=r"bf16 or fp16 .* model.to\(torch.bfloat16\)"):
        tridist.nn.parallelize(model.float())
    config = example.tiny_config("qwen3")
    config.layer_types = ["sliding_attention", "full_attention"]
    with pytest.raises(NotImplementedError, match="sliding-window attention is not supported"):
        tridist.nn.parallelize(example.build_model(config, w.device))
    config = example.tiny_config("llama")
    config.hidden_act = "gelu"
    with pytest.raises(NotImplementedError, match="SiLU.* 'gelu'"):
        tridist.nn.parallelize(example.build_model(config, w.device))
    config = example.tiny_config("llama")
    config.rope_parameters = {**config.rope_parameters, "rope_type": "linear", "factor": 2.0,
                              "partial_rotary_factor": 0.5}
    with pytest.raises(NotImplementedError, match="rotates whole heads only"):
        tridist.nn.parallelize(example.build_model(config, w.device))
    with pytest.raises(NotImplementedError, match="a family it has a plan for"):
        tridist.nn.parallelize(torch.nn.Linear(4, 4))


@pytest.mark.worlds("1")
def test_parallelize_refuses_what_its_layers_cannot_run(world):
    world.run(_refuses_configs)


def _layers(w, layout=None):
    """A Megatron MLP block with sequence-parallel inputs (ag_gemm in, gemm_rs out), column outputs
    gathered, and replicated rows through each of the row layer's kernels, each against torch on the
    whole tensors; with `layout`, in each of its groups at once, on the group's own data."""
    index, group, n, me = _in_group(w, layout)
    g = torch.Generator().manual_seed(2 + index)
    hidden, inner = 32, 16 * n
    x = torch.randn(4 * n, hidden, generator=g).to(torch.bfloat16)
    up, down = torch.nn.Linear(hidden, inner, bias=True), torch.nn.Linear(inner, hidden, bias=True)
    for param in (*up.parameters(), *down.parameters()):
        param.data = torch.randn(param.shape, generator=g).div(param.shape[-1] ** 0.5).to(torch.bfloat16)
    up.to(w.device), down.to(w.device)
    column = tridist.nn.ColumnParallelLinear.from_linear(up, sequence_parallel=True, group=group)
    row = tridist.nn.RowParallelLinear.from_linear(down, sequence_parallel=True, group=group)
    mine = slice(me * 4, (me + 1) * 4)
    h = torch.relu(column(x[mine].to(w.device)))
    expected_up = x.float() @ up.weight.float().cpu().t() + up.bias.float().cpu()
    expected_h = torch.relu(expected_up)
    columns = slice(me * column.out_local, (me + 1) * column.out_local)
    torch.testing.assert_close(h.float().cpu(), expected_h[:, columns], rtol=2e-2, atol=2e-2)
    expected = expected_h @ down.weight.float().cpu().t() + down.bias.float().cpu()
    torch.testing.assert_close(row(h).float().cpu(), expected[mine], rtol=2e-2, atol=3e-2)

    gathered = tridist.nn.ColumnParallelLinear.from_linear(up, gather_output=True, group=group)
    torch.testing.assert_close(gathered(x.to(w.device)).float().cpu(), expected_up, rtol=2e-2, atol=2e-2)
    replicated = tridist.nn.RowParallelLinear.from_linear(down, group=group)
    partial = tridist.nn.RowParallelLinear.from_linear(down, sum_output=False, group=group)
    a = torch.randn(14 * n, inner, generator=g).to(torch.bfloat16)
    for rows in (2, 13):  # decode rows, and a count that is no multiple of anything
        want = a[:rows].float() @ down.weight.float().cpu().t() + down.bias.float().cpu()
        got = replicated(a[:rows, columns].to(w.device))
        torch.testing.assert_close(got.float().cpu(), want, rtol=2e-2, atol=3e-2)
        got = tridist.ops.all_reduce(partial(a[:rows, columns].to(w.device)).contiguous(), group=group)
        torch.testing.assert_close(got.float().cpu(), want, rtol=2e-2, atol=3e-2)

    # Fused: three linears of their own sizes (q, k, v) in one GEMM, each split by its rows; gate and
    # up with SiLU(gate) * up in the epilogue.
    q, k, v = (torch.nn.Linear(hidden, size * n, bias=True) for size in (16, 8, 8))
    gate = torch.nn.Linear(hidden, inner, bias=False)
    for param in (*q.parameters(), *k.parameters(), *v.parameters(), *gate.parameters()):
        param.data = torch.randn(param.shape, generator=g).div(param.shape[-1] ** 0.5).to(torch.bfloat16)
    for linear_ in (q, k, v, gate):
        linear_.to(w.device)
    qkv = tridist.nn.ColumnParallelLinear.from_linears([q, k, v], group=group)
    assert qkv.parts == (16, 8, 8)
    got = qkv(x.to(w.device)).float().cpu().split(qkv.parts, dim=-1)
    for piece, whole in zip(got, (q, k, v)):
        want = x.float() @ whole.weight.float().cpu().t() + whole.bias.float().cpu()
        part = whole.out_features // n
        torch.testing.assert_close(piece, want[:, me * part:(me + 1) * part], rtol=2e-2, atol=2e-2)
    up.bias = None
    gate_up = tridist.nn.ColumnParallelLinear.from_linears([gate, up], activation="swiglu", group=group)
    want = F.silu(x.float() @ gate.weight.float().cpu().t()) * (x.float() @ up.weight.float().cpu().t())
    torch.testing.assert_close(gate_up(x.to(w.device)).float().cpu(), want[:, columns], rtol=3e-2, atol=3e-2)
    tridist.barrier_all()


def _decode_attention(w, layout=None):
    """Decode attention over a cache split by position against torch on the whole cache; with
    `layout`, in each of its groups at once, on the group's own data."""
    index, group, n, me = _in_group(w, layout)
    g = torch.Generator().manual_seed(4 + index)
    batch, heads, kv_heads, dim = 2, 4, 2, 64
    q = torch.randn(batch, heads, dim, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(batch, 6 * n, kv_heads, dim, generator=g).to(torch.bfloat16) for _ in range(2))
    attention = tridist.nn.DecodeAttention(heads, dim, kv_heads, group=group)
    positions = slice(me * 6, (me + 1) * 6)
    mine = [cache[:, positions].contiguous().to(w.device) for cache in (k, v)]
    got = attention(q.to(w.device), *mine, torch.full((batch,), 6, dtype=torch.int32, device=w.device))
    k, v = (cache.float().repeat_interleave(heads // kv_heads, dim=2) for cache in (k, v))
    scores = torch.einsum("bhd,blhd->bhl", q.float(), k) / dim ** 0.5
    want = torch.einsum("bhl,blhd->bhd", scores.softmax(-1), v)
    torch.testing.assert_close(got.float().cpu(), want, rtol=2e-2, atol=2e-2)
    tridist.barrier_all()


@pytest.mark.worlds("1", "2")
def test_layers_match_torch(world):
    world.run(_layers)
    world.run(_decode_attention)


@pytest.mark.worlds("4")
def test_layers_in_groups(world):
    world.run(_layers, layout="pairs")


@pytest.mark.worlds("4")
def test_decode_attention_in_groups(world):
    world.run(_decode_attention, layout="pairs")


def _moe_layers(w, layout=None):
    """Both MoE layers on random tokens and routing (the EP layer in each of its modes, a token routed
    nowhere among them) against every expert computed in fp32 on the whole weights; with `layout`,
    in each of its groups at once, on the group's own tokens and weights."""
    index, group, n, me = _in_group(w, layout)
    g = torch.Generator().manual_seed(3 + index)
    tokens, hidden, inner, experts, top_k = 5, 64, 32, 4, 2
    every_x = torch.randn(n, tokens, hidden, generator=g).to(torch.bfloat16)
    every_idx = torch.rand(n, tokens, experts, generator=g).topk(top_k, dim=-1).indices
    every_weights = torch.rand(n, tokens, top_k, generator=g)
    w_gate_up = (torch.randn(experts, hidden, 2 * inner, generator=g) / hidden ** 0.5).to(torch.bfloat16)
    w_down = (torch.randn(experts, inner, hidden, generator=g) / inner ** 0.5).to(torch.bfloat16)
    x, idx, weights = every_x[me], every_idx[me], every_weights[me]
    expected = torch.zeros(tokens, hidden)
    for e in range(experts):
        share = (weights * (idx == e)).sum(dim=1, keepdim=True)
        gate, up = (x.float() @ w_gate_up[e].float()).chunk(2, dim=-1)
        expected += share * ((F.silu(gate) * up) @ w_down[e].float())
    ep_idx = idx.clone()
    ep_idx[-1] = -1  # routed nowhere: zeros
    ep_expected = expected.clone()
    ep_expected[-1] = 0

    ep = tridist.nn.ExpertParallelMoE(experts, hidden, inner, tokens, group=group)
    ep.load(w_gate_up.to(w.device), w_down.to(w.device))
    for low_latency_tokens in (nn_moe.LOW_LATENCY_TOKENS, 0):  # the low-latency mode, then the normal one
        nn_moe.LOW_LATENCY_TOKENS, saved = low_latency_tokens, nn_moe.LOW_LATENCY_TOKENS
        try:
            got = ep(x.to(w.device), ep_idx.to(w.device), weights.to(w.device))
        finally:
            nn_moe.LOW_LATENCY_TOKENS = saved
        torch.testing.assert_close(got.float().cpu(), ep_expected, rtol=2e-2, atol=2e-2)
    # Room for more tokens than the call has: the low-latency mode's pairs are sized by the call's.
    ep.reserve(4 * tokens)
    got = ep(x.to(w.device), ep_idx.to(w.device), weights.to(w.device))
    torch.testing.assert_close(got.float().cpu(), ep_expected, rtol=2e-2, atol=2e-2)
    if w.backend == "emulator" and layout is None:  # every call agrees there: fewer tokens, or none, refused
        for fewer in (tokens - 1, 0):
            mine = slice(0, fewer if me == 0 else tokens)
            with pytest.raises(ValueError, match="tokens a rank"):
                ep(x[mine].to(w.device), ep_idx[mine].to(w.device), weights[mine].to(w.device))
    nn_moe.free_buffers()
    tp = tridist.nn.TensorParallelMoE(experts, hidden, inner, group=group)
    tp.load(w_gate_up.to(w.device), w_down.to(w.device))
    got = tp(x.to(w.device), idx.to(w.device), weights.to(w.device))
    torch.testing.assert_close(got.float().cpu(), expected, rtol=2e-2, atol=2e-2)
    tridist.barrier_all()


@pytest.mark.worlds("2")
def test_moe_layers_match_torch(world):
    world.run(_moe_layers)


@pytest.mark.worlds("4")
def test_moe_layers_in_groups(world):
    world.run(_moe_layers, layout="pairs")
