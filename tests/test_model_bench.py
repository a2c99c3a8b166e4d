"""`tridist bench model`: its checks on tiny dimensions (the timing needs GPUs): tridist.nn's model
(experts in EP mode; tests/test_nn.py runs both modes) and the torch + NCCL baseline (on gloo here),
each against the whole model."""
import argparse
import warnings

import pytest
import torch.distributed as dist

from tridist.bench import model as bench

from .harness import _free_port

pytest.importorskip("transformers")

TINY = {"dense": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      vocab_size=128, max_position_embeddings=256),
        "moe": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, vocab_size=128,
                    max_position_embeddings=256)}


def _bench(w, port):
    """On GPUs the world's NCCL group runs the baselines; in the emulator a gloo group made here."""
    warnings.filterwarnings("ignore", message=".*past_key_values.*")
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=w.rank, world_size=w.world_size)
    try:
        for kind in ("dense", "moe"):
            rows = bench.run(kind, 1, [], [], ["ep"], ["tridist", "megatron", "hf_tp"], timed=False,
                             dims=TINY[kind])
            # Untimed, a system that ran leaves no row; transformers' TP says why it did not run.
            assert all(row["system"] == "hf_tp" and "skipped" in row for row in rows), rows
            if w.device.type == "cpu":
                why = "transformers' tensor parallelism needs GPUs"
                assert rows == [{"model": kind, "system": "hf_tp", "skipped": why}]
    finally:
        if own_group:
            dist.destroy_process_group()


@pytest.mark.worlds("2")
def test_model_bench_checks(world):
    world.run(_bench, port=_free_port())


def test_model_bench_options():
    assert bench.parse_ints("1, 8,64") == [1, 8, 64] and bench.parse_ints("") == []
    for text in ("0", "1,x"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive integers"):
            bench.parse_ints(text)


def test_grouped_decode_attention_gives_sdpa_s_logits(monkeypatch):
    """The bench's decode attention (GQA's query heads as rows against their KV head) against
    transformers' SDPA, on one process: a prefill, then decode steps over a dynamic cache and over a
    static one only partly filled (its mask hides the empty positions). Only prefills go to SDPA."""
    import torch
    from transformers import DynamicCache, StaticCache
    from transformers.integrations import sdpa_attention

    warnings.filterwarnings("ignore", message=".*past_key_values.*")
    handed_on = []
    sdpa = sdpa_attention.sdpa_attention_forward

    def counted(module, query, *args, **kwargs):
        handed_on.append(query.shape[2])
        return sdpa(module, query, *args, **kwargs)

    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", counted)
    logits = {}
    for attention in ("sdpa", "grouped"):
        handed_on.clear()
        config = bench.make_config("dense", 2, TINY["dense"])
        bench.use_attention(config, attention)
        model = bench.build(config, torch.device("cpu")).float()
        ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
        got = []
        for cache in (DynamicCache(), StaticCache(config=config, max_cache_len=32)):
            got.append(model(ids[:, :6], past_key_values=cache, use_cache=True).logits)
            for step in range(6, 9):
                got.append(model(ids[:, step:step + 1], past_key_values=cache, use_cache=True,
                                 cache_position=torch.tensor([step])).logits)
        logits[attention] = got
    for grouped, reference in zip(logits["grouped"], logits["sdpa"]):
        torch.testing.assert_close(grouped, reference, rtol=1e-5, atol=1e-5)
    assert handed_on and 1 not in handed_on, "the grouped run's prefills only go to transformers' SDPA"


def _split_kv_attention(w, port):
    """The bench's split-KV decode attention (tridist's flash_decode among each rank alone) against
    the grouped SDPA one, in bf16 on every rank: a prefill (SDPA's), then decode steps over a dynamic
    cache (no mask) and over a static one partly filled (its mask says how many positions), head dim
    64 (the kernel takes 64 and 128)."""
    import torch
    from transformers import DynamicCache, StaticCache

    warnings.filterwarnings("ignore", message=".*past_key_values.*")
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=w.rank, world_size=w.world_size)
    import tridist

    flash_decode, calls = tridist.ops.flash_decode, []
    tridist.ops.flash_decode = lambda q, *args, **kwargs: calls.append(q.shape) or flash_decode(q, *args, **kwargs)
    try:
        logits = {}
        for attention in ("grouped", "split_kv"):
            config = bench.make_config("dense", 1, {**TINY["dense"], "head_dim": 64})
            bench.use_attention(config, attention)
            model = bench.build(config, w.device)
            ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(5)).to(w.device)
            got = []
            for cache in (DynamicCache(), StaticCache(config=config, max_cache_len=16)):
                model(ids[:, :6], past_key_values=cache, use_cache=True)
                for step in range(6, 8):
                    got.append(model(ids[:, step:step + 1], past_key_values=cache, use_cache=True,
                                     cache_position=torch.tensor([step], device=w.device)).logits.float())
            logits[attention] = got
        # Every decode step of the split-KV run, none of the grouped one: 2 caches x 2 steps, 1 layer,
        # 2 sequences x 2 KV heads of 2 query heads each.
        assert calls == [(4, 2, 64)] * 4, calls
        for split_kv, grouped in zip(logits["split_kv"], logits["grouped"]):
            scale = grouped.abs().max()
            assert (split_kv - grouped).abs().max() <= 2e-2 * scale, (split_kv - grouped).abs().max() / scale
    finally:
        tridist.ops.flash_decode = flash_decode
        bench._own_groups.clear()
        if own_group:
            dist.destroy_process_group()


@pytest.mark.worlds("2")
def test_split_kv_decode_attention_gives_grouped_logits(world):
    world.run(_split_kv_attention, port=_free_port())
