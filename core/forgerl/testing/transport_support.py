"""What the transport kit's cases are made of: the transport under test (a
:class:`TransportCase`), receiver processes built from a sender's spec, the weights that
must arrive, and what a closed transport must no longer hold (listening ports, /dev/shm
files, threads). forgerl's own transport tests build on these too."""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import threading
import traceback
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forgerl.testing.endpoints import READER_THREAD_PREFIX, Endpoint
from forgerl.testing.registry import backend_under_test
from forgerl.testing.timing import scaled, wait_until
from forgerl.testing.transport_receiver import digest, make_weights

#: Slack on top of a timeout for process scheduling on a busy machine (scaled).
SLACK_S = 4.0


@dataclass(frozen=True)
class TransportCase:
    """A transport under test and what its contract promises."""

    #: The backend name, as ``transport.name`` in a config.
    backend: str
    #: Its options, as ``transport.options`` holds them (plain data). Small buckets or
    #: chunks make test-sized versions move in several pieces.
    options: Mapping[str, Any] = field(default_factory=dict)
    #: Whether ``send`` waits for every registered receiver and raises naming the ones
    #: that did not take the version (push transports); False for a pull-based transport
    #: whose ``send`` returns once the version is published.
    confirms_delivery: bool = True
    #: Whether the sender notices a receiver's death (its connection drops) and fails the
    #: send with a TransportError that is not a TransportTimeout, rather than waiting out
    #: the timeout.
    sees_dead_peers: bool = False
    #: Plugin modules to load besides the installed ones (import paths).
    plugins: tuple[str, ...] = ()
    #: Fail, rather than skip, when the backend cannot be used here (a missing package).
    required: bool = False

    def create(self) -> Any:
        """The transport, built as a run builds it on the trainer (no run context here)."""
        record = backend_under_test("transport", self.backend, self.plugins, required=self.required)
        return record.build(dict(self.options), context=None)


def expected(version: int, big: bool = False) -> dict[str, str]:
    """Digest of every tensor of ``version`` (:func:`make_weights`), in the sender's order."""
    return {n: digest(n, t) for n, t in make_weights(version, big).items()}


def start_receiver(
    endpoints: list[Endpoint],
    case: TransportCase,
    spec: Mapping[str, Any],
    worker_id: str,
    versions: list[int],
    timeout: float | None = None,
    die_when_started: int | None = None,
    rejoin: int | None = None,
    wait_go: bool = False,
    options: Mapping[str, Any] | None = None,
    stop_when_started: int | None = None,
) -> Endpoint:
    """A receiver process built from the sender's ``spec``, which reaches it on its stdin:
    the spec carries the transport secret, and ``ps`` shows command lines to every user."""
    args = [
        "--transport",
        case.backend,
        "--options",
        json.dumps(dict(case.options if options is None else options)),
        "--worker-id",
        worker_id,
        "--versions",
        ",".join(map(str, versions)),
        "--timeout",
        str(scaled(30.0) if timeout is None else timeout),
    ]
    if case.plugins:
        args += ["--plugins", ",".join(case.plugins)]
    if die_when_started is not None:
        args += ["--die-when-started", str(die_when_started)]
    if stop_when_started is not None:
        args += ["--stop-when-started", str(stop_when_started)]
    if rejoin is not None:
        args += ["--rejoin", str(rejoin)]
    if wait_go:
        args.append("--wait-go")
    ep = Endpoint(args, f"receiver {worker_id} ({case.backend})")
    endpoints.append(ep)
    ep.tell(json.dumps(dict(spec)))
    return ep


def start_sender(
    endpoints: list[Endpoint], case: TransportCase, versions: list[int], big: bool = False
) -> Endpoint:
    """A sender process: it prints ``spec``, then sends a version for every ``send V`` line."""
    args = [
        "--role",
        "sender",
        "--transport",
        case.backend,
        "--options",
        json.dumps(dict(case.options)),
        "--versions",
        ",".join(map(str, versions)),
        "--timeout",
        str(scaled(30)),
    ]
    if case.plugins:
        args += ["--plugins", ",".join(case.plugins)]
    if big:
        args.append("--big")
    ep = Endpoint(args, f"sender ({case.backend})")
    endpoints.append(ep)
    return ep


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------ leaks


def listening_ports() -> set[int]:
    """TCP ports something on this machine (this network namespace) listens on."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def shm_entries_of(pids: Iterable[int]) -> list[str]:
    """Files in /dev/shm whose names carry one of these process ids (how shm temp files,
    torch's and gloo's segments are named)."""
    pids = set(pids)
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return []
    # The id as a whole token: a random name such as multiprocessing's ``psm_40393bbd``
    # holds the digits of pid 4039 without being its segment.
    ids = re.compile(r"(?<![0-9A-Za-z])(" + "|".join(map(str, pids)) + r")(?![0-9A-Za-z])")
    return [n for n in names if ids.search(n)]


def threads_left(before: set[threading.Thread], wait_s: float = 15.0) -> str:
    """Threads started since ``before`` (``set(threading.enumerate())`` then) that are still running after
    ``wait_s`` (scaled), with their stacks; "" when none. The kit's helper readers are
    not counted. A broken group's teardown may wait out its pending operations, bounded by
    their timeouts: hence the wait."""

    def started() -> list[threading.Thread]:
        return [
            t
            for t in threading.enumerate()
            if t not in before and not t.name.startswith(READER_THREAD_PREFIX)
        ]

    try:
        wait_until(lambda: not started(), wait_s, "the transport's threads to end")
    except AssertionError:
        pass  # reported below, with their stacks
    frames = sys._current_frames()
    return "\n".join(
        f"{t.name}:\n{''.join(traceback.format_stack(frames[t.ident]))}" for t in started() if t.ident in frames
    )
