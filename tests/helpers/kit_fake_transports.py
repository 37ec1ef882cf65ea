"""A plugin of deliberately broken transports, each the ``shm`` transport with one rule of
the transport contract broken: the tests of the transport kit (forgerl.testing) show that
its checks fail on them. Loaded by import path (``"tests.helpers.kit_fake_transports"``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

from forgerl.backends import TransportBackend
from forgerl.hookspecs import hookimpl
from forgerl.testing.timing import scaled
from forgerl.testing.transport_support import SLACK_S


def _shm() -> Any:
    from forgerl_plugins.transports.shm.transport import ShmTransport

    return ShmTransport


def leaves_its_directory(options: Any, *, context: Any) -> Any:
    """close() of the sender and of the transport keep the versions' directory."""

    class Leaky(_shm()):
        def sender(self) -> Any:
            sender = super().sender()
            sender.close = lambda: None
            return sender

        def close(self) -> None:
            pass

    return Leaky(options, context=context)


#: What the thread of ``kit_leaves_a_thread`` waits for: only the test sets it, at its end.
HEARTBEAT_STOP = threading.Event()


def leaves_a_thread(options: Any, *, context: Any) -> Any:
    """The sender starts a helper thread that its close does not stop."""

    class Threaded(_shm()):
        def sender(self) -> Any:
            threading.Thread(target=HEARTBEAT_STOP.wait, name="kit-fake-heartbeat", daemon=True).start()
            return super().sender()

    return Threaded(options, context=context)


def waits_past_its_timeout(options: Any, *, context: Any) -> Any:
    """A receiver that, asked for a version never sent, gives up long after its timeout."""
    from forgerl.errors import TransportTimeout

    class Slow(_shm()):
        def receiver(self, worker_id: str, spec: Any = None) -> Any:
            receiver = super().receiver(worker_id, spec)

            def receive(version: int, timeout: float | None = None) -> Iterator[Any]:
                # Past the kit's bound at any FORGE_TEST_TIMEOUT_SCALE: the kit allows the
                # timeout plus its scaled slack (a fixed overrun passed the check at scale 3).
                time.sleep((timeout or 1.0) + scaled(SLACK_S) + 2)
                raise TransportTimeout(f"version {version} did not arrive")

            receiver.receive = receive
            return receiver

    return Slow(options, context=context)


@hookimpl
def forge_transports():
    options = "forgerl_plugins.transports.shm.transport:ShmTransport.Options"
    return [
        TransportBackend(name="kit_leaves_its_directory", factory=leaves_its_directory, options=options),
        TransportBackend(name="kit_leaves_a_thread", factory=leaves_a_thread, options=options),
        TransportBackend(name="kit_waits_past_its_timeout", factory=waits_past_its_timeout, options=options),
    ]
