"""flash_decode: decode attention over a KV cache split by position across the ranks, against
`torch.nn.functional.scaled_dot_product_attention` in fp32 on the gathered cache.

Every rank builds every rank's slice from one seed, so each can compute the reference. Positions a
slice does not hold are NaN (past seqlens in a contiguous cache, unused blocks and block tails in a
paged one), and block-table entries past a sequence's blocks are out of range: none may be read.
Outputs are poisoned with NaN before the calls, and every rank must return the same bits."""
import argparse
import hashlib

import pytest
import torch
import torch.nn.functional as F

import tridist
from tridist import ops
from tridist.bench import flash_decode as bench
from tridist.bench.results import relative_error
from tridist.ops import attention
from tridist.runtime import config as settings

from .harness import group_layouts, join_groups, load_script

WORLDS = ("1", "2", "3", "4", "2x2", "2x1")  # 2x1: the inter-node path on two GPUs
# Largest |error| over largest |expected| against fp32 SDPA: the probabilities enter P @ V rounded to
# q's dtype, and the output is rounded to it (bf16 keeps 8 significant bits, fp16 11).
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _slices(w, batch, q_heads, kv_heads, head_dim, dtype, lengths, page, seed, capacity=None):
    """(q, [every rank's (k_cache, v_cache, seqlens, block_table)], [every sequence's gathered (K, V)]),
    on the CPU. `lengths[r][b]`: positions of sequence b on rank r; `page`: None (contiguous) or the
    block size of a paged cache; `capacity`: positions a cache holds (default: the most used)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, head_dim, generator=g).to(dtype)
    capacity = capacity or max(max(row) for row in lengths)
    slices, pieces = [], [[] for _ in range(batch)]
    for rank_lengths in lengths:
        k, v = (torch.randn(batch, capacity, kv_heads, head_dim, generator=g).to(dtype) for _ in range(2))
        for b, n in enumerate(rank_lengths):
            pieces[b].append((k[b, :n], v[b, :n]))
            k[b, n:], v[b, n:] = float("nan"), float("nan")
        seqlens = torch.tensor(rank_lengths, dtype=torch.int32)
        if page is None:
            slices.append((k, v, seqlens, None))
            continue
        per_sequence = -(-capacity // page)
        blocks = batch * per_sequence + 3  # a few blocks no sequence uses
        order = torch.randperm(blocks, generator=g)
        table = torch.full((batch, per_sequence), blocks + 7, dtype=torch.int32)  # out of range unless used
        pools = [torch.full((blocks, page, kv_heads, head_dim), float("nan"), dtype=dtype) for _ in range(2)]
        padded = per_sequence * page
        for b, n in enumerate(rank_lengths):
            used = -(-n // page)
            table[b, :used] = order[b * per_sequence:b * per_sequence + used].to(torch.int32)
            for pool, cache in zip(pools, (k, v)):
                rows = torch.full((padded, kv_heads, head_dim), float("nan"), dtype=dtype)
                rows[:n] = cache[b, :n]
                pool[table[b, :used].long()] = rows[:used * page].view(used, page, kv_heads, head_dim)
        slices.append((*pools, seqlens, table))
    gathered = [(torch.cat([k for k, _ in p]), torch.cat([v for _, v in p])) for p in pieces]
    return q, slices, gathered


def _reference(q, gathered, sm_scale):
    """fp32 SDPA per sequence over the gathered positions, on q's device; zeros for a sequence no
    rank holds."""
    rows = []
    for b, (k, v) in enumerate(gathered):
        if k.shape[0] == 0:
            rows.append(torch.zeros(q.shape[1:], device=q.device))
            continue
        out = F.scaled_dot_product_attention(q[b].float()[:, None], k.float().transpose(0, 1),
                                             v.float().transpose(0, 1), scale=sm_scale, enable_gqa=True)
        rows.append(out[:, 0])
    return torch.stack(rows)


def _on(device, t):
    return None if t is None else t.to(device)


def _decode(w, kv_heads, group, head_dim, dtype, page, lengths, config=None, sm_scale=None):
    """Back-to-back calls with new data each (a class built with `config`, into poisoned outputs; the
    function `flash_decode` when config is None). `lengths[call][r]`: rank r's lengths in that call.
    Returns this rank's outputs (compared across ranks by the test)."""
    batch = len(lengths[0][0])
    q_heads = kv_heads * group
    op = None if config is None else ops.FlashDecode(batch, q_heads, kv_heads, head_dim, dtype, config=config)
    cases = [_slices(w, batch, q_heads, kv_heads, head_dim, dtype, call_lengths, page, seed=1000 * call + head_dim + group)
             for call, call_lengths in enumerate(lengths)]
    outs = []
    for q, slices, _ in cases:  # back to back, no synchronisation
        k, v, seqlens, table = (_on(w.device, t) for t in slices[w.rank])
        if op is None:
            outs.append(ops.flash_decode(q.to(w.device), k, v, seqlens, table, sm_scale))
        else:
            out = torch.full(q.shape, float("nan"), dtype=dtype, device=w.device)
            assert op(q.to(w.device), k, v, seqlens, table, sm_scale, out=out) is out
            outs.append(out)
    for call, (q, _, gathered) in enumerate(cases):
        expected = _reference(q, gathered, sm_scale)
        error = relative_error(outs[call], expected)
        assert error <= TOLERANCE[dtype], f"call {call}: relative error {error:.1e} > {TOLERANCE[dtype]:.0e}"
    if op is not None:
        tridist.barrier_all()
        op.free()
    return [out.cpu() for out in outs]


