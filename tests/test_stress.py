"""`tridist stress`: its plan, its checks, a short run in the emulator's worlds, and a planted wrong
result and a planted hang counted as such by the command, which ends promptly."""
import json
import os
import re
import time
from types import SimpleNamespace

import pytest
import torch

from tridist.stress import EXIT_HANG, cases, rank

from .harness import backend
from .test_launcher import gpus, tridist_cli

# Calls per world. In the emulator every op, mode and form comes up in CI's time (3 ranks cost twice
# what 2 do on two cores): seed 972 draws each of the 14 ops at least twice at each size (ag_moe,
# moe_rs, grouped_gemm: 2 to 5; the only such seed below 5000 since the MoE ops draw a tile order).
# On GPUs, where each new kernel variant takes seconds to compile, its first 8 calls cover the
# graph and stream modes and both forms; the long GPU runs are `tridist stress`'s own.
CALLS = {"2": 100, "3": 60} if backend() == "emulator" else {"2": 8, "3": 8}
SEED = 972


def _stress(w, calls, seed):
    # Evicting the functions' instances every few calls, not every 64, so that a short run takes
    # that path too (it once failed only past call 64, on a GPU).
    rank.EVICT_EVERY = 5
    report = rank.run(w, calls, seed)
    assert report["calls"] == calls and not report["wrong"], report["wrong"]
    plan = cases.plan(seed, calls, w, cases.select(None))
    return sorted({(c.op, c.form, c.mode) for c in plan.calls})


@pytest.mark.worlds("2", "3")
def test_stress_run(world):
    drawn = world.run(_stress, calls=CALLS[world.name], seed=SEED)[0]
    assert {form for _, form, _ in drawn} == set(cases.FORMS)
    if world.backend == "emulator":
        assert {op for op, _, _ in drawn} == set(cases.registry())
        assert {mode for _, _, mode in drawn} == {"eager", "streams"}
    elif world.size == 2:
        assert {mode for _, _, mode in drawn} == {"eager", "graph", "streams"}


def _world(size, nnodes, device="cpu"):
    return SimpleNamespace(world_size=size, nnodes=nnodes, rank=0, device=torch.device(device))


def test_plan_is_the_seed_s_and_valid_for_the_world():
    """The same calls from the same seed; across nodes no one-node method is drawn, and the draws
    refused are listed with their reason; LL only for whole 4-byte words."""
    ops = cases.select(None)
    first, again = cases.plan(3, 300, _world(4, 2), ops), cases.plan(3, 300, _world(4, 2), ops)
    assert first.calls == again.calls and first.skipped == again.skipped
    assert any("one node only" in reason for reason in first.skipped), first.skipped
    for call in first.calls:
        assert (call.method or "").split("/")[0] not in ("pull", "ll", "ce"), call.describe()  # ag_moe: comm/order
        assert call.mode != "graph", "CUDA graphs need GPUs"
    one_node = cases.plan(3, 300, _world(2, 1), cases.select("collectives")).calls
    ll = [c for c in one_node if c.method == "ll" and c.op != "gemm_ar"]
    assert ll and all(c.shape[0] * c.dtype.itemsize % 4 == 0 for c in ll)
    assert cases.select("gemm,all_reduce") == ["matmul", "ag_gemm", "gemm_rs", "gemm_ar", "grouped_gemm", "all_reduce"]
    assert cases.select("attention,stencil,moe_rs") == ["flash_decode", "jacobi", "moe_rs"]
    with pytest.raises(ValueError, match="unknown op or family 'alltoall'"):
        cases.select("alltoall")


def test_registry_keeps_the_families_order(monkeypatch):
    """A seed's plan does not depend on which family's module was imported first (a test module that
    imported tridist.stress.alltoall early changed seed 972's plan)."""
    ordered = list(cases.registry())
    early = {op: c for op, c in cases.REGISTRY.items() if type(c).__module__.endswith(".alltoall")}
    monkeypatch.setattr(cases, "REGISTRY", {**early, **cases.REGISTRY})
    assert list(cases.REGISTRY)[:len(early)] == list(early) and list(cases.registry()) == ordered


