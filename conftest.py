"""Plugins of every test session in this repository, contrib's tests included: the vLLM
server they share (tests/helpers/shared_vllm.py)."""

from __future__ import annotations

import pytest

from tests.helpers.timing import scale

try:
    scale()
    _BAD_SCALE = ""
except ValueError as exc:
    _BAD_SCALE = str(exc)


def pytest_configure(config: pytest.Config) -> None:
    """A FORGE_TEST_TIMEOUT_SCALE that is no factor stops the session before the first test,
    with one line, instead of an error in every test that asks for a deadline."""
    if _BAD_SCALE:
        raise pytest.UsageError(_BAD_SCALE)


# The plugins scale deadlines as they are imported: with no factor to scale by, the session
# stops above, so they are not loaded.
pytest_plugins = [] if _BAD_SCALE else ["tests.helpers.shared_vllm"]