def _ragged(r, call, world):
    """Three sequences: the first on every rank, ragged (empty on some); the second on one rank only;
    the third on none (its output is zeros)."""
    return [(7 * r + 11 * call + 5) % 23 if (r + call) % 3 else 0, 19 if r == (1 + call) % world else 0, 0]


def _config(splits):
    return dict(BLOCK_N=16, num_warps=4, num_stages=1, splits=splits)


CASES = {  # kv_heads, GQA ratio, head_dim, dtype, paged block size, config, calls, sm_scale
    # several chunks per sequence, two calls back to back
    "contiguous gqa4 d64 bf16": (2, 4, 64, torch.bfloat16, None, _config(3), 2, None),
    # the default config (tridist.ops.flash_decode)
    "paged16 gqa1 d128 fp16": (2, 1, 128, torch.float16, 16, None, 1, None),
    # a paged cache of small blocks; sharper scores
    "paged4 gqa8 d128 bf16": (1, 8, 128, torch.bfloat16, 4, _config(5), 1, 0.5),
    # a group that is no power of two (27 query heads padded to 32 rows), through the function, two
    # calls: the shape of the one wrong stress result on GPUs (benchmarks/NOTES.md, "Stress across GPUs")
    "paged4 gqa27 d64 bf16": (2, 27, 64, torch.bfloat16, 4, None, 2, 0.462),
}
# More chunks than the combine loads at once (16 records of 32 heads x 8 columns), most of them empty:
# the merge's rounds, the same code at every world.
MANY_CHUNKS = (1, 32, 64, torch.bfloat16, None, _config(20), 1, None)


@pytest.mark.worlds(*WORLDS)
@pytest.mark.parametrize("case", list(CASES))
def test_flash_decode(world, case):
    """Ragged lengths, empty slices, a sequence on one rank only and one on none; every rank returns
    the same bits."""
    _check_decode(world, *CASES[case])


@pytest.mark.worlds("1", "2")
def test_flash_decode_many_chunks(world):
    _check_decode(world, *MANY_CHUNKS)


def _check_decode(world, kv_heads, group, head_dim, dtype, page, config, calls, sm_scale):
    lengths = [[_ragged(r, call, world.size) for r in range(world.size)] for call in range(calls)]
    results = world.run(_decode, kv_heads=kv_heads, group=group, head_dim=head_dim, dtype=dtype, page=page,
                        lengths=lengths, config=config, sm_scale=sm_scale)
    for rank, outs in enumerate(results):
        for call, out in enumerate(outs):
            assert torch.equal(out.view(torch.int16), results[0][call].view(torch.int16)), \
                f"call {call}: rank {rank}'s output differs from rank 0's"


