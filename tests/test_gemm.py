"""The overlapped GEMMs (ag_gemm, gemm_rs, gemm_ar) and the GEMM they share: random data,
poisoned outputs, back-to-back calls with no host synchronisation, bad input refused before launch;
the overlapped GEMMs within process groups (`group=`), several at once."""
import json
import os

import pytest
import torch
import torch.distributed as dist

import tridist
from tridist import ops
from tridist.bench.results import relative_error
from tridist.ops import sizing
from tridist.ops.gemm import persistent as gemm

from .test_language import load_example

DTYPES = [torch.bfloat16, torch.float16]
# The GEMM accumulates in fp32; what differs from an fp32 reference is the rounding of the output
# (and, in gemm_rs/gemm_ar, of the partial products sent to peers), relative to the largest value.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _random(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def _poisoned(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _assert_close(actual, expected, dtype, what):
    error = relative_error(actual, expected)
    assert error <= TOLERANCE[dtype], f"{what}: relative error {error:.2e} > {TOLERANCE[dtype]:.0e}"


def _matmul(w):
    for dtype in DTYPES:
        for m, k, n in [(50, 40, 72), (16, 16, 16), (3, 8, 8)]:
            a, b = _random((m, k), dtype, m), _random((k, n), dtype, n)
            out = gemm.matmul(a.to(w.device), b.to(w.device), out=_poisoned((m, n), dtype, w.device))
            _assert_close(out, a.float() @ b.float(), dtype, f"matmul {m}x{k}x{n} {dtype}")


def test_matmul(world):
    world.run(_matmul)


def _ag_gemm(w, comm, dtype, m_shard, k, n, calls, flags_per_shard=1):
    """`flags_per_shard` > 1: the shard travels in pieces with a flag each (small copy-engine chunks,
    or for "sm" 16 pushing programs), and the GEMM waits for several flags per shard."""
    if comm == "ce" and w.nnodes > 1:
        with pytest.raises(ValueError, match="within one node"):
            ops.AllGatherGEMM(m_shard, k, n, dtype, comm)
        return
    with sizing.piece_sizes(chunk_bytes=256 if flags_per_shard > 1 else None):
        op = ops.AllGatherGEMM(m_shard, k, n, dtype, comm, comm_programs=16 if flags_per_shard > 1 else None)
    pieces = op.gather.flags_per_shard
    assert (pieces > 1) == (flags_per_shard > 1), f"{pieces} flags per shard"
    shards = [[_random((m_shard, k), dtype, 100 * call + r) for r in range(w.world_size)] for call in range(calls)]
    bs = [_random((k, n), dtype, 1000 * call + 7 * w.rank) for call in range(calls)]
    outs = [_poisoned((w.world_size * m_shard, n), dtype, w.device) for _ in range(calls)]
    inputs = [(s[w.rank].to(w.device), b.to(w.device)) for s, b in zip(shards, bs)]
    for call in range(calls):  # back to back
        op(*inputs[call], out=outs[call])
    for call in range(calls):
        _assert_close(outs[call], torch.cat(shards[call]).float() @ bs[call].float(), dtype, f"call {call}")
    tridist.barrier_all()
    op.free()


@pytest.mark.parametrize("comm", ["ce", "sm"])
def test_ag_gemm(world, comm):
    for dtype, (m_shard, k, n) in [(torch.bfloat16, (24, 40, 48)), (torch.float16, (5, 16, 24))]:
        world.run(_ag_gemm, comm=comm, dtype=dtype, m_shard=m_shard, k=k, n=n, calls=3)


@pytest.mark.parametrize("comm", ["ce", "sm"])
def test_ag_gemm_several_flags_per_shard(world, comm):
    if world.backend == "emulator" and world.name not in ("2", "3", "2x2"):
        pytest.skip("in the emulator at 2, 3 and 2x2 ranks only: even, odd and across nodes (CI's time)")
    world.run(_ag_gemm, comm=comm, dtype=torch.bfloat16, m_shard=72, k=128, n=32, calls=3, flags_per_shard=2)