def test_plan_keeps_each_op_to_its_forms_and_modes():
    """On GPUs Jacobi2D (whose load synchronises on the host) is never captured in a graph, while
    the other ops are; a FlashDecode config with fixed splits goes to the class only."""
    calls = cases.plan(3, 600, _world(2, 1, "cuda"), cases.select(None)).calls
    assert {c.mode for c in calls if c.op == "jacobi"} == {"eager", "streams"}
    assert {c.op for c in calls if c.mode == "graph"} == set(cases.registry()) - {"jacobi"}
    split = [c for c in calls if c.op == "flash_decode" and c.config and "splits" in c.config]
    assert split and {c.form for c in split} == {"class"}
    assert {c.form for c in calls if c.op == "flash_decode"} == set(cases.FORMS)


def test_mismatch_names_the_first_wrong_element():
    reference = torch.arange(8, dtype=torch.int16)
    assert cases.mismatch(reference.clone(), cases.Expected(reference)) is None
    poisoned = torch.empty_like(reference)
    cases.poison(poisoned, cases.Expected(reference))
    assert (poisoned != reference).all()
    wrong = reference.clone()
    wrong[5] = 7
    where = cases.Expected(reference, where=lambda i: f"rank {i // 4}'s element {i % 4}")
    assert cases.mismatch(wrong, where) == \
        "element 5 (rank 1's element 1): expected 5 (0x0005), got 7 (0x0007); 1 of 8 elements differ"
    inputs = [torch.full((3,), 1.0, dtype=torch.bfloat16), torch.full((3,), 2.0, dtype=torch.bfloat16)]
    total = sum(x.double() for x in inputs)
    summed = cases.Expected(total, cases.sum_tolerance(inputs, total, torch.bfloat16))
    assert cases.mismatch(torch.tensor([3.0, 3.01, float("nan")], dtype=torch.bfloat16), summed).startswith(
        "element 2: expected 3 +- 0.023, got nan; 1 of 3 elements off")
    bounded = cases.Expected(torch.zeros(2, 2), torch.tensor([[0.5, 0.5], [0.5, 0.25]]))  # bounds of any shape
    assert cases.mismatch(torch.tensor([[0.0, 0.5], [0.0, 0.375]]), bounded) == \
        "element 3: expected 0 +- 0.25, got 0.375; 1 of 4 elements off"


def test_watchdog_fires_only_past_its_time():
    fired = []
    dog = rank.Watchdog(0.2, fired.append)
    dog.start()
    dog.watch("quick call")
    dog.done()
    dog.watch("slow call")
    time.sleep(0.5)
    dog.done()
    dog.close()
    dog.join(timeout=5)
    assert fired == ["slow call"] and not dog.is_alive()


def _planted_wrong(w, seed):
    """Each op's first call, a wrong result planted on the last rank: found there, and only there."""
    for op in cases.registry():
        report = rank.run(w, 1, seed, ops=op, plant_wrong=0)
        wrong = {entry["call"] for entry in report["wrong"]}
        assert wrong == ({0} if w.rank == w.world_size - 1 else set()), (op, report["wrong"])


@pytest.mark.worlds("2")
def test_planted_wrong_result_is_found_in_every_op(world):
    if world.backend != "emulator":
        pytest.skip("the checks are the same on GPUs, where the first calls of 14 ops would compile for minutes")
    world.run(_planted_wrong, seed=SEED)


def _replayed_call(w, seed):
    """--first-call: the plan is the seed's, the calls before the first are drawn and not made."""
    report = rank.run(w, 4, seed, ops="collectives", plant_wrong=2, first_call=2)
    assert report["calls"] == 2, report
    assert {entry["call"] for entry in report["wrong"]} == ({2} if w.rank == w.world_size - 1 else set())


@pytest.mark.worlds("2")
def test_first_call_replays_the_plan_s_calls_from_there(world):
    world.run(_replayed_call, seed=SEED)


