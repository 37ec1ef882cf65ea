"""The trainer's half of a weight update in tests that drive a generator directly: send a
version while the generator's ``update_weights`` loads it (as ``Loop.sync_weights`` starts
both together)."""

from __future__ import annotations

import threading
from typing import Any

from tests.helpers.timing import scaled


def send_while_loading(generator: Any, sender: Any, weights: Any, *, join_timeout: float) -> None:
    """Send ``weights`` (a ``WeightSet``) through ``sender`` while ``generator`` loads its
    version on a thread; fails when the load raises or has not returned after ``join_timeout``
    seconds (already scaled by the caller)."""
    errors: list[BaseException] = []

    def load() -> None:
        try:
            generator.update_weights(weights.version)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    loader = threading.Thread(target=load)
    loader.start()
    sender.send(weights, timeout=scaled(60))
    loader.join(join_timeout)
    assert not loader.is_alive(), f"update_weights({weights.version}) did not return"
    assert not errors, errors
