"""What the senders and receivers of the ``nccl`` and ``rdma`` transports have in common.

Both move data their own way (broadcasts over private process groups; one-sided RDMA
reads) but keep the same bookkeeping around it: the sender hosts the control store,
registers receivers and checks each ``send``; a receiver registers itself, answers
:meth:`~StoreReceiver.latest_version`, keeps the last version it received whole, and says
why when it gives up. Subclasses set ``name`` and ``namespace`` (their store's prefix).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from forgerl.errors import TransportError, TransportTimeout
from forgerl.interfaces import TransportReceiver, TransportSender
from forgerl.types import WeightSet
from forgerl_plugins.transports.common import membership
from forgerl_plugins.transports.common.auth import Signer
from forgerl_plugins.transports.common.control import MAX_QUERY, STORE_ERRORS, Control, Deadline, short
from forgerl_plugins.transports.common.layout import Layout
from forgerl_plugins.transports.common.membership import EVENTS, LATEST, SENDER_CLOSED, Member

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger(__name__)


class StoreSender(TransportSender):
    """A sender on trainer rank 0 that hosts the control store receivers register with."""

    name = ""
    namespace = ""
    #: What a registered receiver is to this sender (a :class:`Member` with the
    #: transport's own bookkeeping).
    member_class: type[Member] = Member

    def __init__(
        self,
        options: Any,
        server: Any,
        store_host: str,
        port: int,
        timeout: float,
        release: Any,
        signer: Signer,
    ) -> None:
        self.options = options
        self.default_timeout = timeout
        self.store_host = store_host
        self.port = port
        self._signer = signer
        self._server = server
        self._release = release
        self._ctl = Control(server, self.namespace, signer, store_host, port)  # the caller's thread only
        self._members: dict[str, Any] = {}
        self._closed = False
        self.last_version: int | None = None
        #: Seconds and bytes of the last send (publish to the last acknowledgement).
        self.last_send_seconds: float | None = None
        self.last_send_bytes = 0

    def _prepare(self, weights: WeightSet, timeout: float | None) -> tuple[Deadline, int, list[Any]]:
        """Check that ``weights`` may be sent now: the send's deadline, its version, and
        ``(name, tensor)`` pairs of contiguous tensors (the flat layout needs them)."""
        if self._closed:
            raise TransportError(f"{self.name} sender is closed")
        deadline = Deadline(self.default_timeout if timeout is None else timeout)
        version = int(weights.version)
        if self.last_version is not None and version <= self.last_version:
            raise ValueError(
                f"weight versions must strictly increase: got {version} after {self.last_version}"
            )
        tensors = [
            (name, t.detach() if t.is_contiguous() else t.detach().contiguous())
            for name, t in weights.items()
        ]
        return deadline, version, tensors

    def _take_events(self, ctl: Control, deadline: Deadline | None = None) -> list[dict[str, Any]]:
        """Every event queued now; the receivers that joined are registered. Returns the
        events, for those of the transport's own types."""
        events = ctl.pop_all(EVENTS, deadline)
        membership.log_refused(ctl, self.name)
        for ev in events:
            if ev.get("type") == "join":
                membership.admit(self._members, ev, self.member_class, self.name)
        return events


