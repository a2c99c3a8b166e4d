"""`tridist.ops.linear` (the decode GEMM, issue 54) against fp64 products and transformers' LlamaMLP
arithmetic on the CPU: every row count the front routes (0, the split-K kernel's 1 to 64, cuBLAS's
65), leading dims, bias, swiglu, bf16 and fp16, every variant of the kernel (tensor cores or FMA,
TMA or pointers, one split or several), the same bits call after call, bad input refused before
any launch; and `tridist bench linear`'s checks. A local op: world 1 only."""
import pytest
import torch

from tridist import ops
from tridist.bench.results import relative_error
from tridist.ops import instances
from tridist.ops.gemm import linear_gemm as front
from tridist.ops.gemm.linear_gemm import policy

K, N = 40, 24  # neither a power of two; multiples of 8. swiglu: I = N, the weight 2N rows
# Errors relative to the largest expected value. Plain: the fp32 sum rounded once, so at most half
# an ulp of the dtype in fp16 (2^-11 of a value), with a little room for the fp32 sum; in bf16 a
# whole ulp (2^-7), since the emulator's interpreter truncates fp32 to bf16 where GPUs round to
# nearest (docs/guide/emulator.md). swiglu: the gate and the up are rounded before the epilogue,
# where an fp32 sum that differs from the reference's in its last bits may round one ulp the other
# way, and so may each later step: a few ulps.
TOLERANCE = {(torch.bfloat16, None): 1.05 * 2 ** -7, (torch.float16, None): 1.05 * 2 ** -11,
             (torch.bfloat16, "swiglu"): 2 ** -5, (torch.float16, "swiglu"): 2 ** -10}
ROWS = {0: (0, K), 1: (1, 1, K), 3: (3, K), 16: (2, 8, K), 64: (4, 16, K), 65: (65, K)}


def _random(shape, seed, dtype):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _operands(rows_shape, activation, dtype, bias, seed=0):
    rows = 2 * N if activation == "swiglu" else N
    x = _random(rows_shape, seed, dtype)
    weight = _random((rows, K), seed + 1, dtype) / K ** 0.5
    return x, weight, _random((rows,), seed + 2, dtype) if bias else None


def expected(x, weight, bias, activation):
    """fp64 products; for swiglu each step rounded to the dtype as LlamaMLP rounds it."""
    y = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    if activation != "swiglu":
        return y
    gate, up = (half.to(x.dtype).double() for half in y.chunk(2, dim=-1))
    act = (gate / (1 + torch.exp(-gate))).to(x.dtype).double()
    return (act * up).to(x.dtype).double()


def _check(out, x, weight, bias, activation, what):
    dtype = x.dtype
    for name, reference in (("fp64", expected(x, weight, bias, activation)),
                            ("torch", front.reference(x, weight, bias, activation))):
        assert out.shape == reference.shape and out.dtype == dtype, f"{what}: {out.shape} {out.dtype}"
        if out.numel():
            error = relative_error(out.cpu(), reference)
            assert error <= TOLERANCE[dtype, activation], f"{what}: relative error {error:.2e} against {name}"


def _linear(w):
    for dtype in (torch.bfloat16, torch.float16):
        for activation in (None, "swiglu"):
            for m, rows_shape in ROWS.items():
                for bias in (False, True):
                    x, weight, b = _operands(rows_shape, activation, dtype, bias, seed=m)
                    out = ops.linear(x.to(w.device), weight.to(w.device), None if b is None else b.to(w.device),
                                     activation=activation)
                    _check(out, x, weight, b, activation, f"{dtype} {activation} M={m} bias={bias}")


@pytest.mark.worlds("1")
def test_linear(world):
    world.run(_linear)


# Every variant of the kernel: (config, rows). FMA takes one row.
VARIANTS = [
    (dict(DOT=True, TMA=False, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=1, splits=1), 5),
    (dict(DOT=True, TMA=True, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=1, splits=3), 5),
    (dict(DOT=True, TMA=True, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=1, splits=2), 20),
    (dict(DOT=False, TMA=False, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=1, splits=3), 1),
    (dict(DOT=False, TMA=True, BLOCK_N=8, BLOCK_K=32, num_warps=4, num_stages=1, splits=1), 1),
]


def _variants(w):
    for config, m in VARIANTS:
        for activation in (None, "swiglu"):
            x, weight, b = _operands((m, K), activation, torch.bfloat16, bias=True, seed=m)
            op = ops.Linear(m, weight.shape[0], K, torch.bfloat16, activation, config=config)
            out = torch.full((m, N), float("nan"), dtype=torch.bfloat16, device=w.device)
            assert op(x.to(w.device), weight.to(w.device), b.to(w.device), out=out) is out
            _check(out, x, weight, b, activation, f"{config} {activation} M={m}")
            op.free()


@pytest.mark.worlds("1")
def test_linear_variants(world):
    world.run(_variants)