def test_planted_wrong_and_hang_are_counted(tmp_path):
    """A wrong result planted at call 2 on rank 1 is counted and the run goes on; rank 1 then never
    joins call 6, so rank 0's bounded wait expires there (the watchdog on GPUs without
    TRIDIST_DEBUG): one hang, the job ends at once with EXIT_HANG and one summary line."""
    if backend() == "nvshmem" and gpus() < 2:
        pytest.skip("needs 2 GPUs")
    out = tmp_path / "stress.json"
    result, elapsed = tridist_cli("stress", "-n", "2", "--calls", "12", "--ops", "collectives", "--watchdog", "20",
                                  "--plant-wrong", "2", "--plant-hang", "6", "--out", str(out),
                                  env={"TRIDIST_WAIT_TIMEOUT": "3"})
    lines = result.stdout.splitlines()
    assert result.returncode == EXIT_HANG, result.stdout + result.stderr
    assert re.fullmatch(r"stress: 7 calls, 1 wrong, 1 hangs, [0-9.]+ s", lines[-1]), lines[-1]
    assert sum(line.startswith("stress:") for line in lines) == 1
    assert any(re.match(r"\[rank 1\] call 2 .*: element 0.*: expected .*, got ", line) for line in lines), result.stdout
    assert any(re.match(r"\[rank \d\] call 6 .* hung: ", line) for line in lines), result.stdout
    assert elapsed < 90, f"the job took {elapsed:.0f} s to end after a hang"
    figures = json.loads(out.read_text())
    assert (figures["calls"], figures["wrong"], figures["hangs"], figures["seed"], figures["world"]) == (7, 1, 1, 0, 2)


def test_summary_and_exit_code(tmp_path, monkeypatch, capsys):
    """The command sums up the ranks' reports: wrong calls counted once whichever ranks saw them,
    exit code 1 for wrong results, 0 for none; the JSON named as the benchmarks' results are."""
    import argparse

    from tridist import stress
    from tridist.runtime import launcher

    def fake_launch(reports):
        def launch(nproc, script, **options):
            folder = script[script.index("--reports") + 1]
            for report in reports:
                with open(f"{folder}/rank{report['rank']}.json", "w") as f:
                    json.dump({"stop": None, "skipped": {}, **report}, f)
            return 0
        return launch

    parser = argparse.ArgumentParser()
    stress.add_arguments(parser)
    args = parser.parse_args(["-n", "2", "--calls", "5", "--out", str(tmp_path)])
    wrong = {"call": 3, "line": "call 3 ...: element 0: expected 1, got 2"}
    monkeypatch.setattr(launcher, "run", fake_launch([
        {"rank": 0, "calls": 5, "wrong": [wrong], "environment": {"date": "2026-11-24"}, "loop_s": 1.0},
        {"rank": 1, "calls": 5, "wrong": [wrong]}]))
    assert stress.main(args) == stress.EXIT_WRONG
    assert re.fullmatch(r"stress: 5 calls, 1 wrong, 0 hangs, [0-9.]+ s", capsys.readouterr().out.splitlines()[-1])
    figures = json.loads((tmp_path / "stress-cpux2-2026-11-24.json").read_text())
    assert (figures["calls"], figures["wrong"], figures["hangs"], figures["world"]) == (5, 1, 0, 2)
    assert len(figures["wrong_calls"]) == 2, "each rank's line is kept"
    monkeypatch.setattr(launcher, "run", fake_launch([
        {"rank": 0, "calls": 5, "wrong": [], "environment": {"date": "2026-11-24"}},
        {"rank": 1, "calls": 5, "wrong": []}]))
    assert stress.main(args) == 0
    assert json.loads((tmp_path / "stress-cpux2-2026-11-24-2.json").read_text())["wrong"] == 0, \
        "a second run of the day keeps the first one's file"
    assert re.fullmatch(r"stress: 5 calls, 0 wrong, 0 hangs, [0-9.]+ s", capsys.readouterr().out.splitlines()[-1])
    failed = {"kind": "failed", "what": "call 2 ...", "message": "ValueError: ..."}
    monkeypatch.setattr(launcher, "run", fake_launch([
        {"rank": 0, "calls": 3, "wrong": [{"call": 2, "line": "call 2 ... failed: ValueError: ..."}], "stop": failed},
        {"rank": 1, "calls": 3, "wrong": []}]))
    assert stress.main(args) == stress.EXIT_STOPPED, "a call that raised ends the run, counted wrong"
    assert re.fullmatch(r"stress: 3 calls, 1 wrong, 0 hangs, [0-9.]+ s", capsys.readouterr().out.splitlines()[-1])
    monkeypatch.setattr(launcher, "run", fake_launch([{"rank": 1, "calls": 0, "wrong": []}]))
    assert stress.main(args) == 0
    saved = sorted(tmp_path.glob("stress-*x2-*.json"), key=lambda path: path.stat().st_mtime)[-1]
    figures = json.loads(saved.read_text())
    assert figures["date"] and figures["ranks"] == 2 and figures["torch"], \
        "rank 0 left no report: the launcher's environment names the file"
    part = parser.parse_args(["-n", "2", "--calls", "9", "--seed", "3", "--first-call", "4", "--out", str(tmp_path)])
    monkeypatch.setattr(launcher, "run", fake_launch([
        {"rank": r, "calls": 5, "wrong": [], "environment": {"date": "2026-11-24"}} for r in (0, 1)]))
    monkeypatch.setenv("TRIDIST_DEBUG", "1")
    assert stress.main(part) == 0
    figures = json.loads((tmp_path / "stress-debug-seed3-from4-cpux2-2026-11-24.json").read_text())
    assert (figures["calls"], figures["first_call"], figures["requested_calls"]) == (5, 4, 5), "a part of a plan"
    shared = parser.parse_args(["-n", "2", "--ranks-per-gpu", "2", "--calls", "5", "--out", str(tmp_path)])
    assert stress.main(shared) == 0
    figures = json.loads((tmp_path / "stress-debug-cpux2-shared2-2026-11-24.json").read_text())
    assert figures["ranks_per_gpu"] == 2, "ranks that shared a GPU are named so, as the benchmarks' results are"


