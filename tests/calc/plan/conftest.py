"""Fixtures of the planner tests."""

from collections.abc import Iterator

import pytest

from calc.plan import grid


@pytest.fixture(scope="module")
def fresh_plan_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A module's own compile cache, on disk and in memory: no compile a test counts is found
    in a cache another test filled."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VRAMPLAN_CACHE_DIR", str(tmp_path_factory.mktemp("plan_cache")))
        grid.clear_memory_cache()
        yield
        grid.clear_memory_cache()
