"""`tridist stress`: a seeded random sequence of calls of every op, every result checked, no quiet hangs.

    tridist stress -n N [--nnodes K] [--ranks-per-gpu K] [--calls C] [--seed S] [--first-call I]
                   [--watchdog SECONDS] [--ops LIST] [--time-limit SECONDS [--time-box]] [--out PATH]

starts N ranks (as `tridist run` does) that make the same C calls, drawn from the seed by every rank
alone: every op of `tridist.ops`, with every method (all_gather, reduce_scatter, all_reduce with
each of their methods and `auto`; ag_gemm, gemm_rs, gemm_ar, matmul and grouped_gemm; all_to_all_v
in its three layouts, EPBuffer's dispatch + combine in both modes, ag_moe and moe_rs; flash_decode
over contiguous and paged caches; Jacobi2D's runs, host-loop and fused), through the functions and
through the classes, sizes from one element to several MB per rank (a few KB in the emulator),
every dtype each op takes, in and out of place, into symmetric buffers and regular ones, eager,
captured in a CUDA graph and replayed with new inputs (GPUs; not Jacobi2D, whose load synchronises
on the host), two instances on two streams (ordered only by `ops.call_order`), and calls back to back with no host
synchronisation. `cases.py` says how calls are drawn and checked, and where a new op family adds
its cases; `rank.py` how they run.

Every rank checks its own result of every call against a reference it builds from the seed:
exact for data movement and the Jacobi solver, within a stated bound for sums, products and
attention (`cases.sum_tolerance`, `cases.gemm_tolerance` and those of the families' modules),
outputs poisoned before the call. The output ends with one line,

    stress: C calls, W wrong, H hangs, T s

(C calls run, W of them wrong on some rank, H = 1 if the run ended in a hang, T wall seconds of the
whole job, start-up and kernel compilation included), and the command exits non-zero unless W and
H are 0. Before it, each rank prints a line per wrong call (`[rank R] call I <op, method, dtype,
size, form, mode>: <which of its calls>: element E (...): expected X, got Y; K of M elements differ`),
and rank 0 prints the plan (calls per op, and the draws this world cannot run, listed with their
reasons). Wrong results are counted and the run goes on; a hang or a failed call ends it, since
a collective cannot go on once a rank is out. A hang is a bounded wait that expired (always in
the emulator, TRIDIST_WAIT_TIMEOUT; on GPUs with TRIDIST_DEBUG=1, where the wait traps) or a call
still running after --watchdog seconds (default 120): that rank prints which call hung and exits,
and the launcher stops the others.

--first-call I makes only calls I, I + 1, ... of the same plan (the calls before it are drawn, not
made): `--seed S --first-call I --calls I+1` replays call I alone, on a fresh job. --ops takes op
names and families (`collectives`, `gemm`, `moe`, `attention`, `stencil`: the modules of
`tridist.ops`), comma-separated; --time-limit stops starting new calls after that many seconds
(kernels compile on first use: a first run on a GPU spends most of its time compiling): a run it
stops prints `stopped early: C of N calls` before the summary and fails (EXIT_STOPPED_EARLY), unless
--time-box says the time limit is the run's intended end; --out
writes the figures as JSON (into a folder, named `stress-<device>x<ranks>-<date>.json` as the
benchmarks' results are, `stress-debug-...` with TRIDIST_DEBUG, `-seed<S>` for a seed other than 0,
`-from<I>` for a run from call I, and `-<repeat>` after the date where the name is taken: runs on
one day, a GPU pair each, keep a file each). Exit codes: 0 right, 1
wrong results, 3 a hang, 4 a call failed, 5 stopped early by --time-limit (without --time-box).
"""
import argparse
import json
import os
import shutil
import tempfile
import time

EXIT_WRONG = 1
EXIT_HANG = 3
EXIT_STOPPED = 4  # a call raised on some rank (it is counted wrong too)
EXIT_STOPPED_EARLY = 5  # --time-limit ended the run before its calls, and --time-box was not given


