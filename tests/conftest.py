import pytest

from .harness import WorldPool, default_worlds, parse_world, pin_worker_gpu, worlds_not_started

pin_worker_gpu()  # before default_worlds() below counts the GPUs


@pytest.fixture(scope="session", params=default_worlds())
def world(request):
    """A pool of ranks; tests call `world.run(body, **kwargs)`. Tests are grouped by world so each
    world starts once (pytest orders tests to minimise switches of a session-scoped parameter)."""
    pool = WorldPool(request.param)
    yield pool
    pool.close()


def pytest_configure(config):
    config.addinivalue_line("markers", "at_most_4_ranks: run only in worlds of up to 4 ranks (see conftest.py)")
    config.addinivalue_line("markers", "worlds(*names): run only in these worlds, e.g. worlds('1', '2', '2x2') "
                                       "(see conftest.py)")


def pytest_collection_modifyitems(config, items):
    """Worlds of 8 ranks cost the emulator, on CI's two cores, seconds per test. They run every
    kernel's own tests, where a rank count or node shape could matter. Tests marked
    `at_most_4_ranks` stop at 4 ranks and 2x2: they check what sits around the kernels (tuning,
    torch.compile, examples, benchmarks' own kernels), which worlds of 1 to 4 ranks already cover.
    Tests marked `worlds(...)` run in the worlds they name only (of those TRIDIST_TEST_WORLDS
    starts); the others are deselected, so that a test whose checks need only some shapes of world
    costs CI nothing in the rest. A test none of whose worlds this run starts (e.g. one for world 1
    where ranks share a GPU) is reported as skipped, once per its other parameters, not dropped."""
    kept, deselected, unrun = [], [], {}
    for item in items:
        world = getattr(item, "callspec", None) and item.callspec.params.get("world")
        only = item.get_closest_marker("worlds")
        params = item.callspec.params if world else {}
        test = (item.path, item.originalname, repr(sorted((k, v) for k, v in params.items() if k != "world")))
        if world and only and world not in only.args:
            deselected.append(item)
            unrun.setdefault(test, item)
            continue
        unrun[test] = None  # runs in some world
        if world and item.get_closest_marker("at_most_4_ranks") and parse_world(world)[0] > 4:
            item.add_marker(pytest.mark.skip(reason=f"marked at_most_4_ranks; world {world} has more"))
        kept.append(item)
    for item in filter(None, unrun.values()):
        item.add_marker(pytest.mark.skip(reason=worlds_not_started(item.get_closest_marker("worlds").args)))
        deselected.remove(item)
        kept.append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept
