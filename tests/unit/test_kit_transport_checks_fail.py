"""The transport kit's checks fail on a transport that breaks the rule they check: the
``shm`` transport with one rule broken (tests/helpers/kit_fake_transports.py). These cases
need no helper process: they call the kit's in-process case directly."""

from __future__ import annotations

import shutil

import pytest

from forgerl.testing import TransportCase, TransportContract

FAKES = ("tests.helpers.kit_fake_transports",)


class Kit(TransportContract):
    thread_exit_wait_s = 0.5  # the fake's thread never ends: do not wait long to say so


def case(backend: str) -> TransportCase:
    return TransportCase(backend, {"poll_interval": 0.01}, confirms_delivery=False, plugins=FAKES)


def test_the_shm_transport_passes():
    Kit().test_nothing_blocks_forever(TransportCase("shm", {"poll_interval": 0.01}, confirms_delivery=False))


def test_a_transport_that_leaves_its_directory_fails(monkeypatch):
    made = []
    real = Kit.held_paths
    monkeypatch.setattr(
        Kit, "held_paths", lambda self, c, spec: made.extend(real(self, c, spec)) or real(self, c, spec)
    )
    try:
        with pytest.raises(AssertionError, match="left behind after close"):
            Kit().test_nothing_blocks_forever(case("kit_leaves_its_directory"))
    finally:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)


def test_a_transport_that_leaves_a_thread_running_fails():
    from tests.helpers.kit_fake_transports import HEARTBEAT_STOP

    HEARTBEAT_STOP.clear()
    try:
        with pytest.raises(AssertionError, match=r"still run after close:\s+kit-fake-heartbeat"):
            Kit().test_nothing_blocks_forever(case("kit_leaves_a_thread"))
    finally:
        HEARTBEAT_STOP.set()


def test_a_receiver_that_waits_past_its_timeout_fails():
    with pytest.raises(AssertionError, match=r"receive of a version never sent gave up after .* s, timeout 1 s"):
        Kit().test_nothing_blocks_forever(case("kit_waits_past_its_timeout"))