def description() -> str:
    """`tridist stress --help`'s text: this docstring but its title and usage (argparse prints its own)."""
    return __doc__.split("\n\n", 2)[2]


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every rank reads (`rank.main`)."""
    parser.add_argument("--calls", type=int, default=1000, help="calls to make (default 1000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the call sequence and the inputs (default 0)")
    parser.add_argument("--first-call", type=int, default=0,
                        help="make calls from this index of the plan on (default 0): to replay a call alone")
    parser.add_argument("--ops", default=None,
                        help="comma-separated ops or families to call (default all): e.g. all_reduce,gemm")
    parser.add_argument("--watchdog", type=float, default=120.0,
                        help="seconds a call may run before it counts as a hang and ends the job (default 120)")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="start no new call after this many seconds; the summary counts the calls made, and "
                             "a run stopped so fails unless --time-box is given")
    # For the tests: a wrong result, and a hang, planted at call I on the last rank.
    parser.add_argument("--plant-wrong", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--plant-hang", type=int, default=None, help=argparse.SUPPRESS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`tridist stress`'s options."""
    parser.add_argument("-n", "--nproc", type=int, required=True, help="number of ranks")
    parser.add_argument("--nnodes", type=int, default=None, help="split the ranks into this many virtual nodes")
    parser.add_argument("--backend", choices=["nvshmem", "emulator"], default=None,
                        help="default: nvshmem where CUDA GPUs are present, emulator elsewhere")
    parser.add_argument("--ranks-per-gpu", type=int, default=None, help="ranks sharing each GPU (see tridist run)")
    parser.add_argument("--start-mps", action="store_true",
                        help="start a CUDA MPS daemon for the job (see tridist run)")
    parser.add_argument("--out", default=None,
                        help="write the figures as JSON: a .json file, or a folder (e.g. benchmarks/results)")
    parser.add_argument("--time-box", action="store_true",
                        help="--time-limit is the run's intended end: stopping there before all calls is not a "
                             "failure")
    add_run_arguments(parser)


