"""The ``nccl`` transport: broadcasts over private process groups (NCCL on GPU, gloo on CPU).

Shape (see docs/transports.md for the full protocol):

* The sender (trainer rank 0) hosts a ``TCPStore``, the control channel. Receivers connect
  to it (``receiver_spec()`` carries its host and port), register with their worker id and
  a fresh nonce, and say when they want the next version. Data never goes through it.
* Each receiver gets its own two-rank group with the sender (rank 0) — a *channel* —
  formed through the control store (its rendezvous values signed: :mod:`..common.auth`) the
  first time it asks. Per-receiver
  groups keep failures apart: a receiver that dies breaks only its own channel (a NCCL
  communicator cannot drop a dead member), a restarted one forms a new channel without
  disturbing the others, and nothing ever touches the default group the trainer's FSDP and
  the engine use.
* A version is laid out in one flat buffer (:mod:`..common.layout`) and moved in bucket-sized
  chunks; each chunk is packed once (or sent from the tensor's own memory when it is one
  big tensor) and broadcast on every channel that asked. A receiver receives into one
  buffer that it reuses across versions and yields views of it after the last chunk and
  its acknowledgement: never a partial version. Before acknowledging it has checked every
  chunk against the checksums the sender signs and sends after the chunks (each side sums
  while bytes are on the wire) and that the sender did not drop it meanwhile; the sender never repacks a staging buffer a dropped receiver's broadcast may
  still read (docs/reliability.md, "Weight transport stalls").
* A service thread in the sender forms channels and serves requests, so a receiver that
  joins late (a restarted generator) gets the current version without waiting for the
  next ``send``. ``send`` publishes a version and waits until every receiver registered
  at that moment has acknowledged it, or failed, or the timeout passed; it then raises
  naming the receivers that did not get it. The others have it; later versions go to
  whoever is alive.

The sender is :mod:`.sender`, the receiver :mod:`.receiver`; what they write for each
other in the store is :mod:`.protocol`, and what they share with the ``rdma`` transport
(the store itself, membership, layout, the secret) is :mod:`forgerl_plugins.transports.common`.

The sender keeps a reference to the tensors of the current version until the next
``send`` (late joiners need them): they must not be modified in place meanwhile — the
fsdp trainer's ``export_weights`` returns fresh tensors.
"""

from __future__ import annotations

from typing import Any, TypeAlias

from forgerl.interfaces import EngineReceiver, Transport
from forgerl_plugins.transports.common.hosting import StoreHostedTransport
from forgerl_plugins.transports.nccl import groups
from forgerl_plugins.transports.nccl.engine import EngineBoard, NcclBroadcastEngineReceiver
from forgerl_plugins.transports.nccl.options import Options as _Options
from forgerl_plugins.transports.nccl.protocol import NAMESPACE
from forgerl_plugins.transports.nccl.receiver import NcclReceiver
from forgerl_plugins.transports.nccl.sender import NcclSender

__all__ = ["NcclReceiver", "NcclSender", "NcclTransport"]


class NcclTransport(StoreHostedTransport, Transport):
    """Factory ``NcclTransport(options, *, context)``. On the trainer, ``sender()`` starts the
    control store; ``receiver_spec()`` tells receivers in other processes where it is.
    In a receiver's process build it with ``context=None`` and pass that spec."""

    name = "nccl"
    description = "broadcast from trainer rank 0 over private process groups (gloo on CPU)"
    requires = ("torch",)

    #: The options model, in a module of its own that the parts import (not this class).
    Options: TypeAlias = _Options

    @staticmethod
    def local_preflight(options: NcclTransport.Options) -> None:
        groups.local_preflight(options)

    namespace = NAMESPACE

    sender_class = NcclSender
    receiver_class = NcclReceiver

    engine_receivers = ("broadcast",)

    def __init__(self, options: Any, *, context: Any = None) -> None:
        super().__init__(options, context=context)
        self._engines = EngineBoard()

    def sender(self) -> NcclSender:
        sender = super().sender()
        sender.engines = self._engines
        return sender

    def engine_receiver(self, worker_id: str, kind: str, *, ranks: int = 1) -> EngineReceiver:
        """``broadcast``: a group of the engine's own with this process's sender (:mod:`.engine`)."""
        if kind != "broadcast":
            return super().engine_receiver(worker_id, kind, ranks=ranks)
        return NcclBroadcastEngineReceiver(
            self._engines, worker_id, ranks, self.options.backend, self.store_host,
            self.options.bucket_mb * 2**20, self.default_timeout(),
        )  # fmt: skip
