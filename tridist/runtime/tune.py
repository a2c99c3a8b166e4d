"""`tridist.tune`: choose the fastest of several configurations of a distributed kernel.

A distributed kernel finishes when its slowest rank does, so a configuration scores its slowest
rank's median time. Every rank picks from the same gathered numbers and so picks the same winner,
with no broadcast: ranks that chose differently would launch different kernels and wait on each
other forever.

A configuration that raises while it is built or warmed up is skipped on every rank. That works
only if it raises on every rank, or at least before it waits on a peer: a rank whose peer gave up
mid-launch would wait on it. We rely on compilation and resource errors being the same everywhere,
since every rank launches the same code on the same kind of device.

Choices are cached per host in `tune.json` (folder TRIDIST_TUNE_CACHE, default ~/.cache/tridist),
keyed by what a timing depends on: name, key, configurations, the layout of the ranks that run it
(the world's, or a process group's), backend and device.
"""
import datetime
import hashlib
import json
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence

import torch

from . import groups
from .config import tune_cache_folder, tune_verbose
from .errors import PeerFailedError, TridistError
from .log import logger
from .world import transport, world

_FILE = "tune.json"
HEAD_START_CYCLES = 1_000_000  # about 0.5 ms of GPU clock: more than a host takes to queue a call