def _decode_in_groups(w, layout):
    """flash_decode within each group of `layout` at once: the groups differ in shapes, layout,
    data and number of calls, with no step of the world in between (a group waiting on another's
    ranks would hang). Returns (this rank's group, its outputs), which must be the same bits on
    every member."""
    index, members, made = join_groups(layout)
    kv_heads, page, calls, size = 1 + index, (None, 4)[index % 2], 1 + index, len(members)
    cases = [_slices(w, 3, 2 * kv_heads, kv_heads, 64, torch.bfloat16, [_ragged(r, call, size) for r in range(size)],
                     page, seed=100 * index + call) for call in range(calls)]
    outs = []
    for q, slices, _ in cases:  # back to back, no synchronisation
        k, v, seqlens, table = (_on(w.device, t) for t in slices[members.index(w.rank)])
        outs.append(ops.flash_decode(q.to(w.device), k, v, seqlens, table, group=made[index]))
    for call, (q, _, gathered) in enumerate(cases):
        error = relative_error(outs[call], _reference(q, gathered, None))
        assert error <= TOLERANCE[torch.bfloat16], f"group {members}, call {call}: relative error {error:.1e}"
    other = made[(index + 1) % len(made)]  # a group this rank is not in: refused before anything is allocated
    with pytest.raises(ValueError, match=f"rank {w.rank} is not a member"):
        ops.flash_decode(q.to(w.device), k, v, seqlens, table, group=other)
    with pytest.raises(ValueError, match=f"rank {w.rank} is not a member"):
        ops.FlashDecode(3, 2, 1, 64, torch.bfloat16, group=other)
    tridist.barrier_all()
    return index, [out.cpu() for out in outs]


def _alone_over_transformers_cache(w, dtype):
    """`decode_attention` on this rank's own data (a different seed per rank: no rank waits for or
    mixes in another's), over a cache in transformers' layout [B, Hkv, L, D] read in place through
    `transpose(1, 2)`, with a boolean mask of left padding and a hole; positions past seqlens and
    masked ones hold NaN, so reading one would show."""
    batch, kv_heads, group, head_dim, capacity = 3, 2, 3, 64, 40
    g = torch.Generator().manual_seed(50 + w.rank)
    q = torch.randn(batch, kv_heads * group, head_dim, generator=g).to(dtype)
    k, v = (torch.randn(batch, kv_heads, capacity, head_dim, generator=g).to(dtype) for _ in range(2))
    seqlens = torch.tensor([capacity, 23, 1], dtype=torch.int32)
    mask = torch.ones(batch, capacity, dtype=torch.bool)
    mask[0, :9] = False  # left padding
    mask[1, 5:21] = False  # a hole longer than the emulator's tiles
    for b, n in enumerate(seqlens.tolist()):
        hidden = ~mask[b] | (torch.arange(capacity) >= n)
        k[b, :, hidden], v[b, :, hidden] = float("nan"), float("nan")
    keep = [mask[b, :n].nonzero()[:, 0] for b, n in enumerate(seqlens.tolist())]
    expected = _reference(q, [(k[b].transpose(0, 1)[rows], v[b].transpose(0, 1)[rows]) for b, rows in enumerate(keep)],
                          None)
    on = [t.to(w.device) for t in (q, k, v, seqlens, mask)]
    for _ in range(2):  # back to back: the same bits
        out = ops.decode_attention(on[0], on[1].transpose(1, 2), on[2].transpose(1, 2), on[3], mask=on[4])
        error = relative_error(out, expected)
        assert error <= TOLERANCE[dtype], f"relative error {error:.1e} > {TOLERANCE[dtype]:.0e}"
    with pytest.raises(ValueError, match="mask must be bool"):
        ops.decode_attention(on[0], on[1].transpose(1, 2), on[2].transpose(1, 2), on[3], mask=on[4][:, :7])
    with pytest.raises(ValueError, match="one shape and one layout"):
        ops.decode_attention(on[0], on[1].transpose(1, 2), on[2].transpose(1, 2).contiguous(), on[3])


@pytest.mark.worlds("1", "2")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_attention_alone_over_transformers_cache(world, dtype):
    world.run(_alone_over_transformers_cache, dtype=dtype)


