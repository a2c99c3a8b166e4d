"""Stress cases of decode attention (`tridist.ops.attention`, family "attention"): flash_decode over a
KV cache split by position across the ranks, through the function and through `FlashDecode`.

Caches contiguous or paged (blocks of 1 to 64 positions, in a random order, with blocks no sequence
uses), bf16 and fp16, head dims 64 and 128, 1 to 32 query heads per KV head, sm_scale the default
or drawn (sharper or flatter scores), now and then a config with a fixed number of chunks per
sequence (class form: the function takes no config). The positions each rank holds of each
sequence are drawn per call (and per graph replay): none on any rank (the output is zeros), all on
one rank, or any number on each, none and all often. Positions a rank does not hold are NaN (past
seqlens, unused blocks and block tails), and block-table entries past a sequence's blocks point
outside the cache: none may be read.

Every rank makes q (the same on every rank) and every rank's cache from the call's seed and
computes the attention over the gathered positions in float64; its output (poisoned with NaN
first in the class form, which takes `out`) must be within `attention_tolerance`.

Shape (`Call.shape`): (batch, query heads, KV heads, head dim, positions a rank's cache holds of
each sequence, block size: 0 for a contiguous cache); method: the layout; config: a FlashDecode
config and/or sm_scale.
"""
import random

import torch

from tridist import ops
from tridist.ops.attention import decode, policy

from .cases import (Expected, Invalid, OpCases, Trial, _UNIT_ROUNDOFF, count_with_edges, log_uniform, poison,
                    random_tensor, register, round_up, seed_of)

BLOCK_SIZES = (1, 4, 16, 64)
MAX_BATCH, MAX_KV_HEADS = 8, 8
SPARE_BLOCKS = 3  # blocks of a paged cache that no sequence uses
CONFIG_SHARE = 1 / 4  # calls with a config of a fixed number of chunks per sequence
MAX_SPLITS = 8
# In the emulator a call costs about 0.03 s per program of the split-KV kernel (a program per
# sequence, KV head and chunk): 0.09 s for one, 1.3 s for 3 sequences x 2 KV heads x 8 chunks at
# 2 ranks on 2 cores. There the batch, KV heads and chunks stay small.
EMULATOR_BATCH, EMULATOR_KV_HEADS, EMULATOR_SPLITS = 2, 2, 3


