"""The benchmark kernels, checked without timing (the timing needs GPUs), and `sleep_async`."""
import json
import os
import re
import time

import pytest
import torch
import torch.distributed as dist

import tridist
from tridist.bench import overlap, primitives, results, shared_gpu, torch_fused
from tridist.runtime import config as settings



def _primitives(w):
    primitives.transfer_rows([4096, 40000], programs=3, timed=False)
    primitives.latency_rows(rounds=5, timed=False)
    primitives.put_get_latency_rows([8, 4096], rounds=2, timed=False)
    primitives.round_trip_rows(rounds=5, timed=False)


@pytest.mark.at_most_4_ranks
def test_primitive_kernels_move_the_right_data(world):
    if world.size % 2 and world.size > 1:
        pytest.skip("the benchmark pairs rank r with rank r ^ 1 (at world 1, with itself)")
    world.run(_primitives)


def _jacobi(w):
    from tridist.bench import jacobi

    rows = jacobi.run(w, [5, 8], timed=False, check_iterations=2)  # 5 rows round up to 6 over 2 ranks
    assert [(row["size"], row["host_loop difference"], row["fused difference"]) for row in rows] == \
        [("6x5", 0.0, 0.0), ("8x8", 0.0, 0.0)]


@pytest.mark.worlds("2")
def test_jacobi_bench_checks_both_versions(world):
    world.run(_jacobi)


def _sleep_async(w):
    with pytest.raises(ValueError, match=">= 0"):
        tridist.sleep_async(-1)
    if w.backend == "emulator":
        tridist.sleep_async(1e6)  # a no-op: the emulator has no stream to keep busy
        return
    tridist.sleep_async(1)  # compiles the kernel (the same one for every duration)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begun = time.monotonic()
    start.record()
    tridist.sleep_async(2000)
    end.record()
    if not settings.debug():  # which synchronises after every launch
        assert time.monotonic() - begun < 0.0015, "sleep_async must return before the GPU has slept"
    end.synchronize()
    assert 1500 <= start.elapsed_time(end) * 1000 <= 20000


def test_sleep_async(world):
    world.run(_sleep_async)


def _gemm_rs_epilogue(w):
    """`tridist bench gemm_rs_epilogue`'s variants of gemm_rs's loop give the right sums (its kernel
    pretends a world of two on one rank; the TMA-store variants run only on GPUs)."""
    from tridist.bench import gemm_rs_epilogue as module

    with pytest.raises(SystemExit, match="unknown variants"):
        module.main(["no such variant"])
    for config in module.gemm.configs(w.device):
        rows = module.run_variants(64, 32, 32, config, [])
        assert {row["variant"] for row in rows} >= {"plain", "layout+flags+sums+quiet", "layout+flags+tma half sums"}


def test_gemm_rs_epilogue_variants(world):
    if world.backend != "emulator":
        pytest.skip("on GPUs: `tridist bench gemm_rs_epilogue -n 1`")
    if world.size > 1:
        pytest.skip("its kernel pretends a world of two on one rank: world 1 only")
    world.run(_gemm_rs_epilogue)


# `tridist bench torch_fused` needs GPUs to measure anything; on the CPU it must still import (without
# starting tridist), check its arguments and say why it stops.

