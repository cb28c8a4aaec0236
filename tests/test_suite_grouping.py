"""The suite's own scheduling: under ``--dist loadgroup`` (pyproject.toml's addopts) a module whose tests share a
module-scoped fixture runs on one xdist worker, so the fixture (a served Prefect stack, a trained run) is built once.
pytest 9.2 with xdist 3.8 silently drops the grouping (xdist issue #1386); pyproject.toml pins pytest below it."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def built_once() -> list[str]:
    return []


@pytest.mark.parametrize("n", [1, 2])
def test_a_module_fixtures_tests_carry_their_group_to_the_scheduler(request, built_once, n):
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("runs on an xdist worker under --dist loadgroup (the README's test command)")
    # xdist's scheduler reads the group from this suffix only; without it each test is scheduled on its own
    assert request.node.nodeid.endswith("@tests/test_suite_grouping.py"), (request.node.nodeid, pytest.__version__)


def test_every_module_the_suite_starts_first_exists(root):
    """conftest's START_FIRST names modules by file: a renamed one would silently lose its place (tests run, later)."""
    from conftest import START_FIRST

    assert [m for m in START_FIRST if not (root / "tests" / m).is_file()] == []
