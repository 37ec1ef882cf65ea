"""Receivers as members of a sender's control store: the keys and rules both sides keep.

A receiver *joins* (:func:`join`): it checks that the store's sender proves the run's
secret, picks a fresh nonce (one per incarnation, so a restarted worker is a new member)
and queues a signed ``join`` event on :data:`EVENTS`. Everything about one member then
lives under ``m/<nonce>/`` (:func:`member_key`): its acknowledgement (``ack``) and, once
either side gives up on it, why (``closed``: :func:`say_closed`).

The sender registers whoever joined (:func:`admit`), reads acknowledgements, and tells
the receivers it drops or leaves. Used by the ``nccl`` and ``rdma`` transports.
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass
from typing import Any

from forgerl.errors import TransportError
from forgerl_plugins.transports.common.auth import PROOF_KEY, PROOF_VALUE, ForgedValue
from forgerl_plugins.transports.common.control import STORE_ERRORS, Control, Deadline, local_address

log = logging.getLogger(__name__)

#: Queue of events from receivers to the sender (``join``, and the nccl receiver's ``want``).
EVENTS = "events"
#: The number of the newest version the sender published (what receivers poll).
LATEST = "latest"
#: A member's ``closed`` value when the sender itself closed: an orderly end, not a drop.
SENDER_CLOSED = "the sender closed"


def member_key(nonce: str, what: str) -> str:
    """A key about one registered receiver (``ack``, ``closed``, offers...)."""
    return f"m/{nonce}/{what}"


# ===================================================================== receiver side


def check_sender(ctl: Control, deadline: Deadline | None = None) -> None:
    """Refuse to go on unless the store's sender signed its proof with our secret: a
    receiver with a wrong secret learns so at once, in words (TransportError, not a
    store error, so no retry loop swallows it)."""
    host, port = ctl._address
    try:
        proof = ctl.get(PROOF_KEY, deadline)
    except ForgedValue:
        raise TransportError(
            f"the transport sender at {host}:{port} refused this receiver: its secret does not match the "
            "run's (the receiver must be built from this run's receiver_spec(), which carries the secret)"
        ) from None
    if proof != PROOF_VALUE:
        raise TransportError(
            f"the control store at {host}:{port} does not prove the run's transport secret: it is not "
            "this run's sender (a stale address, or a forgerl too old to sign its store)"
        )


def join(ctl: Control, worker_id: str, sender_host: str, deadline: Deadline) -> str:
    """Register a receiver with the sender: check the sender's proof, then a fresh nonce,
    its ``ack`` key at -1, and a signed ``join`` event on :data:`EVENTS` naming the
    worker, its pid and the address it reaches the sender from (what the sender's errors
    name). Returns the nonce."""
    check_sender(ctl, deadline)
    nonce = uuid.uuid4().hex[:16]
    ctl.set(member_key(nonce, "ack"), "-1", deadline)
    event = {
        "type": "join",
        "nonce": nonce,
        "worker_id": worker_id,
        "pid": os.getpid(),
        "host": local_address(sender_host),
    }
    ctl.push(EVENTS, event, deadline)
    return nonce


def say_closed(ctl: Control, nonce: str, why: str, deadline: Deadline | None = None) -> None:
    """Set a member's ``closed`` key (best effort: the other side may be gone already)."""
    try:
        ctl.set(member_key(nonce, "closed"), why, deadline)
    except STORE_ERRORS:
        pass


# ======================================================================= sender side


@dataclass
class Member:
    """One registered receiver (one incarnation: a restart registers a new nonce)."""

    worker_id: str
    nonce: str
    pid: int
    host: str
    failed: str | None = None  # why it was dropped; it must register again

    def label(self) -> str:
        return f"{self.worker_id!r} (pid {self.pid} on {self.host})"


def admit(members: dict[str, Any], event: dict[str, Any], member_class: type[Member], transport: str) -> None:
    """Register the receiver of a ``join`` event in ``members`` (by nonce). An earlier
    incarnation of the same worker still registered is failed: it will never answer."""
    for old in members.values():
        if old.worker_id == event["worker_id"] and old.failed is None:
            old.failed = "replaced by a new incarnation of the same worker"
    members[event["nonce"]] = member_class(
        event["worker_id"], event["nonce"], int(event["pid"]), event["host"]
    )
    log.info(
        "%s: receiver %r registered (pid %s on %s)",
        transport,
        event["worker_id"],
        event["pid"],
        event["host"],
    )


def log_refused(ctl: Control, transport: str) -> None:
    """Say so when someone without the secret queued a message (a registration, mostly)."""
    for tail in ctl.refused:
        log.warning(
            "%s: refused a message not signed with the run's transport secret (someone without it "
            "reached the control store): ...%r",
            transport,
            tail[-120:],
        )
    ctl.refused.clear()


def acknowledged(ctl: Control, nonce: str, wanted: int, deadline: Deadline | None) -> bool:
    """Whether the member's acknowledgement is at least ``wanted``."""
    ack = ctl.get(member_key(nonce, "ack"), deadline)
    return ack is not None and int(ack) >= wanted


def closed_since(
    ctl: Control, nonce: str, wanted: int, deadline: Deadline | None
) -> tuple[bytes | None, bool]:
    """For a member whose acknowledgement was below ``wanted`` a moment ago: its
    ``closed`` value (None while it is open), and whether it acknowledged ``wanted``
    after all. A receiver acknowledges before it closes, so one that took the version and
    closed between that read and this one has its acknowledgement there now: it took the
    version, and a send must not fail it for closing."""
    closed = ctl.get(member_key(nonce, "closed"), deadline)
    if closed is None:
        return None, False
    return closed, acknowledged(ctl, nonce, wanted, deadline)


def undelivered(version: int, targets: list[Any], missing: list[Any]) -> str:
    """The error of a send that did not reach the ``missing`` of its ``targets``."""
    what = "; ".join(f"{m.label()}: {m.failed}" for m in missing)
    got = len(targets) - len(missing)
    return (
        f"weights version {version} did not reach {len(missing)} of {len(targets)} receivers: {what}. "
        f"{got} received it; the others are dropped until they register again (a restarted receiver "
        "does so itself)"
    )
