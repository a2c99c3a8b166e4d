"""`tridist.tune`: the slowest rank decides, the on-disk cache and its agreement rule, bad arguments
and failing configs. Runs are sleeps of a few milliseconds: gaps that a busy CI machine keeps."""
import contextlib
import io
import json
import time
import warnings

import pytest

import tridist


@contextlib.contextmanager
def _cache_at(folder: str):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRIDIST_TUNE_CACHE", folder)
        yield


def _sleeper(calls: list):
    """make_run for configs {"ms": n}: records each config it builds; its run sleeps n ms."""
    def make_run(config):
        calls.append(config)
        return lambda: time.sleep(config["ms"] / 1e3)
    return make_run


def _slowest_rank_decides(w, folder):
    # "b" is the fastest on every rank but the last, where it is the slowest: the slowest rank
    # scores a 10, b 15 (on one rank alone too) and c 5 ms.
    last = w.world_size - 1
    milliseconds = {"a": 10, "b": 15 if w.rank == last else 0, "c": 5}
    configs = [{"name": "a"}, {"name": "b"}, {"name": "c"}]
    printed = io.StringIO()
    def make_run(config):
        return lambda: time.sleep(milliseconds[config["name"]] / 1e3)

    with _cache_at(folder), contextlib.redirect_stderr(printed):  # the `tridist` logger's messages
        chosen = tridist.tune("sleep", w.world_size, configs, make_run, verbose=True)
    assert all(chosen is not config for config in configs), "tune returns a copy"
    return chosen, printed.getvalue()


def test_the_slowest_rank_decides(world, tmp_path):
    results = world.run(_slowest_rank_decides, folder=str(tmp_path))
    assert [chosen for chosen, _ in results] == [{"name": "c"}] * world.size
    lines = [line for line in results[0][1].splitlines() if line.startswith("tridist: tune sleep ")]
    assert len(lines) == 3 and [line.endswith("<- chosen") for line in lines] == [False, False, True], lines
    assert all(" us" in line for line in lines)
    assert all("tune sleep" not in printed for _, printed in results[1:]), "only rank 0 says"


def _cache_hit(w, folder):
    calls = []
    configs = [{"ms": 3}, {"ms": 0}]
    with _cache_at(folder):
        first = tridist.tune("cached", ("k", w.world_size), configs, _sleeper(calls))
        tuned = len(calls)
        second = tridist.tune("cached", ("k", w.world_size), configs, _sleeper(calls))
        assert len(calls) == tuned, "the second call reads the cache"
        tridist.tune("cached", ("k", w.world_size), configs + [{"ms": 1}], _sleeper(calls))
        assert len(calls) == tuned + 3, "other configs are tuned afresh"
        tridist.tune("cached", ("other key",), configs, _sleeper(calls))
        assert len(calls) == tuned + 5, "another key is tuned afresh"
    return first, second, tuned


def test_second_call_reads_the_cache(world, tmp_path):
    results = world.run(_cache_hit, folder=str(tmp_path))
    assert results == [({"ms": 0}, {"ms": 0}, 2)] * world.size
    entries = json.loads((tmp_path / "tune.json").read_text())
    keys = [k for k in entries if k.startswith(f"cached ('k', {world.size}) world_size={world.size} ")]
    assert len(keys) == 2 and any(k.startswith("cached ('other key',) ") for k in entries), list(entries)
    entry = entries[keys[0]]
    assert entry["date"] and entry["config"] in ({"ms": 0}, {"ms": 1})
    assert all(len(t["ranks_ns"]) == world.size and t["slowest_ns"] == max(t["ranks_ns"]) for t in entry["times"])


def _tunes_again(w, folder, other_folder=None):
    calls = []
    configs = [{"ms": 3}, {"ms": 0}]
    with _cache_at(folder):
        tridist.tune("again", 1, configs, _sleeper(calls))
    tuned = len(calls)
    with _cache_at(folder if other_folder is None or w.rank == 0 else other_folder):
        chosen = tridist.tune("again", 1, configs, _sleeper(calls))
    return chosen, len(calls) - tuned


