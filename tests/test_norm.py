"""all_reduce_rms_norm and add_rms_norm (tridist.ops.norm): every method against transformers' formula
on the rank-order fp32 sum, outputs poisoned, back-to-back calls, every rank the same bits; within
process groups, several at once; bad input refused on every rank before any launch; the benchmark's
checks.

Two kinds of data. "Grid" data (multiples of 1/16 in [-1, 1], random weights) makes every partial
sum of a row's squares exact in fp32, so the variance is the same whatever order a reduction adds
in, and the results must equal the reference bit for bit: at world size 1 torch's `residual + x`
then transformers' RMSNorm. On random data the new residual is still exact and y within one unit
in the last place of the reference (the variance's last bit may differ; in fp32 a few units), and within TOLERANCE of an
fp64 reference."""
import hashlib

import pytest
import torch

import tridist
from tridist import ops
from tridist.ops import norm
from tridist.ops.norm import policy
from tridist.ops.ranks import ranks_of

from .harness import group_layouts, join_groups

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
HIDDEN = 40  # small, no power of two, whole 4-byte words in every dtype (LL)
ODD_HIDDEN = 37  # not whole 4-byte words in 16-bit data: LL refuses it
EPS = 1e-6
# y on random data against the reference, relative: where the variance's last bit differs, a 16-bit
# y rounds the other way in a few elements (one unit in the last place), an fp32 y moves by a few units.
ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -21}
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5}  # vs fp64, relative to the row's max


def _rsqrt(v: torch.Tensor) -> torch.Tensor:
    # On GPUs torch.rsqrt is CUDA's approximate rsqrtf, the instruction the kernels' tl.math.rsqrt
    # compiles to. On the CPU torch's sqrt and rsqrt are not correctly rounded (torch 2.13's AVX-512
    # kernels: one element in eight differs), and the emulator's rsqrt is 1 / sqrt, each step
    # correctly rounded: the reference takes those two steps through fp64, which rounds them exactly.
    if v.is_cuda:
        return torch.rsqrt(v)
    return (1 / torch.sqrt(v.double()).float().double()).float()


def transformers_rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float, rsqrt=_rsqrt) -> torch.Tensor:
    """transformers' `Qwen3RMSNorm.forward` (and `LlamaRMSNorm`'s), written out."""
    input_dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * rsqrt(variance + eps)
    return weight * hidden.to(input_dtype)


def reference(xs: list, residual: torch.Tensor, weight: torch.Tensor, eps: float = EPS, device=None):
    """(y, new_residual) as the contract says: the ranks' x summed in fp32 in rank order, plus the
    residual, rounded once; then transformers' norm, computed on `device` (the op's: torch's mean and
    rsqrt there are what the kernels match), returned on the CPU. At world size 1: `residual + x`."""
    if device is not None:
        xs, residual, weight = [x.to(device) for x in xs], residual.to(device), weight.to(device)
    total = xs[0].float()
    for x in xs[1:]:
        total = total + x.float()
    new_residual = (total + residual.float()).to(residual.dtype)
    return transformers_rms_norm(new_residual, weight, eps).cpu(), new_residual.cpu()