def _same_bits(w):
    """Calls back to back (the emulator runs a launch's programs at once, so the splits of a tile
    arrive in any order) give the same bits, and leave the tile counters at zero. K split in 3 (a
    GPU's policy would not split so small a K)."""
    config = VARIANTS[1][0]
    for activation in (None, "swiglu"):
        x, weight, b = (t.to(w.device) for t in _operands((3, K), activation, torch.bfloat16, bias=True, seed=9))
        op = ops.Linear(3, weight.shape[0], K, torch.bfloat16, activation, config=config)
        assert op.method.splits > 1
        first = op(x, weight, b)
        for _ in range(3):
            assert torch.equal(op(x, weight, b), first)
            assert not op.method.counters.any()
        op.free()


@pytest.mark.worlds("1")
def test_linear_same_bits(world):
    world.run(_same_bits)


def _bad_input(w):
    dtype, device = torch.bfloat16, w.device
    x = torch.zeros((2, K), dtype=dtype, device=device)
    weight = torch.zeros((N, K), dtype=dtype, device=device)
    cases = [
        ((x.half(), weight), {}, "x is torch.float16 but weight is torch.bfloat16"),
        ((torch.zeros((2, K + 8), dtype=dtype, device=device), weight), {}, r"x must be \[..., K\] with K = 40"),
        ((x, torch.zeros((K, N), dtype=dtype, device=device).t()), {}, "not contiguous"),
        ((x, torch.zeros((N - 1, K), dtype=dtype, device=device)), {"activation": "swiglu"}, "odd number"),
        ((x.float(), weight.float()), {}, "supported"),
        ((x, weight, torch.zeros(N + 1, dtype=dtype, device=device)), {}, r"bias must be torch.bfloat16 of shape"),
        ((x, weight), {"activation": "gelu"}, "activation must be one of"),
        ((torch.zeros((2, 12), dtype=dtype, device=device), torch.zeros((N, 12), dtype=dtype, device=device)), {},
         "not a multiple of 8"),
        ((x, torch.zeros(N * K + 1, dtype=dtype, device=device)[1:].view(N, K)), {}, "16-byte boundary"),
    ]
    built = len(instances._instances)
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            ops.linear(*args, **kwargs)
    assert len(instances._instances) == built, "a refused call built an instance"
    with pytest.raises(ValueError, match="FMA variant"):
        ops.Linear(3, N, K, dtype, config={**policy.EMULATOR_CONFIG, "DOT": False, "splits": 1})
    with pytest.raises(ValueError, match="this Linear takes 2 rows"):
        ops.Linear(2, N, K, dtype)(torch.zeros((3, K), dtype=dtype, device=device), weight)


@pytest.mark.worlds("1")
def test_linear_bad_input(world):
    world.run(_bad_input)


@pytest.mark.parametrize("m, n, k, sms, splits", [
    (1, 4096, 4096, 132, 8),      # 64 tiles: splits fill the SMs
    (1, 151936, 4096, 132, 1),    # the logits: tiles enough
    (64, 4096, 256, 132, 1),      # K too short to split
])
def test_policy_splits(m, n, k, sms, splits):
    assert policy.config(m, n, k, sms)["splits"] == splits


def test_gpu_configs_leave_two_programs_an_sm():
    """At the most rows it takes, each GPU config's pipeline leaves an SM (228 KB on an H100 or H200,
    1 KB of it kept per program) room for a second program: at one program an SM the 64-row products
    read their weights at 0.41-0.78 of the copy rate (benchmarks/NOTES.md, "The decode GEMM by shape")."""
    for most_rows, plain, fused in policy.GPU_CONFIGS:
        for config, swiglu in ((plain, False), (fused, True)):
            assert 2 * (policy.pipeline_bytes(config, most_rows, swiglu) + 1024) <= 228 << 10, (most_rows, config)


def _bench(w):
    from tridist.bench import linear as bench

    rows = bench.run(bench.EMULATOR_SHAPES, [1, 3], timed=False)
    assert {row["shape"] for row in rows} == {name for name, *_ in bench.EMULATOR_SHAPES}
    assert all(row["rel err"] <= bench.TOLERANCE[row["activation"] or None] and row["same bits"] for row in rows)
    every, best = bench.sweep(bench.EMULATOR_SHAPES[:1], [1], timed=False)
    assert len(best) == 1 and all(row.get("checked") for row in every), every


@pytest.mark.worlds("1")
def test_linear_bench_checks(world):
    world.run(_bench)


def _custom_op(w):
    """`torch.ops.tridist.linear` under torch.compile: the function's bits, plain and swiglu."""
    for activation in (None, "swiglu"):
        x, weight, bias = (t if t is None else t.to(w.device) for t in _operands((3, K), activation, torch.bfloat16, True))
        compiled = torch.compile(lambda x: torch.ops.tridist.linear(x, weight, bias, activation), backend="aot_eager",
                                 fullgraph=True)
        assert torch.equal(compiled(x), ops.linear(x, weight, bias, activation=activation)), activation


@pytest.mark.worlds("1")
def test_linear_custom_op_under_torch_compile(world):
    world.run(_custom_op)
