"""Fixtures of the transport suites: the helper processes a test starts (``endpoints``)
and a hard per-test time limit, so that a transport that hangs fails its test with a
message instead of stalling the whole run. The transport under test (``name``) is
tests/conftest.py's, shared with the transport fault tests."""

from __future__ import annotations

import pytest

from forgerl.testing.endpoints import Endpoint
from forgerl.testing.timing import hard_limit

from ..helpers.timing import scaled

DEFAULT_LIMIT_S = 90


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "hard_timeout(seconds): fail the test when it runs longer")


@pytest.fixture(autouse=True)
def _hard_timeout(request: pytest.FixtureRequest):
    marker = request.node.get_closest_marker("hard_timeout")
    # The marker's seconds are for an idle machine: stretched like every test deadline.
    limit = int(scaled(marker.args[0] if marker else DEFAULT_LIMIT_S))
    with hard_limit(limit, f"{request.node.nodeid} ran past its hard timeout of {limit} s"):
        yield


@pytest.fixture
def endpoints():
    """Every helper process a test starts; killed at teardown whatever happened."""
    started: list[Endpoint] = []
    yield started
    for ep in started:
        ep.cleanup()