def tune(name: str, key, configs: Sequence[dict], make_run: Callable[[dict], Callable[[], object]], *,
         warmup: int = 2, repetitions: int = 5, use_cache: bool = True, verbose: bool | None = None,
         group=None) -> dict:
    """The config (a copy) whose `make_run(config)()` is fastest on the slowest rank.

    A distributed kernel finishes when its slowest rank does, so each config scores its slowest
    rank's median time; every rank picks from the same gathered times, so all pick the same
    config.

    ```python
    config = tridist.tune("my_allgather", (n, dtype), [{"BLOCK": 256}, {"BLOCK": 1024}],
                          lambda config: lambda: my_allgather(x, **config))
    ```

    Each config is built and warmed up (`warmup` calls), then timed: this rank's median of
    `repetitions` calls, with CUDA events on GPUs, queued behind a busy-wait of the GPU so that
    the host's launches are not what gets timed. A config that raises while it is built or warmed
    up is skipped on every rank.

    With `group`, only its members take part (each group of an op tunes on its own, while the
    other ranks do something else), and its slowest member scores.

    Choices are cached in `tune.json` in TRIDIST_TUNE_CACHE (default `~/.cache/tridist`), keyed by
    name, key, configs, the size and nodes of the world (or of `group`), backend and device; a
    cached choice is used only when every rank finds the same one, otherwise all tune again.

    Args:
        name: what is tuned (the cache's first key).
        key: what the choice depends on (shapes, dtypes): any value with a stable repr.
        configs: the candidates, dicts.
        make_run: `make_run(config)` returns the callable to time, itself usually a collective.
        warmup: untimed calls per config (at least 0).
        repetitions: timed calls per config (at least 1).
        use_cache: False neither reads nor writes the cache.
        verbose: log each config's time on rank 0 (of `group`), through the `tridist` logger
            (default: TRIDIST_TUNE_VERBOSE=1).
        group: a `torch.distributed` process group, a `tridist.Group`, or None for the world:
            the ranks that run `make_run`'s callable together.

    Returns:
        A copy of the chosen config.

    Raises:
        ValueError: ranks passed different `name`, `key` or `configs` (raised on every rank), no
            configs, bad `warmup`/`repetitions`, or this rank is not a member of `group`.
        TypeError: configs that are not dicts.
        TridistError: every config failed (each one's error is listed).
    """
    if warmup < 0 or repetitions < 1:
        raise ValueError(f"tridist.tune needs warmup >= 0 and repetitions >= 1, got {warmup} and {repetitions}")
    configs = list(configs)
    configs_text = [_canonical(c) for c in configs]
    g = groups.resolve(group)
    _check_same_arguments(name, key, configs, "\n".join([name, repr(key), *configs_text]), g)
    if not configs:
        raise ValueError(f"tridist.tune({name!r}) got no configs to choose from")
    if not all(isinstance(c, dict) for c in configs):
        raise TypeError(f"tridist.tune({name!r}) takes configs as dicts, got {[type(c).__name__ for c in configs]}")
    if len(configs) == 1:
        return dict(configs[0])
    if verbose is None:
        verbose = tune_verbose()
    w = world()
    path = os.path.join(tune_cache_folder(), _FILE)
    cache_key = _cache_key(name, key, configs_text, w, g)
    first = (w.rank if g is None else g.rank) == 0  # the rank that logs

    mine = _cached_index(path, cache_key, configs_text) if use_cache else -1
    indices = {i for (i,) in transport().allgather_ints((mine,), g)}
    if len(indices) == 1 and mine >= 0:
        if verbose and first:
            logger.info(f"tune {name} {key!r}: {configs[mine]} (cached in {path})")
        return dict(configs[mine])

    results = [_measure(config, make_run, warmup, repetitions, w.device, g) for config in configs]
    timed = [i for i, (ranks_ns, _, _) in enumerate(results) if ranks_ns is not None]
    if not timed:
        first_error = next((error for _, _, error in results if error is not None), None)
        raise TridistError(f"tridist.tune({name!r}, {key!r}): every config failed:\n" + "\n".join(
            f"  {config}: {_describe_failure(failed, error)}" for config, (_, failed, error) in zip(configs, results)
        )) from first_error
    best = min(timed, key=lambda i: max(results[i][0]))  # the first of equals; the same numbers on every rank
    if verbose and first:
        for i, (config, (ranks_ns, failed, error)) in enumerate(zip(configs, results)):
            outcome = f"{max(ranks_ns) / 1e3:10.1f} us" if ranks_ns else f"skipped, {_describe_failure(failed, error)}"
            logger.info(f"tune {name} {key!r}: {config} {outcome}{'  <- chosen' if i == best else ''}")
    # One rank of each node writes, as hosts need not share the folder. Virtual nodes (TRIDIST_NNODES)
    # make that several writers on one host, of the same entry to the same file: _write_cache allows it.
    if use_cache and (w.local_rank if g is None else g.local_rank) == 0:
        _write_cache(path, cache_key, {
            "config": json.loads(configs_text[best]),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "times": [{"config": json.loads(text), "slowest_ns": max(ranks_ns) if ranks_ns else None,
                       "ranks_ns": ranks_ns, "failed_on_ranks": failed}
                      for text, (ranks_ns, failed, _) in zip(configs_text, results)],
        })
    return dict(configs[best])


def _canonical(value) -> str:
    # Sorted keys so that dict order does not matter; repr for what JSON cannot hold (dtypes).
    return json.dumps(value, sort_keys=True, default=repr)


def _check_same_arguments(name: str, key, configs: list, text: str, group) -> None:
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big", signed=True)
    everyone = [h for (h,) in transport().allgather_ints((digest,), group)]
    if len(set(everyone)) == 1:
        return
    agreeing = {}
    for index, h in enumerate(everyone):
        agreeing.setdefault(h, []).append(_world_rank(index, group))
    listed = " / ".join(("ranks " if len(g) > 1 else "rank ") + ", ".join(map(str, g)) for g in agreeing.values())
    raise ValueError(
        f"tridist.tune: ranks passed different name, key or configs (ranks that agree: {listed}); rank "
        f"{world().rank} passed name={name!r}, key={key!r}, {len(configs)} configs {configs}. Every rank must "
        "pass the same, or they would time different kernels and wait on each other"
    )


def _world_rank(index: int, group) -> int:
    """The world rank of the `index`-th of those gathered (of `group`'s members, or of the world)."""
    return index if group is None else group.ranks[index]