def test_short_kernel_names_keep_what_the_kernel_does():
    from tridist.bench.timing import short_kernel_name

    copy = ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::"
            "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}>(at::TensorIteratorBase&)>(int)")
    assert short_kernel_name(copy) == "at::native::elementwise_kernel[direct_copy_kernel_cuda]"
    multiply = ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::"
                "BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float> > >>(int)")
    assert short_kernel_name(multiply) == "at::native::elementwise_kernel[BinaryFunctor,MulFunctor]"
    assert short_kernel_name("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == \
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"
    assert short_kernel_name("gemm_ar_ll_kernel") == "gemm_ar_ll_kernel"


def test_torch_fused_arguments():
    shapes = torch_fused.parse_args([]).shapes  # by default those of ag_gemm and gemm_rs, each once
    assert set(shapes) == set(overlap.SHAPES["ag_gemm"]) | set(overlap.SHAPES["gemm_rs"])
    assert len(shapes) == len(set(shapes))
    args = torch_fused.parse_args(["--shapes", "1024x8192x4096, 64X32X16", "--out", "elsewhere"])
    assert args.shapes == [(1024, 8192, 4096), (64, 32, 16)] and args.out == "elsewhere"


@pytest.mark.parametrize("shapes", ["1024x8192", "8x8x0", "8x8xK", "8x8x8,"])
def test_torch_fused_refuses_bad_shapes(shapes, capsys):
    with pytest.raises(SystemExit) as stop:
        torch_fused.parse_args(["--shapes", shapes])
    assert stop.value.code == 2 and "three positive integers" in capsys.readouterr().err


def test_torch_fused_without_gpus_says_why(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same answer on a GPU machine
    with pytest.raises(SystemExit, match="no CUDA GPUs"):
        torch_fused.main(["--shapes", "1024x8192x8192"])
    assert not dist.is_initialized()
    with pytest.raises(tridist.NotInitializedError):
        tridist.world()


def test_overlap_takes_torch_fused_numbers_of_this_run(tmp_path, monkeypatch):
    """Only a torch_fused JSON that records this run's id (TRIDIST_BENCH_RUN), device and day; none
    without a run id."""
    folder = str(tmp_path)
    monkeypatch.setenv(results.RUN_VARIABLE, "run-1")
    assert overlap._torch_fused_us("ag_gemm", folder, 2, "bfloat16") == ({}, None)
    rows = [{"shape": "8x8x8", "torch fused ag_gemm us": 10.0, "torch fused gemm_rs us": 20.0},
            {"shape": "16x8x8", "torch fused gemm_rs us": 40.0}]  # ag_gemm failed at 16x8x8
    path = results.save("torch_fused", rows, folder, {"world_size": 2, "dtype": "bfloat16"})
    us, source = overlap._torch_fused_us("ag_gemm", folder, 2, "bfloat16")
    assert us == {"8x8x8": 10.0} and "separate process" in source and "TRIDIST_BENCH_RUN=run-1" in source
    assert overlap._torch_fused_us("gemm_rs", folder, 2, "bfloat16")[0] == {"8x8x8": 20.0, "16x8x8": 40.0}
    assert overlap._torch_fused_us("gemm_ar", folder, 2, "bfloat16") == ({}, None)
    # other ranks or another dtype are not comparable
    assert overlap._torch_fused_us("ag_gemm", folder, 4, "bfloat16") == ({}, None)
    assert overlap._torch_fused_us("ag_gemm", folder, 2, "float16") == ({}, None)
    with open(path) as f:
        saved = json.load(f)

    def write(name: str, ag_gemm_us: float, date: str, seconds_later: int) -> None:
        with open(tmp_path / name, "w") as f:
            json.dump({**saved, "date": date, "rows": [{"shape": "8x8x8", "torch fused ag_gemm us": ag_gemm_us}]}, f)
        when = os.path.getmtime(path) + seconds_later  # explicit: a file system may keep coarse times
        os.utime(tmp_path / name, (when, when))

    write("torch_fused-again.json", 11.0, saved["date"], 1)  # the newest of this day wins
    assert overlap._torch_fused_us("ag_gemm", folder, 2, "bfloat16")[0] == {"8x8x8": 11.0}
    write("torch_fused-other-day.json", 1.0, "2000-01-01", 2)  # newer still, but another day's
    assert overlap._torch_fused_us("ag_gemm", folder, 2, "bfloat16")[0] == {"8x8x8": 11.0}
    monkeypatch.setenv(results.RUN_VARIABLE, "run-2")  # the same day and device, another run
    assert overlap._torch_fused_us("ag_gemm", folder, 2, "bfloat16") == ({}, None)
    monkeypatch.delenv(results.RUN_VARIABLE)
    assert overlap._torch_fused_us("ag_gemm", folder, 2, "bfloat16") == ({}, None)


def test_collective_bench_arguments(capsys):
    """`tridist bench allgather|reducescatter|allreduce` reads its sizes, and refuses what it cannot
    run before starting anything."""
    from tridist.bench import collectives

    assert collectives.sizes_between("4K..1M") == [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20]
    assert collectives.sizes_between("4K,1M") == [4 << 10, 1 << 20]
    with pytest.raises(SystemExit):
        collectives.main(["reducescatter", "--symmetric"])
    assert "--symmetric is for allgather and allreduce" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        collectives.main(["allgather", "--programs", "many"])
    assert "--programs takes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        collectives.main(["allreduce", "--group-size", "0"])
    assert "--group-size takes a positive number of ranks" in capsys.readouterr().err


def _collective_bench_in_groups(w):
    """`tridist bench allreduce -n 4 --group-size 2 --sizes 4K` (and the all-gather into a symmetric
    out of each pair's own), checks only: both pairs run every method at once on data of their own,
    each checked against torch.distributed within its pair."""
    from tridist.bench import collectives

    for argv in (["allreduce"], ["allgather", "--symmetric", "--method", "ce"]):
        args = collectives.parse_args([*argv, "--group-size", "2", "--sizes", "4K", "--dtype", "float32"])
        methods = [args.method] if args.method else list(collectives.METHODS[args.op])
        assert collectives.run(args.op, collectives.sizes_between(args.sizes), methods, torch.float32, args.variants,
                               args.symmetric, group_size=args.group_size, timed=False) == ([], [])
    with pytest.raises(SystemExit, match="--group-size 3 does not divide the 4 ranks"):
        collectives.my_group(3)


@pytest.mark.worlds("4")
def test_collective_bench_in_groups(world):
    world.run(_collective_bench_in_groups)


def _collective_bench_across_nodes(w):
    """`TRIDIST_NNODES=2 tridist bench <op> -n 2`, checks only: the one-node methods are left out
    rather than counted as failures (which made the run exit 1), and the others pass."""
    from tridist.bench import collectives

    for op in collectives.METHODS:
        args = collectives.parse_args([op, "--sizes", "4K", "--dtype", "float32"])
        rows_and_failures = collectives.run(op, [4096], list(collectives.METHODS[op]), torch.float32, args.variants,
                                            timed=False)
        assert rows_and_failures == ([], []), (op, rows_and_failures)


@pytest.mark.worlds("2x1")
def test_collective_bench_across_nodes_leaves_one_node_methods_out(world):
    world.run(_collective_bench_across_nodes)


def test_bench_help_and_bad_rank_counts(capsys, monkeypatch):
    """`tridist bench -h` lists the benchmarks; `NAME -h` prints NAME's options without starting ranks;
    a bad `-n` is refused with a sentence, not a traceback."""
    from tridist import cli
    from tridist.bench import cli as bench_cli

    monkeypatch.delenv("RANK", raising=False)  # outside a launcher: `-n` would start ranks
    assert cli.main(["bench", "-h"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in bench_cli.BENCHMARKS) and "-n RANKS" in out
    with pytest.raises(SystemExit) as stop:
        cli.main(["bench", "gemm_ar", "-n", "2", "--help"])
    assert stop.value.code == 0 and "--shapes" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:  # a benchmark of one GPU: one rank by default
        cli.main(["bench", "gemm_rs_epilogue", "--help"])
    out = capsys.readouterr().out
    assert stop.value.code == 0 and "ranks to start (default 1)" in out and "--rounds" in out
    for bad in (["-n"], ["-n", "two"], ["-n", "0"]):
        assert cli.main(["bench", "gemm_ar", *bad]) == 2
        assert "-n takes a number of ranks" in capsys.readouterr().err
    assert cli.main(["bench", "no_such_benchmark"]) == 2
    assert "unknown benchmark 'no_such_benchmark'" in capsys.readouterr().err


def test_gpu_suite_keeps_multicast_off_like_the_runtime():
    """scripts/gpu_suite.sh exports NVLink-multicast-off itself, in case Python fails first: the same
    values as the runtime's SAFE_ENVIRONMENT."""
    from tridist.runtime.nvshmem import SAFE_ENVIRONMENT

    with open(os.path.join(os.path.dirname(__file__), "..", "scripts", "gpu_suite.sh")) as f:
        exported = dict(word.split("=", 1) for line in f if line.startswith("export ")
                        for word in line.split()[1:] if "=" in word)
    assert {key: exported.get(key) for key in SAFE_ENVIRONMENT} == SAFE_ENVIRONMENT


def test_relative_error_is_against_the_largest_expected_value():
    expected = torch.tensor([[4.0, -2.0], [0.5, 0.0]])
    assert results.relative_error(expected.to(torch.bfloat16), expected) == 0.0
    assert results.relative_error(expected + torch.tensor([[0.0, 0.0], [0.0, -0.2]]), expected) == pytest.approx(0.05)


# Ranks sharing a GPU (`tridist run --ranks-per-gpu`): the benchmarks' references go through the host
# (gloo), they say so, and their results say that no speed was measured.

def _host_references(w, folder):
    own_group = not dist.is_initialized()  # tridist.init() starts torch.distributed (gloo in the emulator)
    if own_group:
        dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=w.rank, world_size=w.world_size)
    try:
        n = w.world_size
        x = (torch.arange(6, dtype=torch.float32) + 10 * w.rank).to(torch.bfloat16)
        gathered = torch.empty(2, 3 * n, dtype=torch.bfloat16)
        shared_gpu.all_gather(gathered, x)
        assert torch.equal(gathered.view(-1).float(), torch.cat([torch.arange(6.0) + 10 * r for r in range(n)]))
        total = torch.full((2 * n, 3), w.rank + 1.0, dtype=torch.bfloat16)
        shared_gpu.all_reduce(total)
        assert (total.float() == n * (n + 1) / 2).all()
        rows = torch.arange(6.0 * n).view(2 * n, 3)
        mine = torch.empty(2, 3)
        shared_gpu.reduce_scatter(mine, rows * (w.rank + 1))
        assert torch.equal(mine, rows[2 * w.rank:2 * w.rank + 2] * n * (n + 1) / 2)
    finally:
        if own_group:
            dist.destroy_process_group()


@pytest.mark.worlds("3")
def test_references_through_the_host_group(world, tmp_path):
    world.run(_host_references, folder=str(tmp_path))


def test_results_are_named_by_device_and_date_and_never_replaced(tmp_path):
    env = {"date": "2026-11-28", "device": "NVIDIA H200", "ranks": 2}
    assert results.file_name("allreduce", env) == "allreduce-h200x2-2026-11-28.json"
    assert results.file_name("allreduce", env, repeat=2) == "allreduce-h200x2-2026-11-28-2.json"
    assert results.file_name("allreduce", {**env, "virtual_nodes": 2}) == "allreduce-h200x2-2nodes-2026-11-28.json"
    assert results.file_name("stress", env, ranks_per_gpu=2) == "stress-h200x2-shared2-2026-11-28.json"
    assert [results.device_tag(name) for name in ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", None]] == \
        ["h100", "a100", "cpu"]
    first, second = (results.save("x", [{"us": float(i)}], str(tmp_path)) for i in range(2))
    assert os.path.basename(second) == os.path.basename(first).replace(".json", "-2.json")
    with open(first) as f:
        saved = json.load(f)
    assert saved["rows"] == [{"us": 0.0}] and saved["tridist"] == tridist.__version__
    assert {"date", "torch", "triton"} <= set(saved)
    if results.CHECKOUT.joinpath(".git").exists():  # the suite runs from a clone: the commit is recorded
        assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", saved["tridist_commit"])
    assert results.title("allreduce, 2 ranks", env) == "allreduce, 2 ranks: NVIDIA H200, 2026-11-28"


def test_results_of_virtual_nodes_say_so(monkeypatch):
    """A run split into virtual nodes (TRIDIST_NNODES) records it and says it in its file's name, so
    that its figures (the cross-node methods) are never taken for a one-node run's."""
    monkeypatch.setenv("TRIDIST_NNODES", "2")
    env = results.environment()
    assert env["virtual_nodes"] == 2
    name = results.file_name("allgather", {**env, "device": "NVIDIA H200", "ranks": 2})
    assert name.startswith("allgather-h200x2-2nodes-")
    monkeypatch.delenv("TRIDIST_NNODES")
    assert "virtual_nodes" not in results.environment()


def test_results_say_when_ranks_share_a_gpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRIDIST_RANKS_PER_GPU", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert shared_gpu.announce("tridist bench x", rank=0)
    said = capsys.readouterr().out
    assert "2 ranks share each GPU" in said and "no speed claim is made" in said
    path = results.save("x", [{"us": 1.0}], str(tmp_path))
    with open(path) as f:
        saved = json.load(f)
    assert "-shared2-" in os.path.basename(path)
    assert saved["ranks_per_gpu"] == 2 and saved["speed"] == "not comparable: ranks share one GPU"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: True)
        assert torch_fused.main(["--shapes", "1024x8192x8192"]) == 0  # skipped before NCCL refuses
    assert "skipped" in capsys.readouterr().out and not dist.is_initialized()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one rank shares its GPU with nobody
    assert not shared_gpu.announce("tridist bench x", rank=0) and capsys.readouterr().out == ""
    path = results.save("x", [{"us": 1.0}], str(tmp_path))
    with open(path) as f:
        assert "shared" not in os.path.basename(path) and "speed" not in json.load(f)
