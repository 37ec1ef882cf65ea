"""Staging a weight version in the vLLM worker (worker_extension.forge_stage_weights): the
transport is read while the engine generates, and the load under the pause takes the
staged tensors. The worker here is the real extension with vLLM's reload recorded (the
loads into a real server: tests/integration/test_vllm.py)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import torch

from forgerl_plugins.generators.vllm.worker_extension import ForgeWorkerExtension
from tests.helpers.timing import wait_until

DEADLINE = 30.0


class HeldBackReceiver:
    """A transport receiver whose versions arrive when the test lets them (``release``)."""

    def __init__(self) -> None:
        self.released = threading.Event()
        self.reads: list[int] = []
        self.fail_next = False

    def receive(self, version: int, timeout: float | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        self.reads.append(version)
        if not self.released.wait(DEADLINE):
            raise TimeoutError("the test never released the version")
        if self.fail_next:
            self.fail_next = False
            raise ConnectionError("sender gone")
        return iter([("w", torch.full((2, 2), float(version))), ("b", torch.full((2,), float(version)))])


class RecordingWorker(ForgeWorkerExtension):
    """The extension on a worker whose reload records what vLLM would load."""

    rank = 0

    def __init__(self, receiver: HeldBackReceiver) -> None:
        self.receiver = receiver
        self.loaded: list[dict[str, float]] = []

    def _forge_receiver(self, req: dict[str, Any]) -> Any:
        return self.receiver

    def reload_weights(self, *, weights_iterator: Any, is_checkpoint_format: bool) -> None:
        self.loaded.append({name: float(t.flatten()[0]) for name, t in weights_iterator})

    def _forge_refresh_tied_head(self) -> None:
        pass  # no vLLM model here


def request(version: int) -> str:
    return json.dumps({"version": version, "timeout": DEADLINE, "source": "transport", "transport": {}})


def wait_staged(worker: RecordingWorker) -> None:
    staging = worker._forge_staging
    assert staging is not None and staging.done.wait(DEADLINE)


def test_a_staged_version_is_read_while_the_engine_runs_and_loaded_without_reading_again():
    receiver = HeldBackReceiver()
    worker = RecordingWorker(receiver)
    # The RPC answers at once although the version has not arrived: the engine's loop
    # (which runs the RPC between steps) is never held by the transport.
    assert worker.forge_stage_weights(request(5)) == {"ok": True, "version": 5, "done": False}
    receiver.released.set()
    wait_staged(worker)
    assert worker.forge_stage_weights(request(5)) == {"ok": True, "version": 5, "done": True}
    result = worker.forge_load_weights(request(5))
    assert result["ok"] and result["staged"] and result["tensors"] == 2
    assert worker.loaded == [{"w": 5.0, "b": 5.0}]
    assert receiver.reads == [5]  # read once, before the pause
    # The stage is used once: the next load reads its own version.
    assert worker.forge_load_weights(request(6))["staged"] is False
    assert worker.loaded[-1] == {"w": 6.0, "b": 6.0} and receiver.reads == [5, 6]


def test_a_failed_stage_leaves_the_load_to_read_the_version_itself():
    receiver = HeldBackReceiver()
    receiver.fail_next = True
    worker = RecordingWorker(receiver)
    worker.forge_stage_weights(request(3))
    receiver.released.set()
    wait_staged(worker)
    status = worker.forge_stage_weights(request(3))
    assert not status["ok"] and "sender gone" in status["error"]
    result = worker.forge_load_weights(request(3))
    assert result["ok"] and not result["staged"] and worker.loaded == [{"w": 3.0, "b": 3.0}]


def test_a_stage_left_over_from_another_version_is_never_loaded_nor_read_beside():
    receiver = HeldBackReceiver()
    worker = RecordingWorker(receiver)
    worker.forge_stage_weights(request(7))  # its update failed before the load; still reading
    # The read runs in the stage's thread: 8 is asked only once 7's read waits on the
    # transport (else the check below could find 7 not read yet, not 8 read beside it).
    wait_until(lambda: receiver.reads == [7], DEADLINE, "the read of version 7 to start")
    refused = worker.forge_stage_weights(request(8))
    assert not refused["ok"] and "version 7" in refused["error"] and receiver.reads == [7]
    receiver.released.set()
    # The load waits for the old read to end, drops it and reads its own version.
    result = worker.forge_load_weights(request(8))
    assert result["ok"] and not result["staged"]
    assert worker.loaded == [{"w": 8.0, "b": 8.0}] and receiver.reads == [7, 8]