def test_corrupt_cache_is_tuned_again_and_rewritten(world, tmp_path):
    (tmp_path / "tune.json").write_text("{ half a file")
    results = world.run(_tunes_again, folder=str(tmp_path))
    assert results == [({"ms": 0}, 0)] * world.size
    assert any(k.startswith("again 1 ") for k in json.loads((tmp_path / "tune.json").read_text()))


def test_cache_that_ranks_disagree_on_is_tuned_again(world, tmp_path):
    # As on two hosts: only rank 0's folder holds the entry. A rank that trusted it alone would
    # skip the timing collectives that its peers wait in.
    (tmp_path / "empty").mkdir()
    results = world.run(_tunes_again, folder=str(tmp_path), other_folder=str(tmp_path / "empty"))
    assert results == [({"ms": 0}, 2 if world.size > 1 else 0)] * world.size


def _unwritable_cache(w, folder):
    with _cache_at(folder), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = tridist.tune("unwritable", 1, [{"ms": 3}, {"ms": 0}], _sleeper([]))
    return chosen, [str(warning.message) for warning in caught]


def test_unwritable_cache_only_warns(world, tmp_path):
    (tmp_path / "a file").write_text("")
    results = world.run(_unwritable_cache, folder=str(tmp_path / "a file" / "cache"))
    per_node = world.size // (world.nnodes or 1)
    for rank, (chosen, messages) in enumerate(results):
        assert chosen == {"ms": 0}
        writes = rank % per_node == 0  # the first rank of each node writes
        assert len(messages) == writes and all("could not write its cache" in m for m in messages), messages


def _bad_arguments(w, folder):
    def never(config):
        raise AssertionError("nothing is timed")

    with _cache_at(folder):
        with pytest.raises(ValueError, match="no configs"):
            tridist.tune("bad", 1, [], never)
        with pytest.raises(ValueError, match="repetitions >= 1"):
            tridist.tune("bad", 1, [{"n": 0}, {"n": 1}], never, repetitions=0)
        with pytest.raises(TypeError, match="configs as dicts"):
            tridist.tune("bad", 1, [("n", 0), ("n", 1)], never)
        assert tridist.tune("bad", 1, [{"n": 0}], never) == {"n": 0}, "one config is not timed"
        if w.world_size == 1:
            return
        last = w.world_size - 1
        configs = [{"n": 0}] + ([{"n": 1}] if w.rank == last else [])
        with pytest.raises(ValueError, match="ranks passed different name, key or configs") as error:
            tridist.tune("bad", 1, configs, never)
        agreeing = ("rank 0" if last == 1 else "ranks " + ", ".join(map(str, range(last))))
        assert f"ranks that agree: {agreeing} / rank {last})" in str(error.value)
        with pytest.raises(ValueError, match=f"rank {w.rank} passed name='bad', key={w.rank},"):
            tridist.tune("bad", w.rank, [{"n": 0}, {"n": 1}], never)


def test_bad_arguments_fail_on_every_rank(world, tmp_path):
    world.run(_bad_arguments, folder=str(tmp_path))


def _failing_configs(w, folder):
    last = w.world_size - 1

    def make_run(config):
        if config["fails"] == "when built":
            raise RuntimeError("out of resources: shared memory\nmore detail")

        def run():
            if config["fails"] == "on the last rank" and w.rank == last:
                raise ValueError("bad launch")
            time.sleep(config["ms"] / 1e3)
        return run

    configs = [{"fails": "when built", "ms": 0}, {"fails": "on the last rank", "ms": 0}, {"fails": "never", "ms": 2}]
    with _cache_at(folder):
        assert tridist.tune("failing", 1, configs, make_run) == configs[2]
        with pytest.raises(tridist.TridistError, match="every config failed") as error:
            tridist.tune("failing", 2, configs[:2], make_run)
    message = str(error.value)
    assert "RuntimeError: out of resources: shared memory" in message and "more detail" not in message
    assert ("ValueError: bad launch" if w.rank == last else f"failed on rank(s) {last}\n") in message + "\n"


def test_failing_configs_are_skipped_on_every_rank(world, tmp_path):
    world.run(_failing_configs, folder=str(tmp_path))
    entry = next(v for k, v in json.loads((tmp_path / "tune.json").read_text()).items() if k.startswith("failing 1 "))
    assert [t["failed_on_ranks"] for t in entry["times"]] == [list(range(world.size)), [world.size - 1], None]