def _real_heads(w):
    """`decode_attention` at the heads of the models the bench runs (Qwen3-30B-A3B: 32 query heads on 4
    KV heads; Qwen3-8B: on 8), head_dim 128, over a static cache of 4096 positions in transformers'
    layout, at batches 1, 8 and 64, with and without a mask."""
    for batch, heads, kv_heads in ((1, 32, 4), (8, 32, 4), (1, 32, 8), (64, 32, 8)):
        g = torch.Generator().manual_seed(batch + kv_heads)
        q = torch.randn(batch, heads, 128, generator=g).to(torch.bfloat16).to(w.device)
        k, v = (torch.randn(batch, kv_heads, 4096, 128, generator=g).to(torch.bfloat16).to(w.device) for _ in range(2))
        seqlens = torch.full((batch,), 4096, dtype=torch.int32, device=w.device)
        expected = F.scaled_dot_product_attention(q.float()[:, :, None], k.float(), v.float(), scale=128 ** -0.5,
                                                  enable_gqa=True)[:, :, 0]
        for mask in (None, torch.ones(batch, 4096, dtype=torch.bool, device=w.device)):
            out = ops.decode_attention(q, k.transpose(1, 2), v.transpose(1, 2), seqlens, sm_scale=128 ** -0.5,
                                       mask=mask)
            error = relative_error(out, expected)
            assert error <= TOLERANCE[torch.bfloat16], \
                f"batch {batch}, {heads} on {kv_heads} heads, mask {mask is not None}: relative error {error:.1e}"


@pytest.mark.worlds("1")
def test_decode_attention_at_the_real_model_heads(world):
    if world.backend == "emulator":
        pytest.skip("4096 positions take minutes in the emulator: GPUs only")
    world.run(_real_heads)


@pytest.mark.parametrize("layout", group_layouts())
def test_flash_decode_in_groups(world, layout):
    results = world.run(_decode_in_groups, layout=layout)
    for rank, (index, outs) in enumerate(results):
        first = next(r for r, (i, _) in enumerate(results) if i == index)
        assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(outs, results[first][1])), \
            f"rank {rank}'s outputs differ from rank {first}'s, in the same group"