def test_stopped_early_fails_unless_time_boxed(tmp_path, monkeypatch, capsys):
    """A run that --time-limit stops before its calls says so and fails, so that a run of 119 of
    10,000 calls is not taken for a pass; with --time-box (the limit is the intended end) it passes."""
    import argparse

    from tridist import stress
    from tridist.runtime import launcher

    def launch(nproc, script, **options):
        folder = script[script.index("--reports") + 1]
        stop = {"kind": "time limit", "what": "call 119", "message": "--time-limit 60 s"}
        for r in (0, 1):
            with open(f"{folder}/rank{r}.json", "w") as f:
                json.dump({"rank": r, "calls": 119, "wrong": [], "stop": stop, "skipped": {}}, f)
        return 0

    monkeypatch.setattr(launcher, "run", launch)
    parser = argparse.ArgumentParser()
    stress.add_arguments(parser)
    common = ["-n", "2", "--calls", "10000", "--time-limit", "60", "--out", str(tmp_path / "s.json")]
    assert stress.main(parser.parse_args(common)) == stress.EXIT_STOPPED_EARLY
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].startswith("stopped early: 119 of 10000 calls (--time-limit 60 s; calls from 119 on"), lines
    assert re.fullmatch(r"stress: 119 calls, 0 wrong, 0 hangs, [0-9.]+ s", lines[-1])
    assert json.loads((tmp_path / "s.json").read_text())["stopped_early"] is True
    assert stress.main(parser.parse_args(common + ["--time-box"])) == 0
    assert capsys.readouterr().out.splitlines()[-2] == "stopped early: 119 of 10000 calls (--time-limit 60 s, --time-box)"
    with pytest.raises(SystemExit, match="--time-box makes --time-limit"):
        stress.main(parser.parse_args(["-n", "2", "--time-box"]))


def test_a_rank_stuck_joining_the_world_is_a_hang(tmp_path):
    """The watchdog covers `tridist.init()` too: a rank that never gets through it (a peer that never
    came) ends with EXIT_HANG and a report that says where, rather than waiting for ever."""
    import subprocess
    import sys

    script = ("import time, tridist, tridist.stress.rank as rank; tridist.init = lambda: time.sleep(60); "
              f"rank.main(['--reports', {str(tmp_path)!r}, '--calls', '1', '--watchdog', '0.5'])")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "RANK": "1"})
    assert done.returncode == EXIT_HANG, done.stderr
    assert "tridist.init() hung: still running after 0.5 s" in done.stdout
    report = json.loads((tmp_path / "rank1.json").read_text())
    assert report["stop"]["kind"] == "hang" and report["stop"]["what"] == "tridist.init()"
