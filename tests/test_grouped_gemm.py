"""The grouped GEMM (`tridist.ops.grouped_gemm`) against float32 products on the CPU: empty groups,
all rows in one group, group boundaries off the tiles, rows past the last group, fp8 scales, every
config, bad input. A local op: one world suffices."""
import pytest
import torch

from tridist import ops
from tridist.bench.results import relative_error
from tridist.ops.gemm import grouped

# bf16 and fp16 outputs round the fp32 accumulator: errors relative to the largest value.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _random(shape, seed, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _offs(sizes):
    return torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)


def reference(x, w, offs, scale_a=None, scale_b=None):
    """float32 products on the CPU, rows past the last group NaN (grouped_gemm leaves them alone)."""
    x, w, ends = x.cpu().float(), w.cpu().float(), offs.cpu().tolist()
    out = torch.full((x.shape[0], w.shape[2]), float("nan"))
    for expert, (start, end) in enumerate(zip([0] + ends[:-1], ends)):
        out[start:end] = x[start:end] @ w[expert]
        if scale_a is not None:
            out[start:end] *= scale_a.cpu()[start:end, None] * scale_b.cpu()[expert]
    return out


def assert_close(actual, expected, tolerance, what):
    actual = actual.cpu().float()
    written = ~expected.isnan().all(dim=1)
    assert actual[~written].isnan().all(), f"{what}: rows past the last group were written"
    if written.any():
        error = relative_error(actual[written], expected[written])
        assert error <= tolerance, f"{what}: relative error {error:.2e} > {tolerance:.0e}"


SIZES = {
    "unaligned, empty groups": [5, 0, 17, 3, 0, 11],
    "all in one": [0, 0, 36, 0, 0, 0],
    "none": [0, 0, 0, 0, 0, 0],
    "rows past the last group": [4, 9, 0, 1, 7, 2],  # 23 of 36 rows
}


def _grouped(w, dtype, k, n):
    experts, rows = 6, 36
    for what, sizes in SIZES.items():
        x = _random((rows, k), 1, dtype)
        weights = _random((experts, k, n), 2, dtype)
        # Experts with no rows get NaN weights: a tile that read past the end of its expert's K rows
        # into the next expert's would turn NaN.
        for expert, size in enumerate(sizes):
            if size == 0:
                weights[expert] = float("nan")
        offs = _offs(sizes)
        expected = reference(x, weights, offs)
        for config in grouped.configs(w.device, dtype):
            out = torch.full((rows, n), float("nan"), dtype=dtype, device=w.device)
            result = ops.grouped_gemm(x.to(w.device), weights.to(w.device), offs.to(w.device), out=out, config=config)
            assert result is out
            assert_close(out, expected, TOLERANCE[dtype], f"{what}, {dtype}, {config}")
    out = ops.grouped_gemm(x.to(w.device), weights.to(w.device), offs.to(w.device))  # new out, default config
    assert out.dtype == dtype and out.shape == (rows, n)


@pytest.mark.worlds("1")
@pytest.mark.parametrize("dtype, k, n", [(torch.bfloat16, 40, 24), (torch.float16, 16, 8)])
def test_grouped_gemm(world, dtype, k, n):
    world.run(_grouped, dtype=dtype, k=k, n=n)


def _fp8(w):
    experts, rows, k, n = 4, 30, 32, 24
    sizes = [7, 0, 14, 6]  # rows 27.. past the last group
    x = _random((rows, k), 3).to(grouped.FP8)
    weights = _random((experts, n, k), 4).to(grouped.FP8).transpose(1, 2)  # column-major per expert
    scale_a = torch.rand(rows, generator=torch.Generator().manual_seed(5)) + 0.5
    scale_b = torch.rand(experts, n, generator=torch.Generator().manual_seed(6)) + 0.25
    offs = _offs(sizes)
    expected = reference(x, weights, offs, scale_a, scale_b)
    for config in grouped.configs(w.device, grouped.FP8):
        out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device=w.device)
        ops.grouped_gemm(x.to(w.device), weights.to(w.device), offs.to(w.device), out=out, config=config,
                         scale_a=scale_a.to(w.device), scale_b=scale_b.to(w.device))
        assert_close(out, expected, TOLERANCE[torch.bfloat16], f"fp8 {config}")


@pytest.mark.worlds("1")
def test_grouped_gemm_fp8(world):
    world.run(_fp8)