class FlashDecodeCases(OpCases):
    name, family = "flash_decode", "attention"

    def draw(self, rng, world, limits):
        dtype = rng.choice(decode.DTYPES)
        head_dim = rng.choice(decode.HEAD_DIMS)
        gpu = world.device.type == "cuda"
        batch = log_uniform(rng, 1, MAX_BATCH if gpu else EMULATOR_BATCH)
        kv_heads = log_uniform(rng, 1, MAX_KV_HEADS if gpu else EMULATOR_KV_HEADS)
        q_heads = kv_heads * log_uniform(rng, 1, decode.MAX_GROUP)
        block = rng.choice(BLOCK_SIZES) if rng.random() < 0.5 else 0
        most = limits.nbytes // (batch * kv_heads * head_dim * dtype.itemsize)  # positions a cache may hold
        if most < max(1, block):
            raise Invalid("flash_decode: a cache of one position (or block) a sequence passes the size limit")
        positions = log_uniform(rng, 1, most)
        if block:
            positions = min(round_up(positions, block), most // block * block)
        config = {}
        if rng.random() < CONFIG_SHARE:
            config.update(rng.choice(policy.configs(world.device)),
                          splits=rng.randint(1, MAX_SPLITS if gpu else EMULATOR_SPLITS))
            del config["programs_per_sm"]
        if rng.random() < 0.5:
            config["sm_scale"] = round(rng.uniform(0.02, 1.0), 3)
        return dict(method="paged" if block else "contiguous", dtype=dtype,
                    shape=(batch, q_heads, kv_heads, head_dim, positions, block), config=config or None)

    def forms_for(self, fields):
        return ("class",) if fields["config"] and "splits" in fields["config"] else self.forms

    def trial(self, call, world):
        return FlashDecodeTrial(call, world)


def attention_tolerance(reference: torch.Tensor, weighted_v: torch.Tensor, score_error: torch.Tensor,
                        dtype: torch.dtype) -> torch.Tensor:
    """Per-element bound for decode attention out = sum_n p_n v_n with `weighted_v` = sum_n p_n |v_n|
    and `score_error` the most a score may err in fp32 (head dim 2^-24 sm_scale max_n sum |q| |k_n|).

    The probabilities meet V rounded to `dtype` (u p_n each: u `weighted_v`), the output is rounded
    once (u |out|); scores that err by d move the probabilities by a factor within e^(+-2d), so out
    by about 2d `weighted_v`. Chunks, their merges and the ranks' combine are fp32. Twice that is
    allowed (the emulator casts to bf16 by truncation, which errs by up to 2u), plus the smallest
    subnormal of `dtype` (a sequence that no rank holds: zeros)."""
    u = _UNIT_ROUNDOFF[dtype]
    bound = (u * reference.abs() + (u + 2 * score_error) * weighted_v
             + torch.finfo(dtype).tiny * torch.finfo(dtype).eps)
    return 2 * bound


class FlashDecodeTrial(Trial):
    """q, this rank's caches (contiguous [B, L, Hkv, D], or a pool of blocks with a block table),
    seqlens, out."""

    def __init__(self, call, world):
        self.spec, self.world = call, world
        batch, q_heads, kv_heads, head_dim, positions, block = call.shape
        device = world.device
        self.q = torch.empty(batch, q_heads, head_dim, dtype=call.dtype, device=device)
        if block:
            self.blocks_per_sequence = positions // block
            self.blocks = batch * self.blocks_per_sequence + SPARE_BLOCKS
            cache = (self.blocks, block, kv_heads, head_dim)
            self.block_table = torch.empty(batch, self.blocks_per_sequence, dtype=torch.int32, device=device)
        else:
            cache, self.block_table = (batch, positions, kv_heads, head_dim), None
        self.k, self.v = (torch.empty(cache, dtype=call.dtype, device=device) for _ in range(2))
        self.seqlens = torch.empty(batch, dtype=torch.int32, device=device)
        self.out = torch.empty_like(self.q)
        config = dict(call.config or {})
        self.sm_scale = config.pop("sm_scale", None)
        self.config = config or None

    def _lengths(self, rng: random.Random) -> list[list[int]]:
        """Every rank's positions of each sequence: none anywhere, all on one rank, or any number on each."""
        W, positions = self.world.world_size, self.spec.shape[4]
        by_sequence = []
        for _ in range(self.spec.shape[0]):
            roll = rng.random()
            if roll < 0.1:
                by_sequence.append([0] * W)
            elif roll < 0.3:
                only = rng.randrange(W)
                by_sequence.append([positions if rank == only else 0 for rank in range(W)])
            else:
                by_sequence.append([count_with_edges(rng, positions) for _ in range(W)])
        return [list(rank) for rank in zip(*by_sequence)]

    def fill(self, seed):
        W, me, device, dtype = self.world.world_size, self.world.rank, self.world.device, self.spec.dtype
        batch, q_heads, kv_heads, head_dim, positions, block = self.spec.shape
        rng = random.Random(seed_of(seed, "lengths"))
        lengths = self._lengths(rng)
        q = random_tensor(tuple(self.q.shape), dtype, seed_of(seed, "q"), device)
        caches = []  # every rank's (k, v), NaN past its lengths
        for rank in range(W):
            k, v = (random_tensor((batch, positions, kv_heads, head_dim), dtype, seed_of(seed, rank, name), device)
                    for name in ("k", "v"))
            for b, length in enumerate(lengths[rank]):
                k[b, length:], v[b, length:] = float("nan"), float("nan")
            caches.append((k, v))
        expected = self._reference(q, caches, lengths)
        poison(self.out, expected)
        self.q.copy_(q)
        self.seqlens.copy_(torch.tensor(lengths[me], dtype=torch.int32))
        k, v = caches[me]
        if not block:
            self.k.copy_(k)
            self.v.copy_(v)
            return expected
        # Paged: each sequence's blocks at random places of the pool, the table's unused entries out of range.
        order = torch.randperm(self.blocks, generator=torch.Generator().manual_seed(seed_of(seed, me, "blocks")))
        table = torch.full((batch, self.blocks_per_sequence), self.blocks + 7, dtype=torch.int32)
        self.k.fill_(float("nan"))
        self.v.fill_(float("nan"))
        for b, length in enumerate(lengths[me]):
            used = -(-length // block)
            table[b, :used] = order[b * self.blocks_per_sequence:][:used].to(torch.int32)
            places = table[b, :used].long().to(device)
            self.k[places] = k[b].view(self.blocks_per_sequence, block, kv_heads, head_dim)[:used]
            self.v[places] = v[b].view(self.blocks_per_sequence, block, kv_heads, head_dim)[:used]
        self.block_table.copy_(table)
        return expected

    def _reference(self, q, caches, lengths) -> Expected:
        """float64 attention of each sequence over every rank's positions, and its bound."""
        batch, q_heads, kv_heads, head_dim, _, _ = self.spec.shape
        scale = head_dim ** -0.5 if self.sm_scale is None else self.sm_scale
        group = q_heads // kv_heads
        out = torch.zeros(batch, q_heads, head_dim, dtype=torch.float64, device=q.device)
        weighted_v, score_error = torch.zeros_like(out), torch.zeros_like(out)
        for b in range(batch):
            k = torch.cat([k[b, :length[b]] for (k, _), length in zip(caches, lengths)]).double()
            v = torch.cat([v[b, :length[b]] for (_, v), length in zip(caches, lengths)]).double()
            if k.shape[0] == 0:
                continue  # no rank holds a position: zeros
            queries = q[b].double().view(kv_heads, group, head_dim)
            p = torch.softmax(torch.einsum("hgd,nhd->hgn", queries, k) * scale, dim=-1)
            out[b] = torch.einsum("hgn,nhd->hgd", p, v).reshape(q_heads, head_dim)
            weighted_v[b] = torch.einsum("hgn,nhd->hgd", p, v.abs()).reshape(q_heads, head_dim)
            magnitude = torch.einsum("hgd,nhd->hgn", queries.abs(), k.abs()).amax(-1).reshape(q_heads, 1)
            score_error[b] = head_dim * 2.0 ** -24 * scale * magnitude
        return Expected(out, attention_tolerance(out, weighted_v, score_error, self.spec.dtype),
                        where=lambda i: f"sequence {i // (q_heads * head_dim)}, query head "
                                        f"{i // head_dim % q_heads}, element {i % head_dim}")

    def build(self):
        batch, q_heads, kv_heads, head_dim, _, _ = self.spec.shape
        return ops.FlashDecode(batch, q_heads, kv_heads, head_dim, self.spec.dtype, config=self.config)

    def call(self, op):
        if op is None:
            return ops.flash_decode(self.q, self.k, self.v, self.seqlens, self.block_table, self.sm_scale)
        return op(self.q, self.k, self.v, self.seqlens, self.block_table, self.sm_scale, out=self.out)


register(FlashDecodeCases())
