"""The staleness gate: batch k is generated with policy version max(0, k - S) exactly."""

from __future__ import annotations

import threading
import time

import pytest

from forgerl.rollouts.rollout import RolloutBatch, RolloutBuffer
from tests.helpers.timing import scaled


def drive(staleness: int, steps: int, jitter: float) -> list[tuple[int, int]]:
    """A producer thread and a trainer loop, as in forgerl.runloop.loop, with random delays."""
    import random

    rng = random.Random(staleness)
    buf = RolloutBuffer(staleness, next_index=0, version=0)
    made: list[tuple[int, int]] = []

    def produce():
        for k in range(steps):
            if not buf.wait_turn(k):
                return
            version = buf.version
            time.sleep(rng.random() * jitter)
            made.append((k, version))
            buf.put(RolloutBatch(index=k, episodes=[], policy_version=version, task_state={}))

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    for step in range(steps):
        buf.get(step, timeout=scaled(10))
        time.sleep(rng.random() * jitter)  # training
        buf.wait_done_through(min(step + staleness, steps - 1))
        buf.set_version(step + 1)
    producer.join(timeout=scaled(10))
    assert not producer.is_alive(), "the producer did not finish"
    return made


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_batch_k_uses_version_k_minus_staleness(staleness):
    made = drive(staleness, steps=8, jitter=0.01)
    assert made == [(k, max(0, k - staleness)) for k in range(8)]


def test_a_producer_error_reaches_the_loop():
    buf = RolloutBuffer(0, next_index=0, version=0)
    buf.fail(RuntimeError("generator exploded"))
    with pytest.raises(RuntimeError, match="generator exploded"):
        buf.get(0, timeout=1)


def test_stop_releases_a_waiting_producer():
    buf = RolloutBuffer(0, next_index=0, version=0)
    result = []
    t = threading.Thread(target=lambda: result.append(buf.wait_turn(5)))
    t.start()
    buf.stop()
    t.join(timeout=scaled(5))
    assert result == [False]
