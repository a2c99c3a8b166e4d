"""What every rank of `tridist stress` runs: the plan's calls, each checked, under a watchdog.

`python -m tridist.stress.rank` is started by `tridist stress` (see the package docstring), one
process per rank; `run(world, ...)` is the same loop for a world that is already up (the tests').

A call (`cases.Call`) runs in one of three modes. "eager": `repeats` calls back to back on the
current stream, each into its own buffers, then every result is checked. "streams": the same on
each of two side streams at once, with an instance per stream (the class form builds two; the
functions keep one per stream). "graph": one eager call on a side stream, checked; the call
captured in a CUDA graph on that stream; then `repeats` replays, each after new inputs were copied
into the captured buffers, each checked. Class-form instances and the call's symmetric buffers are
freed once every rank is past the call; the instances the functions keep are freed when they
hold more than a quarter of the symmetric heap, or every EVICT_EVERY calls of the function form.

Outcomes. A wrong result is printed (`[rank R] call I ...: first mismatch`, the prefix from `tridist run`) and counted, and the
run goes on. A hang ends the run: a bounded wait that expired (`WaitTimeoutError`: always in the
emulator; on GPUs with TRIDIST_DEBUG=1 the wait traps and the call fails with a CUDA error), or a
call (or `tridist.init()`) still running after --watchdog seconds (`Watchdog`, a thread: it prints
which call hung on this rank and ends the process with EXIT_HANG, so that the launcher stops the
job). A call that raises anything else is counted wrong and ends the run too (a collective cannot
go on once a rank is out). Each rank writes its report (JSON) into --reports for `tridist stress` to sum up.
"""
import argparse
import contextlib
import json
import os
import sys
import threading
import time
import warnings

import torch

import tridist
from tridist.ops import instances
from tridist.runtime import config
from tridist.runtime.world import heap, transport

from . import EXIT_HANG, EXIT_STOPPED, cases

EVICT_EVERY = 64  # function-form calls between two evictions of the instances the functions keep


class Watchdog(threading.Thread):
    """A daemon thread that calls `on_hang(what)` if what it watches (`watch(what)`, a description)
    is not `done()` within `seconds`."""

    def __init__(self, seconds: float, on_hang):
        super().__init__(daemon=True, name="tridist-stress-watchdog")
        self.seconds, self.on_hang = seconds, on_hang
        self._what, self._deadline, self._closed = None, None, False
        self._changed = threading.Condition()

    def watch(self, what: str) -> None:
        with self._changed:
            self._what, self._deadline = what, time.monotonic() + self.seconds
            self._changed.notify()

    def done(self) -> None:
        with self._changed:
            self._what, self._deadline = None, None

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify()

    def run(self) -> None:
        with self._changed:
            while not self._closed:
                left = None if self._deadline is None else self._deadline - time.monotonic()
                if left is None or left > 0:
                    self._changed.wait(left)
                    continue
                self.on_hang(self._what)
                self._deadline = None