def _gemm_reduce(w, scatter, dtype, rows, k, n, calls, method=None):
    m = rows * w.world_size if scatter else rows
    if method == "ll" and w.nnodes > 1:
        with pytest.raises(ValueError, match="within one node"):
            ops.GemmAllReduce(m, k, n, dtype, method)
        return
    op = ops.GemmReduceScatter(m, k, n, dtype) if scatter else ops.GemmAllReduce(m, k, n, dtype, method)
    every_a = [[_random((m, k), dtype, 100 * call + r) for r in range(w.world_size)] for call in range(calls)]
    every_b = [[_random((k, n), dtype, 1000 * call + 7 * r) for r in range(w.world_size)] for call in range(calls)]
    outs = [_poisoned((rows, n), dtype, w.device) for _ in range(calls)]
    inputs = [(a[w.rank].to(w.device), b[w.rank].to(w.device)) for a, b in zip(every_a, every_b)]
    for call in range(calls):  # back to back
        op(*inputs[call], out=outs[call])
    for call in range(calls):
        total = sum(a.double() @ b.double() for a, b in zip(every_a[call], every_b[call])).float()
        expected = total[w.rank * rows:(w.rank + 1) * rows] if scatter else total
        _assert_close(outs[call], expected, dtype, f"call {call}")
    if not scatter:  # every rank must end with the same bits
        gathered = ops.all_gather(outs[-1]).view(w.world_size, -1).view(torch.int16).cpu()
        assert all(torch.equal(part, gathered[0]) for part in gathered)
    tridist.barrier_all()
    op.free()


@pytest.mark.parametrize("scatter, method", [(True, None), (False, "one_shot"), (False, "ll")],
                         ids=["gemm_rs", "gemm_ar", "gemm_ar-ll"])
def test_gemm_reduce(world, scatter, method):
    for dtype, (rows, k, n) in [(torch.bfloat16, (20, 24, 40)), (torch.float16, (3, 16, 8))]:
        world.run(_gemm_reduce, scatter=scatter, dtype=dtype, rows=rows, k=k, n=n, calls=3, method=method)


def _fp8_operands(rows, k, n, seed, device):
    """fp8 a (rows x k) and column-major fp8 b (k x n), as exact fp32 copies too for the reference."""
    a = _random((rows, k), torch.float32, seed).to(gemm.FP8)
    w = _random((n, k), torch.float32, seed + 1).to(gemm.FP8)
    return a.to(device), w.to(device).t(), a.float(), w.float().t()


def _scale(value, device):
    return torch.tensor([value], dtype=torch.float32, device=device)


def _fp8(w, op_name, calls):
    """bf16 out = scale_a * scale_b * (a @ b) for fp8 operands, back to back, scales differing by
    call and (but for ag_gemm's scale_a, one for all of A) by rank."""
    rows, k, n = 12, 32, 24
    one_node = w.nnodes == 1
    if op_name == "matmul":
        op = gemm.matmul
    elif op_name.startswith("ag_gemm"):
        comm = op_name.split("-")[1]
        if comm == "ce" and not one_node:
            with pytest.raises(ValueError, match="within one node"):
                ops.AllGatherGEMM(rows, k, n, gemm.FP8, comm)
            return
        op = ops.AllGatherGEMM(rows, k, n, gemm.FP8, comm)
    elif op_name == "gemm_rs":
        op = ops.GemmReduceScatter(rows * w.world_size, k, n, gemm.FP8)
    else:
        method = "ll" if op_name == "gemm_ar-ll" else "one_shot"
        if method == "ll" and not one_node:
            with pytest.raises(ValueError, match="within one node"):
                ops.GemmAllReduce(rows, k, n, gemm.FP8, method)
            return
        op = ops.GemmAllReduce(rows, k, n, gemm.FP8, method)
    rows_a = rows * w.world_size if op_name == "gemm_rs" else rows
    outs, expected = [], []
    for call in range(calls):
        every = [_fp8_operands(rows_a, k, n, 100 * call + 10 * r, w.device) for r in range(w.world_size)]
        scale_a = [0.5 + call + (0 if op_name.startswith("ag_gemm") else r) for r in range(w.world_size)]
        scale_b = [0.25 * (r + 1) for r in range(w.world_size)]
        a, b = every[w.rank][:2]
        out_rows = rows * w.world_size if op_name.startswith("ag_gemm") else rows
        outs.append(_poisoned((out_rows, n), torch.bfloat16, w.device))
        op(a, b, out=outs[-1], scale_a=_scale(scale_a[w.rank], w.device), scale_b=_scale(scale_b[w.rank], w.device))
        if op_name == "matmul":
            total = scale_a[w.rank] * scale_b[w.rank] * (every[w.rank][2] @ every[w.rank][3])
        elif op_name.startswith("ag_gemm"):
            total = scale_a[w.rank] * scale_b[w.rank] * (torch.cat([e[2] for e in every]) @ every[w.rank][3])
        else:
            total = sum(sa * sb * (e[2].double() @ e[3].double()) for sa, sb, e in zip(scale_a, scale_b, every)).float()
            if op_name == "gemm_rs":
                total = total[w.rank * rows:(w.rank + 1) * rows]
        expected.append(total)
    for call in range(calls):
        _assert_close(outs[call], expected[call], torch.bfloat16, f"{op_name} fp8 call {call}")
    if op_name != "matmul":
        tridist.barrier_all()
        op.free()


