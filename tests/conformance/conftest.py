"""Fixtures of the transport suites: the transport under test (``name``), the helper
processes a test starts (``endpoints``), and a hard per-test time limit, so that a
transport that hangs fails its test with a message instead of stalling the whole run."""

from __future__ import annotations

import pytest

from forgerl.testing.endpoints import Endpoint
from forgerl.testing.timing import hard_limit

from ..helpers.requires import require_mooncake
from ..helpers.timing import scaled

#: The transports ``name`` runs a test against. A module that applies to fewer narrows it:
#: ``pytestmark = pytest.mark.parametrize("name", ["nccl", "rdma"], indirect=True)``.
TRANSPORTS = ["shm", "nccl", "rdma"]

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


@pytest.fixture(params=TRANSPORTS)
def name(request: pytest.FixtureRequest) -> str:
    if request.param == "rdma":
        require_mooncake()
    return request.param


@pytest.fixture
def endpoints():
    """Every helper process a test starts; killed at teardown whatever happened."""
    started: list[Endpoint] = []
    yield started
    for ep in started:
        ep.cleanup()