class Stop(Exception):
    """Ends the run on this rank: `kind` "hang", "failed" or "peer" (a peer left), and what happened."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class Runner:
    """Runs calls on this rank; counts and prints wrong results."""

    def __init__(self, world, seed: int, plant_wrong: int | None = None, plant_hang: int | None = None,
                 on_wrong=None):
        """`on_wrong()`: called after each wrong call is counted (to save the report at once, since
        the launcher may stop this rank at any time once a peer hangs)."""
        self.world, self.seed, self.on_wrong = world, seed, on_wrong
        self.plant_wrong, self.plant_hang = plant_wrong, plant_hang
        gpu = world.device.type == "cuda"
        self.sides = [torch.cuda.Stream(world.device) for _ in range(2)] if gpu else [None, None]
        self.wrong: list[dict] = []
        self.function_calls = 0

    def say(self, text: str) -> None:
        print(text, flush=True)  # `tridist run` prefixes each line with the rank

    def run(self, call: cases.Call) -> None:
        """Run and check one call; raises `Stop` where the run cannot go on."""
        if call.index == self.plant_hang and self.world.rank == self.world.world_size - 1:
            while True:  # tests: this rank never joins the call, as a rank stuck before it would
                time.sleep(1)
        op_cases = cases.registry()[call.op]
        try:
            run = self._graph if call.mode == "graph" else self._eager
            problems = run(call, op_cases)
        except tridist.WaitTimeoutError as error:
            raise Stop("hang", str(error)) from error
        except tridist.PeerFailedError as error:
            raise Stop("peer", str(error)) from error
        except Exception as error:  # noqa: BLE001 - any failure is reported with the call
            if config.debug() and _cuda_failure(error):
                raise Stop("hang", f"{type(error).__name__}: {error} (with TRIDIST_DEBUG=1 an expired wait traps: "
                                   "its rank, signal and values are printed above)") from error
            raise Stop("failed", f"{type(error).__name__}: {error}") from error
        for problem in problems:
            line = f"call {call.index} {call.describe()}: {problem}"
            self.say(line)
            self.wrong.append({"call": call.index, "line": line})
        if problems and self.on_wrong:
            self.on_wrong()

    def _eager(self, call, op_cases) -> list[str]:
        lanes = self.sides if call.mode == "streams" else [None]
        trials = [[op_cases.trial(call, self.world) for _ in range(call.repeats)] for _ in lanes]
        built = [row[0].build() if call.form == "class" else None for row in trials]
        expected = [[trial.fill(cases.seed_of(self.seed, call.index, lane, repeat))
                     for repeat, trial in enumerate(row)] for lane, row in enumerate(trials)]
        outputs = []
        for lane, stream in enumerate(lanes):
            with _on(stream):
                outputs.append([trial.call(built[lane]) for trial in trials[lane]])
        for stream in lanes:
            _join(stream)
        problems = []
        for lane, row in enumerate(outputs):
            for repeat, out in enumerate(row):
                where = f"stream {lane + 1}, " * (len(lanes) > 1) + f"call {repeat + 1} of {call.repeats}"
                problems += self._check(call, out, expected[lane][repeat], where)
        self._release(call, built, [t for row in trials for t in row])
        return problems

    def _graph(self, call, op_cases) -> list[str]:
        trial = op_cases.trial(call, self.world)
        instance = trial.build() if call.form == "class" else None
        stream = self.sides[0]
        expected = trial.fill(cases.seed_of(self.seed, call.index, 0, 0))
        with _on(stream):  # eager first: kernels compile, and the functions build their instance for this stream
            out = trial.call(instance)
        _join(stream)
        problems = self._check(call, out, expected, "eager, before capture")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = trial.call(instance)
        for replay in range(1, call.repeats + 1):
            expected = trial.fill(cases.seed_of(self.seed, call.index, 0, replay))
            graph.replay()
            problems += self._check(call, out, expected, f"graph replay {replay} of {call.repeats}")
        del graph
        self._release(call, [instance], [trial])
        return problems

    def _check(self, call, out, expected, where: str) -> list[str]:
        if call.index == self.plant_wrong and self.world.rank == self.world.world_size - 1:
            # tests: a flipped exponent (or high) bit of the first element's last byte
            out.reshape(-1)[:1].view(torch.uint8)[-1:].bitwise_xor_(0x40)
        problem = cases.mismatch(out, expected)
        return [f"{where}: {problem}"] if problem else []

    def _release(self, call, built, trials) -> None:
        """Free what this call built, once every rank is past it (a peer may still read this
        rank's staging, e.g. the "pull" all-gather)."""
        tridist.barrier_all()
        for instance in built:
            if instance is not None:
                instance.free()
        for trial in trials:
            trial.free()
        if call.form == "function":
            self.function_calls += 1
            if self.function_calls % EVICT_EVERY == 0 or heap().used > heap().nbytes // 4:
                instances.free_instances()

    def finish(self) -> None:
        tridist.barrier_all()
        instances.free_instances()


@contextlib.contextmanager
def _on(stream):
    """Queue work on `stream` (a side stream, after what the current stream queued), or on the current one for None."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        yield


def _join(stream) -> None:
    if stream is not None:
        torch.cuda.current_stream().wait_stream(stream)


def _cuda_failure(error: BaseException) -> bool:
    """A kernel that failed on the GPU (with TRIDIST_DEBUG=1, what an expired wait's trap gives)."""
    while error is not None:
        if isinstance(error, getattr(torch, "AcceleratorError", ())) or "CUDA error" in str(error):
            return True
        error = error.__cause__
    return False


def run(world, calls: int, seed: int, ops: str | None = None, watchdog: float = 120.0, time_limit: float | None = None,
        reports: str | None = None, plant_wrong: int | None = None, plant_hang: int | None = None,
        first_call: int = 0) -> dict:
    """Run calls `first_call` to `calls` - 1 of the plan for `seed` on this rank (the calls before
    `first_call` are drawn, not made: to replay one) and return its report. Where a hang or
    a failure stops the run, writes the report into `reports` and ends the process (EXIT_HANG,
    EXIT_STOPPED); without `reports` (a world of the tests) it raises instead, but for the watchdog."""
    plan = cases.plan(seed, calls, world, cases.select(ops))
    if world.rank == 0:
        _print_plan(plan, seed, world)
    # Seconds per op (first calls compile their kernels): where a long run's time goes, for sizing the next.
    report = {"rank": world.rank, "calls": 0, "wrong": [], "stop": None, "skipped": plan.skipped, "seconds_by_op": {}}
    runner = Runner(world, seed, plant_wrong, plant_hang, on_wrong=lambda: _write(reports, world.rank, report))
    report["wrong"] = runner.wrong
    if world.rank == 0:
        from tridist.bench.results import environment

        report["environment"] = environment()
    started = time.monotonic()
    _write(reports, world.rank, report)

    def stop(kind: str, what: str, message: str, calls_run: int, from_watchdog: bool = False) -> None:
        """End the run on this rank: `kind` "hang", "failed" or "peer" (a peer left, which reports why)."""
        report.update(calls=calls_run, stop={"kind": kind, "what": what, "message": message},
                      loop_s=time.monotonic() - started)
        line = f"{what} {'hung' if kind == 'hang' else 'failed'}: {message}"
        if kind == "failed":
            runner.wrong.append({"call": first_call + calls_run - 1, "line": line})
        if kind != "peer":
            runner.say(line)
        _write(reports, world.rank, report)
        if reports is None and not from_watchdog:
            raise RuntimeError(f"rank {world.rank}: {line}")
        sys.stdout.flush()
        os._exit(EXIT_HANG if kind == "hang" else EXIT_STOPPED)

    dog = Watchdog(watchdog, lambda what: stop("hang", what, f"still running after {watchdog:g} s (--watchdog)",
                                               report["calls"], from_watchdog=True))
    dog.start()
    try:
        for call in plan.calls[first_call:]:
            if time_limit is not None and _any_rank(time.monotonic() - started > time_limit):
                report["stop"] = {"kind": "time limit", "what": f"call {call.index}",
                                  "message": f"--time-limit {time_limit:g} s"}
                break
            what = f"call {call.index} {call.describe()}"
            report["calls"] = call.index + 1 - first_call  # calls started
            dog.watch(what)
            call_started = time.monotonic()
            try:
                runner.run(call)
            except Stop as error:
                stop(error.kind, what, str(error), report["calls"])
            dog.done()
            calls_and_seconds = report["seconds_by_op"].setdefault(call.op, [0, 0.0])
            calls_and_seconds[0] += 1
            calls_and_seconds[1] += time.monotonic() - call_started
            # After every call: a job stopped from outside (a timeout's SIGTERM) still reports how far
            # each rank got, and rank 0's environment names the file.
            report["loop_s"] = time.monotonic() - started
            _write(reports, world.rank, report)
        dog.watch("the end of the run (a barrier, then freeing the instances the functions keep)")
        runner.finish()
    finally:
        dog.close()
    report["loop_s"] = time.monotonic() - started
    _write(reports, world.rank, report)
    return report


def _any_rank(flag: bool) -> bool:
    """Whether `flag` holds on some rank, on every rank: ranks that each read their own clock could
    part at the time limit, one starting a call that its peers never join."""
    return any(value for (value,) in transport().allgather_ints((int(flag),)))


def _print_plan(plan, seed: int, world) -> None:
    counts = {}
    for call in plan.calls:
        counts[call.op] = counts.get(call.op, 0) + 1
    print(f"plan: seed {seed}, {len(plan.calls)} calls at {world.world_size} ranks ({world.nnodes} node(s), "
          f"{world.backend}): " + ", ".join(f"{op} {n}" for op, n in counts.items()), flush=True)
    if plan.skipped:
        print("plan: drawn again, invalid in this world: " +
              "; ".join(f"{reason} ({n})" for reason, n in sorted(plan.skipped.items())), flush=True)


def _write(folder: str | None, rank: int, report: dict) -> None:
    if folder is None:
        return
    path = os.path.join(folder, f"rank{rank}.json")
    with open(path + ".part", "w") as f:
        json.dump(report, f)
    os.replace(path + ".part", path)


def main(argv=None) -> int:
    # The emulator computes masked-off lanes too (e.g. the rows of a GEMM tile past a shard, read
    # from staging that holds old data): numpy's warnings about their values say nothing of the results.
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
    parser = argparse.ArgumentParser(prog="python -m tridist.stress.rank",
                                     description="one rank of `tridist stress` (start it with that command)")
    from . import add_run_arguments

    add_run_arguments(parser)
    parser.add_argument("--reports", required=True, help="folder where each rank writes its report")
    args = parser.parse_args(argv)
    # Joining the world is bounded too: a rank stuck there (a peer that never came) is a hang like any.
    dog = Watchdog(args.watchdog, lambda what: _start_hung(args.reports, what, args.watchdog))
    dog.start()
    dog.watch("tridist.init()")
    world = tridist.init()
    dog.close()
    run(world, args.calls, args.seed, args.ops, args.watchdog, args.time_limit, args.reports, args.plant_wrong,
        args.plant_hang, args.first_call)
    return 0


def _start_hung(reports: str, what: str, seconds: float) -> None:
    """A rank that did not get through `what` within the watchdog's seconds: its report says so, and
    the process ends with EXIT_HANG, so that the launcher stops the job."""
    rank = int(os.environ.get("RANK", 0))
    message = f"still running after {seconds:g} s (--watchdog)"
    print(f"{what} hung: {message}", flush=True)
    _write(reports, rank, {"rank": rank, "calls": 0, "wrong": [], "skipped": {}, "seconds_by_op": {},
                           "stop": {"kind": "hang", "what": what, "message": message}})
    os._exit(EXIT_HANG)


if __name__ == "__main__":
    sys.exit(main())