def _cache_key(name: str, key, configs_text: list, w, group) -> str:
    device = torch.cuda.get_device_name(w.device) if w.device.type == "cuda" else "cpu"
    configs_digest = hashlib.sha256("\n".join(configs_text).encode()).hexdigest()[:12]
    # A group's timing depends on its size and nodes as the world's does on the world's.
    layout = (f"world_size={w.world_size} nnodes={w.nnodes}" if group is None else
              f"group_size={group.size} nnodes={group.nnodes}")
    return f"{name} {key!r} {layout} backend={w.backend} device={device} configs={configs_digest}"


def _read_cache(path: str) -> dict:
    """Everything in the cache file; a missing or damaged file reads as empty (and is rewritten)."""
    try:
        with open(path) as f:
            entries = json.load(f)
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def _cached_index(path: str, cache_key: str, configs_text: list) -> int:
    entry = _read_cache(path).get(cache_key)
    if not isinstance(entry, dict) or "config" not in entry:
        return -1
    cached = _canonical(entry["config"])
    return configs_text.index(cached) if cached in configs_text else -1


def _write_cache(path: str, cache_key: str, entry: dict) -> None:
    # Read, merge and replace atomically: readers never see half a file, and concurrent writers (the
    # virtual nodes of one host, hosts sharing a folder) each write a temp file of their own. The
    # last replace wins: a racing writer's different new entry can be dropped, which costs a
    # re-tune, never a wrong choice; the virtual nodes of one job write the same entry anyway.
    folder = os.path.dirname(path)
    temp = None
    try:
        os.makedirs(folder, exist_ok=True)
        entries = _read_cache(path)
        entries[cache_key] = entry
        with tempfile.NamedTemporaryFile("w", dir=folder, prefix="tune.", suffix=".tmp", delete=False) as f:
            temp = f.name
            json.dump(entries, f, indent=1, sort_keys=True)
        os.replace(temp, path)
    except OSError as error:
        if temp and os.path.exists(temp):
            os.unlink(temp)
        warnings.warn(f"tridist.tune could not write its cache {path}: {error}; the choice is not cached", stacklevel=3)


def _measure(config: dict, make_run, warmup: int, repetitions: int, device: torch.device, group):
    """(every rank's median ns, None, None), or (None, ranks that failed, this rank's error or None):
    among `group`'s members (None: the world), the failed ones named by world rank."""
    error = None
    try:
        run = make_run(config)
        for _ in range(warmup):
            run()
        _synchronize(device)
    except PeerFailedError:
        raise  # a dead peer is not this config's fault, and the next collective would fail anyway
    except Exception as caught:  # noqa: BLE001 - skipped on every rank, reported if all configs fail
        error = caught
    failed = [_world_rank(index, group)
              for index, (flag,) in enumerate(transport().allgather_ints((int(error is not None),), group)) if flag]
    if failed:
        return None, failed, error
    transport().barrier(group)  # every rank starts timing together
    if device.type == "cuda":
        # The GPU waits while the host queues every repetition, so that what is timed is the GPU's
        # work and not the host's launches (without it, the host's pace was timed: benchmarks/NOTES.md,
        # "Moved from the code's docstrings (issue 41)").
        torch.cuda._sleep(HEAD_START_CYCLES * repetitions)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(repetitions)]
        for start, end in events:
            start.record()
            run()
            end.record()
        _synchronize(device)
        samples = [round(start.elapsed_time(end) * 1e6) for start, end in events]
    else:
        samples = []
        for _ in range(repetitions):
            begin = time.perf_counter_ns()
            run()
            samples.append(time.perf_counter_ns() - begin)
    median = int(statistics.median(samples))
    return [ns for (ns,) in transport().allgather_ints((median,), group)], None, None


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _describe_failure(failed: list, error: Exception | None) -> str:
    ranks = ", ".join(map(str, failed))
    if error is None:
        return f"failed on rank(s) {ranks}"
    first_line = (str(error).splitlines() or [""])[0]
    return f"failed on rank(s) {ranks}: {type(error).__name__}: {first_line}"