class StoreReceiver(TransportReceiver):
    """A receiver in a generator worker: registers with the sender's control store and
    keeps the last version it received whole in one buffer it reuses. The tensors
    :meth:`receive` yields are views of that buffer, valid until the next
    :meth:`receive` (copy them, as every generator does when it loads them)."""

    name = ""
    namespace = ""

    def __init__(
        self, options: Any, worker_id: str, host: str, port: int, timeout: float, secret: str
    ) -> None:
        self.options = options
        self._signer = Signer(secret)
        self.worker_id = worker_id
        self.host = host
        self.port = int(port)
        self.default_timeout = timeout
        self._ctl: Control | None = None
        self._nonce: str | None = None
        self._buffer: Any = None
        self._held: Layout | None = None
        self._closed = False
        #: (version, bytes received, bytes total) of the transfer in progress or last done.
        self.progress: tuple[int, int, int] | None = None

    def _register_now(self) -> None:
        """Register at once, so that the next send counts on this receiver; a sender that
        is not up yet is tried again by the first :meth:`receive`. One that refuses this
        receiver (another run's secret) is final: the receiver closes and raises."""
        try:
            self._register(Deadline(min(5.0, self.options.connect_timeout)))
        except STORE_ERRORS as exc:
            log.info(
                "%s receiver %s: sender not reachable yet (%s); will retry",
                self.name,
                self.worker_id,
                short(exc),
            )
            self._ctl = None
        except TransportError:
            self.close()
            raise

    def _connect(self, timeout: float) -> Control:
        """A connection to a sender that proved the secret (TransportError if not)."""
        ctl = Control.connect(self.host, self.port, self.namespace, timeout, self._signer)
        membership.check_sender(ctl)
        return ctl

    def _register(self, deadline: Deadline) -> None:
        if self._ctl is None:
            self._ctl = self._connect(max(0.05, min(self.options.connect_timeout, deadline.remaining())))
        self._nonce = membership.join(self._ctl, self.worker_id, self.host, deadline)

    def latest_version(self) -> int | None:
        """The newest version the sender published (for a generator that joins late)."""
        try:
            if self._ctl is None:
                self._ctl = self._connect(self.options.connect_timeout)
            latest = self._ctl.get(LATEST, Deadline(MAX_QUERY))
        except STORE_ERRORS as exc:
            raise TransportError(
                f"{self.name}: the sender at {self.host}:{self.port} is unreachable: {short(exc)}"
            ) from exc
        return None if latest is None else int(latest)

    def receive(self, version: int, timeout: float | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Wait for ``version`` and receive it completely; then yield views of it."""
        if self._closed:
            raise TransportError(f"{self.name} receiver {self.worker_id} is closed")
        deadline = Deadline(self.default_timeout if timeout is None else timeout)
        version = int(version)
        if self._held is not None and self._held.version == version:
            return self._held.views(self._buffer)
        return self._receive(version, deadline)

    def _receive(self, version: int, deadline: Deadline) -> Iterator[tuple[str, torch.Tensor]]:
        """Receive ``version`` (not the one held) by ``deadline``; views of it."""
        raise NotImplementedError

    # ------------------------------------------------------- what it says when it stops

    def _say_closed(self, why: str) -> None:
        """Tell the sender this incarnation is gone (it stops counting on it)."""
        if self._ctl is not None and self._nonce is not None:
            membership.say_closed(self._ctl, self._nonce, why, Deadline(1.0))

    def _dropped(self, ctl: Control, deadline: Deadline) -> str | None:
        """Why the sender dropped this incarnation (its ``closed`` key), or None while it
        counts on it. A sender that closed is an orderly end, not a drop: no point
        waiting, so that raises."""
        assert self._nonce is not None
        closed = ctl.get(membership.member_key(self._nonce, "closed"), deadline)
        if closed is None:
            return None
        if closed.decode() == SENDER_CLOSED:
            raise self._sender_closed()
        return closed.decode()

    def _sender_closed(self) -> TransportError:
        return TransportError(
            f"{self.name} receiver {self.worker_id}: the sender at {self.host}:{self.port} closed "
            "(the trainer finished or is restarting)"
        )

    def _superseded(self, version: int, newest: int, why: str) -> TransportError:
        return TransportError(
            f"{self.name} receiver {self.worker_id}: weights version {version} was superseded by "
            f"{newest} ({why}); receive {newest} instead (latest_version() tells it)"
        )

    def _timed_out(self, version: int, deadline: Deadline, last_error: str) -> TransportTimeout:
        return TransportTimeout(
            f"{self.name} receiver {self.worker_id}: weights version {version} did not arrive from the "
            f"sender at {self.host}:{self.port} within {deadline.seconds:g} s ({last_error}); "
            "is the trainer running?"
        )
