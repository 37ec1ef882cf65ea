"""``forge fleet``: generator servers that several runs share, each run training its own
LoRA adapter on one base model (multi-LoRA).

The core owns the process: it finds the generator backend, asks its class to start a
fleet (a static method ``start_fleet(directory, *, model, max_adapters, max_rank, sets)``
returning a context manager whose value has ``replicas``, ``model``, ``directory``,
``ready()`` and ``ended()``), says when every server is up, and stops the fleet on Ctrl-C
or SIGTERM (exit status 0: that is how a fleet ends). When its servers stop for good
(``ended()`` says why: their restarts spent), it says so in one line and exits 1. A generator without ``start_fleet`` is refused
with one line. Runs attach with ``--set generator.options.fleet=DIR``; what attaching
means is the generator's business (see docs/lora.md).
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forgerl.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.registry.plugins import Registry

#: Seconds between looks at whether every server is up.
READY_POLL = 1.0


def serve_fleet(
    registry: Registry,
    generator: str,
    directory: Path,
    *,
    model: str,
    max_adapters: int,
    max_rank: int,
    sets: Sequence[str] = (),
    say: Callable[[str], None] = print,
    fail: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> int:
    """Start the fleet and serve until SIGINT or SIGTERM (0), or until its servers stop for good (1)."""
    backend = registry.require("generator", generator)
    start = getattr(backend.load_part(backend.factory, "factory"), "start_fleet", None)
    if start is None:
        raise ConfigError(
            f"generator {generator!r} cannot serve a shared fleet (its class has no `start_fleet`): use --generator vllm"
        )
    stopped = threading.Event()
    previous = _stop_on(stopped)
    try:
        with start(directory, model=model, max_adapters=max_adapters, max_rank=max_rank, sets=list(sets)) as fleet:
            say(f"forge fleet: starting {fleet.replicas} {generator} server(s) of {fleet.model} in {fleet.directory} "
                f"(logs: {Path(fleet.directory) / 'logs'})")  # fmt: skip
            announced = False
            while not stopped.wait(READY_POLL):
                why = fleet.ended()
                if why is not None:  # its servers are gone for good (their restarts spent)
                    fail(f"forge fleet: error: the fleet's servers stopped: {why}")
                    return 1
                if not announced and fleet.ready():
                    announced = True
                    say(f"forge fleet: ready; attach runs with --set generator.options.fleet={fleet.directory} "
                        "(and a LoRA trainer); Ctrl-C stops the fleet")  # fmt: skip
            say("forge fleet: stopping")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _stop_on(stopped: threading.Event) -> dict[int, Any]:
    """SIGINT and SIGTERM end the fleet in order (its servers stopped, its files removed)
    instead of raising wherever the main thread is; the handlers they replace."""
    previous: dict[int, Any] = {}
    if threading.current_thread() is not threading.main_thread():
        return previous  # an embedding program's thread: it stops the fleet its own way
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, lambda *_: stopped.set())
    return previous