def main(args: argparse.Namespace) -> int:
    """Launch the ranks, then sum up their reports: print the summary line, write --out, exit."""
    if args.calls < 0 or args.watchdog <= 0 or not 0 <= args.first_call <= args.calls:
        raise SystemExit("tridist stress: --calls must be 0 or more, --first-call from 0 to --calls, and --watchdog "
                         "above 0 seconds")
    if args.time_box and args.time_limit is None:
        raise SystemExit("tridist stress: --time-box makes --time-limit the run's intended end: give --time-limit too")
    from ..runtime.launcher import run as launch

    folder = tempfile.mkdtemp(prefix="tridist-stress-")
    forwarded = ["--calls", str(args.calls), "--seed", str(args.seed), "--first-call", str(args.first_call),
                 "--watchdog", str(args.watchdog)]
    for option, value in (("--ops", args.ops), ("--time-limit", args.time_limit), ("--plant-wrong", args.plant_wrong),
                          ("--plant-hang", args.plant_hang)):
        if value is not None:
            forwarded += [option, str(value)]
    sharing = {"ranks_per_gpu": args.ranks_per_gpu} if args.ranks_per_gpu else {}
    if args.start_mps:
        sharing["start_mps"] = True
    started = time.monotonic()
    try:
        code = launch(args.nproc, ["-m", "tridist.stress.rank", "--reports", folder, *forwarded], nnodes=args.nnodes,
                      backend=args.backend, **sharing)
        wall = time.monotonic() - started
        reports = _read_reports(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    figures = summarise(reports, code)
    figures.update(wall_s=round(wall, 1), seed=args.seed, world=args.nproc, nnodes=args.nnodes or 1,
                   ranks_per_gpu=args.ranks_per_gpu, requested_calls=args.calls - args.first_call,
                   first_call=args.first_call, ops=args.ops or "all", watchdog_s=args.watchdog,
                   debug=os.environ.get("TRIDIST_DEBUG", "0") not in ("", "0"), time_limit_s=args.time_limit,
                   time_box=args.time_box, exit_code=code)
    requested = figures["requested_calls"]
    stopped_early = any(stop["kind"] == "time limit" for stop in figures["stops"]) and figures["calls"] < requested
    figures["stopped_early"] = stopped_early
    if code and not (figures["wrong"] or figures["hangs"]):
        print(f"tridist stress: the job ended with code {code}, and no rank said why (see above)", flush=True)
    if args.out:
        print(f"tridist stress: wrote {_save(args.out, figures)}", flush=True)
    if stopped_early:
        print(f"stopped early: {figures['calls']} of {requested} calls (--time-limit {args.time_limit:g} s"
              + (", --time-box)" if args.time_box else f"; calls from {args.first_call + figures['calls']} on were "
                 "not made: continue with --first-call there, or give --time-box if the limit is the intended end)"),
              flush=True)
    if figures["seconds_by_op"]:
        print("rank 0's seconds by op: " + ", ".join(f"{op} {v['s']:g} s ({v['calls']} calls)"
                                                     for op, v in figures["seconds_by_op"].items()), flush=True)
    print(f"stress: {figures['calls']} calls, {figures['wrong']} wrong, {figures['hangs']} hangs, {wall:.1f} s",
          flush=True)
    if figures["hangs"]:
        return EXIT_HANG
    if any(stop["kind"] == "failed" for stop in figures["stops"]):
        return EXIT_STOPPED
    if figures["wrong"]:
        return EXIT_WRONG
    if stopped_early and not args.time_box:
        return EXIT_STOPPED_EARLY
    return code


def _read_reports(folder: str) -> list[dict]:
    reports = []
    for name in sorted(os.listdir(folder)):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                reports.append(json.load(f))
    return sorted(reports, key=lambda r: r["rank"])


def summarise(reports: list[dict], code: int) -> dict:
    """The job's figures from the ranks' reports (a rank stopped by the launcher may have left none):
    calls run (the most any rank started), wrong calls (on any rank), hangs (1 if the run ended in one)."""
    stops = [r["stop"] for r in reports if r.get("stop")]
    hang = any(s["kind"] == "hang" for s in stops) or code == EXIT_HANG
    first = next((r for r in reports if r["rank"] == 0), {})
    return {"calls": max((r["calls"] for r in reports), default=0),
            "wrong": len({entry["call"] for r in reports for entry in r["wrong"]}),
            "hangs": int(hang),
            "loop_s": round(first.get("loop_s", 0.0), 1),
            "wrong_calls": [f"rank {r['rank']}: {entry['line']}" for r in reports for entry in r["wrong"]],
            "stops": [{"rank": r["rank"], **r["stop"]} for r in reports if r.get("stop")],
            "skipped": first.get("skipped", {}),
            "seconds_by_op": {op: {"calls": calls, "s": round(seconds, 1)}
                              for op, (calls, seconds) in sorted(first.get("seconds_by_op", {}).items(),
                                                                 key=lambda item: -item[1][1])},
            "environment": first.get("environment", {})}


def _save(out: str, figures: dict) -> str:
    from ..bench.results import environment as launcher_environment, write_new
    from ..runtime import config, sharing

    # Rank 0's, or where it left no report (stopped before its first call), the launcher's: the same host.
    environment = figures.pop("environment") or {**launcher_environment(), "ranks": figures["world"]}
    payload = {"benchmark": "stress", **environment, **figures}
    if out.endswith(".json"):
        with open(out, "w") as f:
            json.dump(payload, f, indent=1)
        return out
    # Runs of several seeds, of parts of one plan, or with and without TRIDIST_DEBUG on one day keep
    # a file each.
    name = "stress" + ("-debug" if figures["debug"] else "")
    if figures["seed"]:
        name += f"-seed{figures['seed']}"
    if figures["first_call"]:
        name += f"-from{figures['first_call']}"
    # The launcher's own environment does not say how many ranks shared a GPU (its ranks' does).
    shared = sharing.ranks_on_a_gpu(figures["world"], figures["ranks_per_gpu"] or config.ranks_per_gpu())
    return write_new(out, name, environment, payload, ranks=figures["world"], ranks_per_gpu=shared)