def fp64_reference(xs: list, residual: torch.Tensor, weight: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    h = sum(x.double() for x in xs) + residual.double()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def _data(shape, dtype, seed: int, grid: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if grid:
        return (torch.randint(-16, 17, shape, generator=g) / 16).to(dtype)
    return torch.randn(shape, generator=g).to(dtype)


def _inputs(ranks: int, tokens: int, hidden: int, dtype, call: int, grid: bool):
    """([every rank's x], residual, weight) of one call, the same on every rank, on the CPU."""
    xs = [_data((tokens, hidden), dtype, 1000 * call + r, grid) for r in range(ranks)]
    residual = _data((tokens, hidden), dtype, 1000 * call + 999, grid)
    weight = _data((hidden,), dtype, 1000 * call + 998, False)  # any weight: its product is rounded once
    return xs, residual, weight


def _poisoned(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _digest(*tensors) -> str:
    return hashlib.sha256(b"".join(t.cpu().contiguous().view(torch.uint8).numpy().tobytes()
                                   for t in tensors)).hexdigest()


def check(y, new_residual, xs, residual, weight, grid: bool, what, ranks=None) -> None:
    """y and new_residual against `reference` (exact on grid data; y within a unit in the last
    place otherwise) and against fp64; and the same bits on every one of `ranks` (the world's
    ranks_of by default)."""
    expected_y, expected_residual = reference(xs, residual, weight, device=y.device)
    y, new_residual = y.cpu(), new_residual.cpu()
    assert torch.equal(new_residual, expected_residual), what
    if grid:
        assert torch.equal(y, expected_y), what
    elif y.numel():
        dtype = y.dtype
        torch.testing.assert_close(y.float(), expected_y.float(), rtol=ULP[dtype], atol=ULP[dtype] * 1e-3, msg=what)
        exact = fp64_reference(xs, residual, weight)
        scale = exact.abs().amax(-1, keepdim=True).clamp_min(1e-30)
        assert ((y.double() - exact).abs() / scale).max() <= TOLERANCE[dtype], what
    digests = (ranks or ranks_of()).allgather_objects(_digest(y, new_residual))
    assert len(set(digests)) == 1, f"{what}: ranks differ"


def _methods(w, hidden: int, dtype) -> list[str]:
    """The methods this world runs for rows of `hidden` elements of `dtype`."""
    methods = ["auto", "one_shot", "two_shot"] + (["local"] if w.world_size == 1 else [])
    if w.nnodes == 1 and hidden * dtype.itemsize % 4 == 0:
        methods.append("ll")
    return methods


def _every_method(w, dtype):
    """Every method, rows 0, 1, 5 (7 for auto) of HIDDEN (of ODD_HIDDEN for 16-bit one_shot and auto),
    two calls back to back (grid data, then random) into poisoned outputs, checked after both."""
    cases = [(m, t, HIDDEN) for m in _methods(w, HIDDEN, dtype) for t in ((0, 1, 7) if m == "auto" else (1, 5))]
    if dtype.itemsize == 2:
        cases += [("auto", 3, ODD_HIDDEN), ("one_shot", 3, ODD_HIDDEN)]
    for method, tokens, hidden in cases:
        op = ops.AllReduceRMSNorm(tokens, hidden, dtype, method)
        calls = []
        for call, grid in enumerate((True, False)):
            xs, residual, weight = _inputs(w.world_size, tokens, hidden, dtype, call, grid)
            y, new_residual = (_poisoned((tokens, hidden), dtype, w.device) for _ in range(2))
            out = op(xs[w.rank].to(w.device), residual.to(w.device), weight.to(w.device), EPS, y=y,
                     new_residual=new_residual)
            assert out[0] is y and out[1] is new_residual
            calls.append((out, xs, residual, weight, grid))
        for (y, new_residual), xs, residual, weight, grid in calls:
            check(y, new_residual, xs, residual, weight, grid, (method, op.method, tokens, hidden, grid))
        tridist.barrier_all()
        op.free()


@pytest.mark.worlds("1", "2", "3", "2x2")
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_method(world, dtype):
    world.run(_every_method, dtype=dtype)


def _two_passes(w):
    """Rows longer than the chunk (`block=16` for rows of 40: three chunks) are stored and read back:
    the same results; and the in-place residual (`new_residual=residual`), y into x."""
    for method in _methods(w, HIDDEN, torch.bfloat16):
        op = ops.AllReduceRMSNorm(3, HIDDEN, torch.bfloat16, method, block=16)
        for grid in (True, False):
            xs, residual, weight = _inputs(w.world_size, 3, HIDDEN, torch.bfloat16, 5, grid)
            x, stream = xs[w.rank].to(w.device).clone(), residual.to(w.device).clone()  # overwritten
            y, new_residual = op(x, stream, weight.to(w.device), EPS, y=x, new_residual=stream)
            assert y is x and new_residual is stream
            check(y, new_residual, xs, residual, weight, grid, (method, "block 16", grid))
        tridist.barrier_all()
        op.free()


@pytest.mark.worlds("1", "2", "2x2")
def test_rows_in_two_passes_and_in_place(world):
    world.run(_two_passes)


def _function(w):
    """The functions: all_reduce_rms_norm's auto at T 0, 1, 2 back to back on one instance per shape;
    add_rms_norm (world 1: what it is; it runs on any rank alone)."""
    results = []
    for call, tokens in enumerate((2, 0, 1, 2)):
        xs, residual, weight = _inputs(w.world_size, tokens, HIDDEN, torch.bfloat16, call, grid=True)
        out = ops.all_reduce_rms_norm(xs[w.rank].to(w.device), residual.to(w.device), weight.to(w.device))
        results.append((out, xs, residual, weight))
    for (y, new_residual), xs, residual, weight in results:
        check(y, new_residual, xs, residual, weight, True, ("function", y.shape))
    for dtype in DTYPES:
        xs, residual, weight = _inputs(1, 6, HIDDEN, dtype, 7, grid=True)
        x = xs[0].to(w.device)
        y, new_residual = ops.add_rms_norm(x, residual.to(w.device), weight.to(w.device))
        check(y, new_residual, xs, residual, weight, True, ("add_rms_norm", dtype), ranks=_alone())
        y, same = ops.add_rms_norm(x, None, weight.to(w.device), eps=1e-5)
        assert same is x
        assert torch.equal(y.cpu(), transformers_rms_norm(x, weight.to(w.device), 1e-5).cpu())
        empty = torch.empty(0, HIDDEN, dtype=dtype, device=w.device)
        assert [t.shape for t in ops.add_rms_norm(empty, empty, weight.to(w.device))] == [(0, HIDDEN)] * 2


def _alone():
    """Stands in for `ranks_of` where each rank's result is its own (add_rms_norm)."""
    class Alone:
        @staticmethod
        def allgather_objects(value):
            return [value]
    return Alone()


@pytest.mark.worlds("1", "3")
def test_functions(world):
    world.run(_function)


def test_the_reference_is_transformers_norm():
    """`transformers_rms_norm` with torch's own rsqrt is transformers' Qwen3RMSNorm and LlamaRMSNorm,
    bit for bit."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    for dtype in (torch.bfloat16, torch.float16):
        xs, residual, weight = _inputs(1, 9, HIDDEN, dtype, 3, grid=False)
        hidden = residual + xs[0]
        for kind in (Qwen3RMSNorm, LlamaRMSNorm):
            module = kind(HIDDEN, eps=1e-5).to(dtype)
            module.weight.data.copy_(weight)
            with torch.no_grad():
                assert torch.equal(module(hidden), transformers_rms_norm(hidden, weight, 1e-5, rsqrt=torch.rsqrt))
    assert transformers.__version__


def _bad_input(w):
    """Each bad call raises ValueError on every rank before anything is launched (y stays poisoned);
    ranks that disagree are told so."""
    x = torch.ones(3, HIDDEN, dtype=torch.bfloat16, device=w.device)
    weight = torch.ones(HIDDEN, dtype=torch.bfloat16, device=w.device)
    for args, match in [((x[0], x[0], weight), "must be \\[tokens, hidden\\]"),
                        ((x, x[:2], weight), "residual must be x's shape"),
                        ((x, x.float(), weight), "residual must be x's shape"),
                        ((x, x, weight[:-1]), "weight must be \\[40\\]"),
                        ((x, x, weight.float()), "weight must be \\[40\\]"),
                        ((x.int(), x.int(), weight), "dtype"),
                        ((x.t().contiguous().t(), x, weight), "contiguous"),
                        ((x[:, :0], x[:, :0], weight[:0]), "hidden >= 1")]:
        with pytest.raises(ValueError, match=match):
            ops.all_reduce_rms_norm(*args)
    with pytest.raises(ValueError, match="eps must be a finite number"):
        ops.all_reduce_rms_norm(x, x, weight, -1.0)
    with pytest.raises(TypeError, match="residual must be a torch.Tensor"):
        ops.all_reduce_rms_norm(x, None, weight)
    with pytest.raises(ValueError, match="residual must be x's shape"):
        ops.add_rms_norm(x, x[1:], weight)
    if w.world_size > 1:  # one rank's arguments differ from the others': every rank learns it
        tokens = 3 if w.rank == 0 else 2
        with pytest.raises(ValueError, match="ranks passed different shape and dtype of x"):
            ops.all_reduce_rms_norm(x[:tokens], x[:tokens], weight)
        with pytest.raises(ValueError, match="ranks passed different eps"):
            ops.all_reduce_rms_norm(x, x, weight, 1e-6 if w.rank == 0 else 1e-5)
    op = ops.AllReduceRMSNorm(3, HIDDEN, torch.bfloat16)
    y = _poisoned((3, HIDDEN), torch.bfloat16, w.device)
    bad = x[:2] if w.rank == w.world_size - 1 else x  # one rank only: every rank raises
    with pytest.raises(ValueError, match="built for x of shape"):
        op(bad, bad, weight, y=y)
    assert y.isnan().all()
    with pytest.raises(ValueError, match="y and new_residual must be different"):
        op(x, x, weight, y=y, new_residual=y)
    tridist.barrier_all()
    op.free()
    for build, match in [(lambda: ops.AllReduceRMSNorm(3, HIDDEN, torch.bfloat16, "carrier-pigeon"), "unknown method"),
                         (lambda: ops.AllReduceRMSNorm(3, 0, torch.bfloat16), "positive int hidden"),
                         (lambda: ops.AllReduceRMSNorm(3, HIDDEN, torch.int32), "takes"),
                         (lambda: ops.AllReduceRMSNorm(3, HIDDEN, torch.bfloat16, block=24), "power of two")]:
        with pytest.raises(ValueError, match=match):
            build()
    if w.world_size > 1:
        with pytest.raises(ValueError, match="'local' runs at world size 1"):
            ops.AllReduceRMSNorm(3, HIDDEN, torch.bfloat16, "local")
    if w.nnodes > 1:
        with pytest.raises(ValueError, match="within one node"):
            ops.AllReduceRMSNorm(3, HIDDEN, torch.bfloat16, "ll")
    else:
        with pytest.raises(ValueError, match="4-byte words"):
            ops.AllReduceRMSNorm(3, ODD_HIDDEN, torch.bfloat16, "ll")


@pytest.mark.worlds("1", "2", "2x2")
def test_bad_input_fails_before_launch(world):
    world.run(_bad_input)


def _in_groups(w, layout):
    """Every group of the layout runs the op at once on data of its own (its own seed and row
    count), two calls of each fused method and auto; a group of one rank runs the local method."""
    index, members, made = join_groups(layout)
    pg = made[index]
    ranks = ranks_of(pg)
    tokens = 2 + index
    methods = ["auto", "one_shot"] + (["ll"] if ranks.nnodes == 1 and ranks.world_size > 1 else [])
    for method in methods:
        op = ops.AllReduceRMSNorm(tokens, HIDDEN, torch.bfloat16, method, group=pg)
        for call in range(2):
            xs, residual, weight = _inputs(len(members), tokens, HIDDEN, torch.bfloat16, 10 * index + call, call == 0)
            y, new_residual = op(xs[ranks.rank].to(w.device), residual.to(w.device), weight.to(w.device))
            check(y, new_residual, xs, residual, weight, call == 0, (layout, method, call), ranks=ranks)
        tridist.barrier_all(pg)
        op.free()
    tridist.barrier_all()


@pytest.mark.parametrize("layout", group_layouts())
def test_within_groups(world, layout):
    world.run(_in_groups, layout=layout)


def _graph_replays(w, replays):
    """Each method captured once in a CUDA graph, replayed with new inputs; every 25th replay checked."""
    tokens = 8
    for method in _methods(w, 4096, torch.bfloat16):
        op = ops.AllReduceRMSNorm(tokens, 4096, torch.bfloat16, method)
        x, residual = (torch.zeros(tokens, 4096, dtype=torch.bfloat16, device=w.device) for _ in range(2))
        weight = torch.zeros(4096, dtype=torch.bfloat16, device=w.device)
        y, new_residual = op(x, residual, weight)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            op(x, residual, weight, y=y, new_residual=new_residual)
        for i in range(replays):
            xs, stream, scale = _inputs(w.world_size, tokens, 4096, torch.bfloat16, i, grid=i % 2 == 0)
            x.copy_(xs[w.rank])
            residual.copy_(stream)
            weight.copy_(scale)
            graph.replay()
            if i % 25 == 24:
                check(y, new_residual, xs, stream, scale, i % 2 == 0, (method, op.method, i))
        tridist.barrier_all()
        op.free()


def test_cuda_graph_replays(world):
    if world.backend == "emulator":
        pytest.skip("CUDA graphs need GPUs")
    world.run(_graph_replays, replays=100)


def _custom_ops(w):
    from torch._subclasses.fake_tensor import FakeTensorMode

    xs, residual, weight = _inputs(w.world_size, 3, HIDDEN, torch.float32, 4, grid=True)
    x, stream, scale = xs[w.rank].to(w.device), residual.to(w.device), weight.to(w.device)

    def layer(t, r, g):
        y, new_residual = torch.ops.tridist.all_reduce_rms_norm(t, r, g, 1e-6)
        return torch.ops.tridist.add_rms_norm(y, new_residual, g, 1e-6)

    y, new_residual = torch.compile(layer, backend="eager", fullgraph=True)(x, stream, scale)
    first_y, first_residual = reference(xs, residual, weight, device=w.device)
    expected = reference([first_y], first_residual, weight, device=w.device)
    assert torch.equal(y.cpu(), expected[0]) and torch.equal(new_residual.cpu(), expected[1])
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
        shapes = torch.ops.tridist.all_reduce_rms_norm(fake, fake, mode.from_tensor(scale), 1e-6)
        assert [t.shape for t in shapes] == [x.shape] * 2


@pytest.mark.worlds("1", "2")
def test_custom_ops_under_torch_compile(world):
    world.run(_custom_ops)


def _bench(w):
    """`tridist bench all_reduce_rms_norm`, checks only (nothing timed off GPUs), at small shapes."""
    from tridist.bench import norm as bench

    rows = bench.run([(3, HIDDEN), (1, 64)], torch.bfloat16, timed=False)
    assert rows == []


@pytest.mark.worlds("1", "2")
def test_bench_checks(world):
    world.run(_bench)


def test_auto_and_row_shapes():
    one_node = type("Ranks", (), {"world_size": 2, "nnodes": 1})
    across = type("Ranks", (), {"world_size": 4, "nnodes": 2})
    eight = type("Ranks", (), {"world_size": 8, "nnodes": 1})
    alone = type("Ranks", (), {"world_size": 1, "nnodes": 1})
    choose = policy.choose_all_reduce_rms_norm
    assert choose(4096, 8192, 2, alone) == "local"
    assert choose(64, 4096, 2, one_node) == "ll"
    assert choose(64, 4095, 2, one_node) == "one_shot"  # rows not whole words
    assert choose(1, 4096, 2, across) == "one_shot"
    assert choose(256, 8192, 2, eight) == "one_shot"  # decode sizes: one kernel
    assert choose(4096, 8192, 2, one_node) == "one_shot"
    assert choose(4096, 8192, 2, eight) == "two_shot"
    assert choose(4096, 8192, 4, one_node) == "one_shot" and choose(4096, 8192, 4, across) == "two_shot"
    assert policy.row_shape(4096) == (4096, 8, True)
    assert policy.row_shape(40) == (64, 4, True)
    assert policy.row_shape(16384) == (16384, 16, True)
    assert policy.row_shape(16385) == (policy.CHUNK, 16, False)
    assert policy.row_shape(40, block=16) == (16, 4, False)
    assert policy.row_programs(7, 4) == 4 and policy.row_programs(5, 4) == 3 and policy.row_programs(2, 132) == 2
    assert norm.METHODS == ("auto", "local", "ll", "one_shot", "two_shot")
