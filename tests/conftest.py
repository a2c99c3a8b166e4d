import pytest

from .harness import WorldPool, default_worlds


@pytest.fixture(scope="session", params=default_worlds())
def world(request):
    """A pool of ranks; tests call `world.run(body, **kwargs)`. Tests are grouped by world so each
    world starts once (pytest orders tests to minimise switches of a session-scoped parameter)."""
    pool = WorldPool(request.param)
    yield pool
    pool.close()