@pytest.mark.parametrize("op_name", ["matmul", "ag_gemm-ce", "ag_gemm-sm", "gemm_rs", "gemm_ar", "gemm_ar-ll"])
def test_fp8(world, op_name):
    world.run(_fp8, op_name=op_name, calls=3)


def _fp8_bad_input(w):
    a = torch.zeros((4, 32), dtype=gemm.FP8, device=w.device)
    weight = torch.zeros((16, 32), dtype=gemm.FP8, device=w.device)
    one = _scale(1.0, w.device)
    with pytest.raises(ValueError, match="column-major"):
        gemm.matmul(a, weight.t().contiguous(), scale_a=one, scale_b=one)
    with pytest.raises(ValueError, match="need scale_b"):
        gemm.matmul(a, weight.t(), scale_a=one)
    with pytest.raises(ValueError, match="need scale_a"):
        rows = 24 * w.world_size  # a multiple of the world size, so that the scale is what is wrong
        ops.gemm_rs(torch.zeros((rows, 32), dtype=gemm.FP8, device=w.device), weight.t(),
                    scale_a=torch.ones(2, device=w.device), scale_b=one)
    with pytest.raises(ValueError, match="multiple of 16"):
        ops.ag_gemm(torch.zeros((4, 24), dtype=gemm.FP8, device=w.device),
                    torch.zeros((16, 24), dtype=gemm.FP8, device=w.device).t(), scale_a=one, scale_b=one)
    with pytest.raises(ValueError, match="fp8 operands only"):
        b16 = torch.zeros((8, 8), dtype=torch.bfloat16, device=w.device)
        ops.gemm_ar(b16, b16, scale_a=one, scale_b=one)


def test_fp8_bad_input(world):
    world.run(_fp8_bad_input)