def _back_to_back(w):
    """Calls queued one after the other, offs changing on the device between them, no host sync."""
    dtype, experts, rows, k, n = torch.bfloat16, 3, 20, 16, 16
    x, weights = _random((rows, k), 7, dtype).to(w.device), _random((experts, k, n), 8, dtype).to(w.device)
    offs = torch.zeros(experts, dtype=torch.int32, device=w.device)
    every = [[20, 0, 0], [1, 18, 1], [0, 7, 13]]
    outs = []
    for sizes in every:
        offs.copy_(_offs(sizes))
        outs.append(ops.grouped_gemm(x, weights, offs))
    for sizes, out in zip(every, outs):
        assert_close(out, reference(x, weights, _offs(sizes)), TOLERANCE[dtype], f"sizes {sizes}")


@pytest.mark.worlds("1")
def test_grouped_gemm_back_to_back(world):
    world.run(_back_to_back)


def _bad_input(w):
    dtype = torch.bfloat16
    x = torch.zeros((8, 16), dtype=dtype, device=w.device)
    weights = torch.zeros((2, 16, 8), dtype=dtype, device=w.device)
    offs = torch.tensor([4, 8], dtype=torch.int32, device=w.device)
    cases = [
        ((x, weights, offs.long()), "int32 of shape"),
        ((x, weights, offs[:1]), r"int32 of shape \(2,\)"),
        ((x, weights[0], offs), "3-D tensor"),
        ((x.half(), weights, offs), "matrix of w's dtype"),
        ((x[:, :8], weights, offs), "not contiguous|columns"),
        ((torch.zeros((8, 8), dtype=dtype, device=w.device), weights, offs), "columns"),
        ((x.float(), weights.float(), offs), "supported"),
        ((torch.zeros((8, 12), dtype=dtype, device=w.device), torch.zeros((2, 12, 8), dtype=dtype, device=w.device),
          offs), "multiple of 8"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            ops.grouped_gemm(*args)
    with pytest.raises(ValueError, match="out must be"):
        ops.grouped_gemm(x, weights, offs, out=torch.empty((8, 9), dtype=dtype, device=w.device))
    with pytest.raises(ValueError, match="config must be a dict"):
        ops.grouped_gemm(x, weights, offs, config="fast")
    with pytest.raises(ValueError, match="fp8 operands only"):
        ops.grouped_gemm(x, weights, offs, scale_a=torch.ones(8, device=w.device))
    x8 = torch.zeros((8, 32), dtype=grouped.FP8, device=w.device)
    w8 = torch.zeros((2, 16, 32), dtype=grouped.FP8, device=w.device).transpose(1, 2)
    scale_b = torch.ones((2, 16), device=w.device)
    with pytest.raises(ValueError, match="column-major per expert"):
        ops.grouped_gemm(x8, w8.contiguous(), offs, scale_a=torch.ones(8, device=w.device), scale_b=scale_b)
    with pytest.raises(ValueError, match=r"scale_a: contiguous float32 of shape \(8,\)"):
        ops.grouped_gemm(x8, w8, offs, scale_a=torch.ones(1, device=w.device), scale_b=scale_b)
    with pytest.raises(ValueError, match="non-decreasing"):
        grouped.check_offs(torch.tensor([5, 3], dtype=torch.int32), 8)
    with pytest.raises(ValueError, match="non-decreasing"):
        grouped.check_offs(torch.tensor([5, 9], dtype=torch.int32), 8)


@pytest.mark.worlds("1")
def test_grouped_gemm_bad_input(world):
    world.run(_bad_input)


def _tuned(w, folder):
    import os

    os.environ["TRIDIST_TUNE_CACHE"] = folder
    dtype, sizes = torch.bfloat16, [3, 0, 9]
    x, weights = _random((12, 16), 9, dtype), _random((3, 16, 8), 10, dtype)
    offs = _offs(sizes)
    out = ops.grouped_gemm(x.to(w.device), weights.to(w.device), offs.to(w.device), config="tune")
    assert_close(out, reference(x, weights, offs), TOLERANCE[dtype], "tuned")
    assert len(grouped._tuned) == 1 and next(iter(grouped._tuned.values())) in grouped.configs(w.device, dtype)


@pytest.mark.worlds("1")
def test_grouped_gemm_tuned(world, tmp_path):
    world.run(_tuned, folder=str(tmp_path))