def _graph_replays(w, shape, page, replays):
    """One call captured in a CUDA graph, replayed with new queries, caches and lengths each time.
    Returns a digest of each replay's output (every rank must return the same bits)."""
    batch, kv_heads, group, head_dim, capacity = shape
    dtype = torch.bfloat16
    op = ops.FlashDecode(batch, kv_heads * group, kv_heads, head_dim, dtype)

    def case(replay):
        g = torch.Generator().manual_seed(replay)
        lengths = [torch.randint(0, capacity + 1, (batch,), generator=g).tolist() for _ in range(w.world_size)]
        return _slices(w, batch, kv_heads * group, kv_heads, head_dim, dtype, lengths, page, seed=replay,
                       capacity=capacity)

    q, slices, _ = case(0)
    static = [t.to(w.device) for t in (q, *slices[w.rank]) if t is not None]
    table = static[4] if page else None
    out = torch.empty(q.shape, dtype=dtype, device=w.device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # the instance's first call, and the graph, on the same stream
        op(*static[:4], table, out=out)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            op(*static[:4], table, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    digests = []
    for replay in range(replays):
        q, slices, gathered = case(replay)
        for target, source in zip(static, (t for t in (q, *slices[w.rank]) if t is not None)):
            target.copy_(source)
        graph.replay()
        # The reference on the GPU: on the CPU, the 200 replays of the largest case took minutes.
        on_gpu = [(k.to(w.device), v.to(w.device)) for k, v in gathered]
        error = relative_error(out, _reference(q.to(w.device), on_gpu, None))
        assert error <= TOLERANCE[dtype], f"replay {replay}: relative error {error:.1e}"
        digests.append(hashlib.sha1(out.cpu().view(torch.int16).numpy().tobytes()).hexdigest())
    tridist.barrier_all()
    op.free()
    return digests


GRAPH_CASES = {  # (batch, kv_heads, GQA ratio, head_dim, positions a rank holds), paged block size, replays
    "contiguous": ((4, 2, 4, 128, 512), None, 20),
    "paged16": ((4, 2, 4, 128, 512), 16, 20),
    # The shape that found packets read stale by threads holding a second copy of them (one replay in
    # about a hundred wrong on one rank: benchmarks/NOTES.md, "LL packets held by several threads"):
    # many replays, and the ranks' outputs compared bit for bit, where one rank's wrong item shows.
    "paged4 gqa27": ((3, 5, 27, 128, 1024), 4, 200),
}


@pytest.mark.worlds(*WORLDS)
@pytest.mark.parametrize("case", list(GRAPH_CASES))
def test_cuda_graph_replays(world, case):
    if world.backend == "emulator":
        pytest.skip("CUDA graphs need GPUs")
    shape, page, replays = GRAPH_CASES[case]
    results = world.run(_graph_replays, shape=shape, page=page, replays=replays)
    for rank, digests in enumerate(results):
        differ = [replay for replay, (a, b) in enumerate(zip(digests, results[0])) if a != b]
        assert not differ, f"rank {rank}'s output differs from rank 0's in replays {differ}"


def _bad_input(w):
    """Refused before any launch, with what to change."""
    batch, q_heads, kv_heads, head_dim, length = 2, 4, 2, 64, 8
    device, bf16 = w.device, torch.bfloat16
    q = torch.zeros(batch, q_heads, head_dim, dtype=bf16, device=device)
    k = torch.zeros(batch, length, kv_heads, head_dim, dtype=bf16, device=device)
    seqlens = torch.tensor([length, 3], dtype=torch.int32, device=device)
    pool = torch.zeros(6, 4, kv_heads, head_dim, dtype=bf16, device=device)
    table = torch.tensor([[0, 1], [2, 9]], dtype=torch.int32, device=device)  # [1, 1] unused: 3 positions, 1 block
    calls = [
        ((q.float(), k, k, seqlens), "takes torch.bfloat16 or torch.float16|dtype"),
        ((q[..., :48].contiguous(), k[..., :48].contiguous(), k[..., :48].contiguous(), seqlens), "head dims"),
        ((q[0], k, k, seqlens), r"q must be \[B, Hq, D\]"),
        ((torch.zeros(batch, 66, head_dim, dtype=bf16, device=device), k, k, seqlens), "at most 32 query heads"),
        ((torch.zeros(batch, 3, head_dim, dtype=bf16, device=device), k, k, seqlens), "multiple of kv_heads"),
        ((q, k, k.half(), seqlens), "one dtype"),
        ((q, k, k[:, :4].contiguous(), seqlens), "must have one shape and one layout"),
        ((q, *[torch.zeros(batch, length, kv_heads, 2 * head_dim, dtype=bf16, device=device)[..., ::2]] * 2, seqlens),
         "last dimension must be contiguous"),
        ((q, k[:1].contiguous(), k[:1].contiguous(), seqlens), "one row per sequence"),
        ((q, k, k, seqlens.long()), "seqlens must be int32"),
        ((q, pool, pool, seqlens, table.long()), "block_table must be int32"),
        ((q, k, k, seqlens, None, torch.tensor(0.1)), "sm_scale must be a finite Python number"),
    ]
    if not seqlens.is_cuda or settings.debug():  # values checked without a synchronisation
        calls += [((q, k, k, seqlens + 1), r"seqlens\[0\] = 9: this rank's cache holds 0 to 8"),
                  ((q, k, k, seqlens - 4), r"seqlens\[1\] = -1"),
                  ((q, pool, pool, torch.tensor([8, 5], dtype=torch.int32, device=device), table),
                   r"block_table\[1, 1\] = 9 is outside the cache's 6 blocks")]
    for args, match in calls:
        with pytest.raises(ValueError, match=match):
            ops.flash_decode(*args)
    assert ops.flash_decode(q, pool, pool, seqlens, table).shape == q.shape  # the unused entry is not read
    with pytest.raises(ValueError, match="built for q of shape"):
        ops.FlashDecode(batch, q_heads, kv_heads, head_dim, bf16)(q[:1].contiguous(), k, k, seqlens)
    for config in ({"BLOCK_N": 64}, {"BLOCK_N": 48, "num_warps": 4, "num_stages": 2, "splits": 2},
                   {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "splits": 2, "programs_per_sm": 2}):
        with pytest.raises(ValueError, match="config"):
            ops.FlashDecode(batch, q_heads, kv_heads, head_dim, bf16, config=config)


@pytest.mark.worlds("1")
def test_bad_input_fails_before_launch(world):
    world.run(_bad_input)


def _bench_checks(w):
    """`tridist bench flash_decode`'s correctness path: each rank holds its part of every sequence."""
    # The default config and one other: on GPUs the bench sweeps 12, 72 kernel specialisations here,
    # which took longer to compile than the test's time allowed (2026-11-26).
    configs = attention.configs(w.device)[:2]
    rows = bench.run([(2, 45)], q_heads=4, kv_heads=2, head_dim=64, dtype=torch.bfloat16, configs=configs,
                     timed=False, pages=(16, 4))
    assert [row["layout"] for row in rows] == ["contiguous", "paged 16", "paged 4"] * len(configs)


@pytest.mark.worlds("1", "2")
def test_bench_checks(world):
    world.run(_bench_checks)


def test_bench_arguments():
    assert bench.parse_shapes("1x131072, 8X32768") == [(1, 131072), (8, 32768)]
    assert bench.parse_config("BLOCK_N=64,num_warps=4,num_stages=3,splits=8") == dict(BLOCK_N=64, num_warps=4,
                                                                                    num_stages=3, splits=8)
    for bad, parse in (("8x", bench.parse_shapes), ("1x2x3", bench.parse_shapes), ("BLOCK_N=64", bench.parse_config),
                       ("BLOCK_N=sixty", bench.parse_config)):
        with pytest.raises(argparse.ArgumentTypeError, match="shape|config"):
            parse(bad)


def test_split_counts_fill_one_wave():
    """On an H100 (132 SMs) the default config's kernel fits 3 programs an SM: 396 at once. Where
    every program fits at once, the chunks fill that one wave (1x131072: 49, not 66); where not
    (512 units), about 4 an SM; never chunks shorter than 4 steps; fixed splits stay fixed."""
    config = attention.configs(torch.device("cuda"))[0]
    choose = attention.policy.choose_splits
    units_and_splits = {(1, 8192): 32, (1, 32768): 49, (1, 131072): 49, (8, 32768): 6, (16, 16384): 3, (64, 8192): 2}
    for (batch, length), splits in units_and_splits.items():
        assert choose(config, batch * 8, length, 132, resident=396) == splits, (batch, length)
    assert choose(config, 8, 131072, 132) == 66  # occupancy not known: about 4 an SM
    assert choose({**config, "splits": 7}, 8, 131072, 132, resident=396) == 7


def _tutorial(w):
    tutorial = load_script("tutorials", "09-flash-decoding")
    q, slices = tutorial.whole_problem(w.world_size)
    assert tutorial.check_merge_rule() and tutorial.contiguous(w, q, slices) and tutorial.paged(w, q, slices)


@pytest.mark.worlds("2")
def test_tutorial(world):
    """tutorials/09-flash-decoding.py's checks (its main starts and ends tridist itself)."""
    world.run(_tutorial)


def _custom_op(w):
    """`torch.ops.tridist.decode_attention` under torch.compile, over transformers' cache layout read
    in place and a mask: the function's bits."""
    g = torch.Generator().manual_seed(61)
    q = torch.randn(2, 4, 64, generator=g).to(torch.bfloat16).to(w.device)
    k, v = (torch.randn(2, 2, 24, 64, generator=g).to(torch.bfloat16).to(w.device).transpose(1, 2) for _ in range(2))
    seqlens = torch.tensor([24, 9], dtype=torch.int32, device=w.device)
    mask = torch.ones(2, 24, dtype=torch.bool, device=w.device)
    mask[0, :5] = False
    compiled = torch.compile(lambda q: torch.ops.tridist.decode_attention(q, k, v, seqlens, None, None, mask),
                             backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(q), ops.decode_attention(q, k, v, seqlens, mask=mask))


@pytest.mark.worlds("1")
def test_decode_attention_custom_op_under_torch_compile(world):
    world.run(_custom_op)