def _graph_replays(w, replays):
    """Each op captured once in a CUDA graph and replayed back to back with inputs scaled by 1..4;
    every 25th replay is checked against torch on every rank's inputs for that scale, and for the
    same bits as the op's eager result."""
    dtype, m, k, n = torch.bfloat16, 256, 128, 256
    cases = [ops.AllGatherGEMM(m // w.world_size, k, n, dtype, comm) for comm in ("ce", "sm")
             if w.nnodes == 1 or comm == "sm"]
    cases += [ops.GemmReduceScatter(m, k, n, dtype)]
    cases += [ops.GemmAllReduce(64, k, n, dtype, method) for method in ("one_shot", "ll")
              if w.nnodes == 1 or method != "ll"]
    for op in cases:
        what = (type(op).__name__, getattr(op, "comm", getattr(op, "method", "")))
        rows = op.m_shard if isinstance(op, ops.AllGatherGEMM) else op.m
        bases = [_random((rows, k), dtype, r) for r in range(w.world_size)]
        bs = [_random((k, n), dtype, 5 + r) for r in range(w.world_size)]
        references = []
        for scale in range(1, 5):
            every_a = [(base * scale).float() for base in bases]
            if isinstance(op, ops.AllGatherGEMM):
                references.append(torch.cat(every_a) @ bs[w.rank].float())
            else:
                total = sum(a @ b.float() for a, b in zip(every_a, bs))
                references.append(total[w.rank * op.m // w.world_size:][:op.m // w.world_size]
                                  if isinstance(op, ops.GemmReduceScatter) else total)
        base = bases[w.rank].to(w.device)
        a, b = base.clone(), bs[w.rank].to(w.device)
        eager = []
        for scale in range(1, 5):
            a.copy_(base * scale)
            eager.append(op(a, b).clone())
            _assert_close(eager[-1], references[scale - 1], dtype, f"{what}, eager, scale {scale}")
        out = op(a, b)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            op(a, b, out=out)
        for i in range(replays):
            a.copy_(base * (i % 4 + 1))
            graph.replay()
            if i % 25 == 24:
                _assert_close(out, references[i % 4], dtype, f"{what}, replay {i}")
                assert torch.equal(out, eager[i % 4]), (*what, i, "bits differ from the eager call's")
        tridist.barrier_all()
        op.free()


def test_cuda_graph_replays(world):
    if world.backend == "emulator":
        pytest.skip("CUDA graphs need GPUs")
    world.run(_graph_replays, replays=200)


def _tuned(w, folder):
    # On a GPU each config compiles for seconds (NVSHMEM linked): three of them (one with FLATTEN,
    # two without) show the ranks agreeing as well as all six, in a fraction of the time.
    all_configs = gemm.GPU_CONFIGS
    gemm.GPU_CONFIGS = [all_configs[0]] + [c for c in all_configs if not c["FLATTEN"]][-2:]
    try:
        _tune_and_check(w, folder)
    finally:
        gemm.GPU_CONFIGS = all_configs


def _tune_and_check(w, folder):
    os.environ["TRIDIST_TUNE_CACHE"] = folder
    m, k, n, dtype = 8 * w.world_size, 16, 24, torch.bfloat16
    a, b = _random((m, k), dtype, w.rank), _random((k, n), dtype, 10 + w.rank)
    for build in (lambda: ops.GemmReduceScatter(m, k, n, dtype, config="tune"),
                  lambda: ops.AllGatherGEMM(m, k, n, dtype, config="tune")):
        op = build()
        assert op.config in gemm.configs(w.device)
        tridist.barrier_all()
        op.free()
    # a config with FLATTEN gives the same products; gemm_ar and gemm_rs across nodes refuse it
    flattened = next(c for c in gemm.configs(w.device) if c["FLATTEN"])
    with pytest.raises(ValueError, match="FLATTEN=False"):
        ops.GemmAllReduce(m, k, n, dtype, config=flattened)
    op = ops.AllGatherGEMM(m, k, n, dtype, config=flattened)
    out = op(a.to(w.device), b.to(w.device))
    gathered = torch.cat([_random((m, k), dtype, r) for r in range(w.world_size)])
    _assert_close(out, gathered.float() @ b.float(), dtype, "FLATTEN")
    tridist.barrier_all()
    op.free()
    if w.nnodes > 1:
        with pytest.raises(ValueError, match="across nodes takes configs with FLATTEN=False"):
            ops.GemmReduceScatter(m, k, n, dtype, config=flattened)
        return
    op = ops.GemmReduceScatter(m, k, n, dtype, config=flattened)
    out = op(a.to(w.device), b.to(w.device))
    total = sum(_random((m, k), dtype, r).float() @ _random((k, n), dtype, 10 + r).float()
                for r in range(w.world_size))
    rows = m // w.world_size
    _assert_close(out, total[w.rank * rows:(w.rank + 1) * rows], dtype, "gemm_rs FLATTEN")
    tridist.barrier_all()
    op.free()


@pytest.mark.at_most_4_ranks
def test_tuned_config(world, tmp_path):
    if world.backend == "emulator" and world.name in ("3", "4"):
        pytest.skip("in the emulator, the ranks' agreement on a config is checked at 2 and 2x2 (3 and 4 took CI 21 s)")
    world.run(_tuned, folder=str(tmp_path))


def _custom_ops(w):
    """A tensor-parallel MLP (column-parallel up, row-parallel down) under torch.compile."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    dtype, rows, hidden, inner = torch.bfloat16, 8, 16, 8 * w.world_size
    x = _random((rows, hidden), dtype, w.rank).to(w.device)
    up = _random((hidden, inner // w.world_size), dtype, 10 + w.rank).to(w.device)
    down = _random((inner // w.world_size, hidden), dtype, 20 + w.rank).to(w.device)

    def layer(t):
        h = torch.ops.tridist.ag_gemm(t, up, "auto")
        return torch.ops.tridist.gemm_rs(h, down), torch.ops.tridist.gemm_ar(h, down)

    scattered, reduced = torch.compile(layer, backend="eager", fullgraph=True)(x)
    gathered = torch.cat([_random((rows, hidden), dtype, r) for r in range(w.world_size)]).float()
    partials = [(gathered @ _random((hidden, inner // w.world_size), dtype, 10 + r).float()).to(dtype).float()
                @ _random((inner // w.world_size, hidden), dtype, 20 + r).float() for r in range(w.world_size)]
    total = sum(partials)
    _assert_close(reduced, total, dtype, "gemm_ar")
    _assert_close(scattered, total[w.rank * rows:(w.rank + 1) * rows], dtype, "gemm_rs")
    with FakeTensorMode() as mode:
        fake_x, fake_up, fake_down = (mode.from_tensor(t) for t in (x, up, down))
        h = torch.ops.tridist.ag_gemm(fake_x, fake_up)
        assert h.shape == (w.world_size * rows, inner // w.world_size)
        assert torch.ops.tridist.gemm_rs(h, fake_down).shape == (rows, hidden)
        assert torch.ops.tridist.gemm_ar(h, fake_down).shape == (w.world_size * rows, hidden)
        # fp8 operands (b column-major) with their scales give bf16
        one = mode.from_tensor(torch.ones(1, device=w.device))
        a8 = mode.from_tensor(torch.zeros((rows, 32), dtype=gemm.FP8, device=w.device))
        b8 = mode.from_tensor(torch.zeros((hidden, 32), dtype=gemm.FP8, device=w.device)).t()
        for out in (torch.ops.tridist.ag_gemm(a8, b8, "auto", one, one), torch.ops.tridist.gemm_rs(a8, b8, one, one),
                    torch.ops.tridist.gemm_ar(a8, b8, "auto", one, one)):
            assert out.dtype == torch.bfloat16


@pytest.mark.at_most_4_ranks
def test_custom_ops_under_torch_compile(world):
    world.run(_custom_ops)


def _example(w):
    load_example("tensor_parallel_mlp").mlp_block(w)


@pytest.mark.at_most_4_ranks
def test_tensor_parallel_mlp_example(world):
    world.run(_example)


def _bad_input(w):
    a = torch.zeros((4, 12), dtype=torch.bfloat16, device=w.device)
    with pytest.raises(ValueError, match="multiple of 8"):
        ops.ag_gemm(a, torch.zeros((12, 8), dtype=torch.bfloat16, device=w.device))
    a = torch.zeros((4, 8), dtype=torch.bfloat16, device=w.device)
    with pytest.raises(ValueError, match="one dtype"):
        ops.ag_gemm(a, torch.zeros((8, 8), dtype=torch.float16, device=w.device))
    with pytest.raises(ValueError, match="columns"):
        ops.ag_gemm(a, torch.zeros((16, 8), dtype=torch.bfloat16, device=w.device))
    with pytest.raises(ValueError, match="dtype"):
        ops.ag_gemm(a.float(), torch.zeros((8, 8), device=w.device))
    with pytest.raises(ValueError, match="contiguous"):
        ops.ag_gemm(torch.zeros((8, 4), dtype=torch.bfloat16, device=w.device).t(), a[:4])
    with pytest.raises(ValueError, match="unknown method"):
        ops.gemm_ar(a, torch.zeros((8, 8), dtype=torch.bfloat16, device=w.device), method="two_shot")
    b = torch.zeros((8, 8), dtype=torch.bfloat16, device=w.device)
    with pytest.raises(ValueError, match="16-byte boundary"):  # TMA's alignment, checked before any transfer
        ops.ag_gemm(torch.zeros(40, dtype=torch.bfloat16, device=w.device)[1:33].view(4, 8), b)
    with pytest.raises(ValueError, match="comm_programs must be a positive int"):
        ops.AllGatherGEMM(4, 8, 8, torch.bfloat16, comm="sm", comm_programs=-5)
    with pytest.raises(ValueError, match="config dict"):
        gemm.matmul(a, b, config="tune")
    if w.world_size > 1:
        with pytest.raises(ValueError, match="multiple of the world size"):
            ops.gemm_rs(torch.zeros((w.world_size + 1, 8), dtype=torch.bfloat16, device=w.device),
                        torch.zeros((8, 8), dtype=torch.bfloat16, device=w.device))


def test_bad_input(world):
    world.run(_bad_input)


@pytest.mark.parametrize("m, n, flatten, shards, tile", [
    (1024, 4096, True, 1, (128, 256)),   # the GEMM alone at 2-rank ag_gemm's shape: one full wave of big tiles
    (1024, 4096, True, 2, (128, 128)),   # 2-rank ag_gemm: the own shard's tiles fill a wave, the peer's another
    (2048, 4096, True, 2, (128, 256)), (8192, 4096, True, 2, (128, 256)),
    (8192, 4096, True, 1, (128, 256)), (8192, 14336, True, 1, (128, 256)), (1024, 8192, False, 1, (128, 256)),
    (1024, 2048, True, 1, (128, 128)),   # 64 big tiles would leave half of 132 SMs idle
    (1024, 2048, True, 4, (64, 128)),    # 4-rank ag_gemm
    (512, 4096, True, 1, (128, 128)),
])
def test_pick_tile(m, n, flatten, shards, tile):
    """The default GEMM tile for an m x n product on 132 SMs (host code only)."""
    picked = gemm.pick_tile([c for c in gemm.GPU_CONFIGS if flatten or not c["FLATTEN"]], m, n, sms=132,
                            shards=shards)
    assert (picked["BLOCK_M"], picked["BLOCK_N"]) == tile


@pytest.mark.parametrize("m, nodes, method", [(32, 1, "ll"), (128, 1, "ll"), (129, 1, "one_shot"), (32, 2, "one_shot")])
def test_gemm_ar_auto(m, nodes, method):
    """What gemm_ar's `auto` picks (host code only): LL packets for decode-sized M on one node."""
    from types import SimpleNamespace

    from tridist.ops.gemm import policy

    assert policy.choose_gemm_ar(m, SimpleNamespace(nnodes=nodes)) == method


# ---- within process groups (`group=`) -------------------------------------------------------------
# Operands of small integers in fp16, and b a permutation (b[k, (k + shift) % N] = 1): every output is
# one element of A, or a sum of one element per member, all exact in fp16 and fp32, so results are
# compared exactly. An element says whose it is: its group, its world rank, its call and its index.

GROUP_LAYOUTS = {"pairs": ((0, 1), (2, 3)), "strided": ((0, 2), (1, 3))}


def _group_payload(group_id: int, rank: int, call: int, rows: int, span: int) -> torch.Tensor:
    """rows x 16 of ((group_id * 4 + rank) * 2 + call) * span + index % span: below 32 * span."""
    index = torch.arange(rows * 16).view(rows, 16)
    return (((group_id * 4 + rank) * 2 + call) * span + index % span).to(torch.float16)


def _permutation(rank: int) -> torch.Tensor:
    """16 x 16 b whose product moves column k of A to column (k + rank + 1) % 16."""
    b = torch.zeros(16, 16)
    b[torch.arange(16), (torch.arange(16) + rank + 1) % 16] = 1
    return b.to(torch.float16)


def _gemms_in(w, pg, group_id: int) -> None:
    """ag_gemm (both comms), gemm_rs and gemm_ar (both methods) within the process group `pg`, two
    calls of each back to back, shapes differing by group; the methods that reach peers through
    pointers only are refused where the group spans nodes."""
    g = tridist.group(pg)
    across = not g.is_one_node
    dev = w.device
    b, bs = _permutation(w.rank).to(dev), [_permutation(r).float() for r in g.ranks]
    rows = 8 + 8 * group_id  # per member
    for comm in ("sm", "ce"):
        if comm == "ce" and across:
            with pytest.raises(ValueError, match="this group spans 2 nodes"):
                ops.ag_gemm(_group_payload(group_id, w.rank, 0, rows, 64).to(dev), b, comm=comm, group=pg)
            continue
        outs = [ops.ag_gemm(_group_payload(group_id, w.rank, call, rows, 64).to(dev), b, comm=comm, group=pg)
                for call in range(2)]
        for call, out in enumerate(outs):
            gathered = torch.cat([_group_payload(group_id, r, call, rows, 64) for r in g.ranks]).float()
            assert torch.equal(out.float().cpu(), gathered @ bs[g.rank]), (comm, call, out)
    every = [[_group_payload(group_id, r, call, rows * g.size, 16) for r in g.ranks] for call in range(2)]
    outs = [ops.gemm_rs(every[call][g.rank].to(dev), b, group=pg) for call in range(2)]
    for call, out in enumerate(outs):
        total = sum(a.float() @ p for a, p in zip(every[call], bs))
        assert torch.equal(out.float().cpu(), total[g.rank * rows:(g.rank + 1) * rows]), ("gemm_rs", call, out)
    for method in ("one_shot", "ll"):
        a = [_group_payload(group_id, w.rank, call, rows // 2, 16).to(dev) for call in range(2)]
        if method == "ll" and across:
            with pytest.raises(ValueError, match="this group spans 2 nodes"):
                ops.gemm_ar(a[0], b, method=method, group=pg)
            continue
        outs = [ops.gemm_ar(a[call], b, method=method, group=pg) for call in range(2)]
        for call, out in enumerate(outs):
            total = sum(_group_payload(group_id, r, call, rows // 2, 16).float() @ p for r, p in zip(g.ranks, bs))
            assert torch.equal(out.float().cpu(), total), (method, call, out)
    g.barrier()  # the last calls' peers are done with this rank's buffers


def _groups_at_once(w, layout):
    made = [dist.new_group(list(ranks)) for ranks in GROUP_LAYOUTS[layout]]  # every rank makes every group
    group_id = next(i for i, ranks in enumerate(GROUP_LAYOUTS[layout]) if w.rank in ranks)
    # Each group its own shapes and data, and no world call until the end: a group whose kernels
    # waited on the other's ranks would stop here.
    _gemms_in(w, made[group_id], group_id)
    tridist.barrier_all()


@pytest.mark.parametrize("layout", GROUP_LAYOUTS)
@pytest.mark.worlds("4", "2x2")
def test_groups_at_once(world, layout):
    """Two groups at once: pairs of neighbours, and strided pairs (at 2x2 those span the nodes)."""
    world.run(_groups_at_once, layout=layout)


def _group_beside_other_work(w, folder):
    os.environ["TRIDIST_TUNE_CACHE"] = folder
    pair, alone = dist.new_group([0, 2]), dist.new_group([1])
    if w.rank == 1:
        # Not a member: refused before anything is allocated or launched, then its own work alone.
        x = _group_payload(0, 1, 0, 8, 16).to(w.device)
        for call in (lambda: ops.ag_gemm(x, x[:, :16].t().contiguous(), group=pair),
                     lambda: ops.gemm_rs(x, x[:, :16].t().contiguous(), group=pair),
                     lambda: ops.GemmAllReduce(8, 16, 16, torch.float16, group=pair)):
            with pytest.raises(ValueError, match="rank 1 is not a member of this process group"):
                call()
        _gemms_in(w, alone, group_id=2)
    else:
        _gemms_in(w, pair, group_id=0)
        # Tuned within the group: its members time the configs together, cached under its size.
        op = ops.GemmReduceScatter(32, 16, 16, torch.float16, config="tune", group=pair)
        assert op.config in gemm.configs(w.device)
        tridist.group(pair).barrier()  # the member that writes the cache has written it
        with open(os.path.join(folder, "tune.json")) as f:
            assert any("gemm_rs" in key and "group_size=2 nnodes=1" in key for key in json.load(f))
        op.free()
    tridist.barrier_all()


@pytest.mark.worlds("3")
def test_group_beside_a_rank_doing_other_work(world, tmp_path):
    world.run(_group_beside_other_work, folder=str(tmp_path))
