"""A hard per-test time limit for the transport suites: a transport that hangs fails its
test with a message instead of stalling the whole run."""

from __future__ import annotations

import signal

import pytest

from ..helpers.timing import scaled

DEFAULT_LIMIT_S = 90


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "hard_timeout(seconds): fail the test when it runs longer")


@pytest.fixture(autouse=True)
def _hard_timeout(request: pytest.FixtureRequest):
    marker = request.node.get_closest_marker("hard_timeout")
    # The marker's seconds are for an idle machine: stretched like every test deadline.
    limit = int(scaled(marker.args[0] if marker else DEFAULT_LIMIT_S))

    def expire(signum, frame):  # runs in the main thread, between bytecodes
        raise TimeoutError(f"{request.node.nodeid} ran past its hard timeout of {limit} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(limit)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
