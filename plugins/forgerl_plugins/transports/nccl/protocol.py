"""The ``nccl`` transport's keys in its control store, beyond the members' shared ones
(:mod:`forgerl_plugins.transports.common.membership`): what its sender and receiver
write for each other."""

from __future__ import annotations

from forgerl_plugins.transports.common.membership import member_key

NAMESPACE = "forgerl/nccl/"
META = "meta"  # the newest version's layout (JSON), for tools that only watch the store
#: What a receiver that stopped waiting puts in place of the offer it asked for; the
#: sender, finding it there, does not send (compare-and-set decides who was first).
WITHDRAWN = "withdrawn"


def offer_key(nonce: str, seq: int) -> str:
    """The sender's answer (a layout) to a member's request ``seq``."""
    return member_key(nonce, f"offer/{seq}")


def sums_key(nonce: str, seq: int) -> str:
    """The checksums of the chunks the sender broadcast in answer to request ``seq`` (a
    JSON list, one per chunk of the offered layout), written once every chunk's broadcast
    has started: the receiver compares them with what landed before it acknowledges."""
    return member_key(nonce, f"sums/{seq}")


def accept_key(nonce: str) -> str:
    """Where the sender says it forms a member's channel, and on which backend."""
    return member_key(nonce, "accept")


def group_prefix(nonce: str) -> str:
    """The full store prefix of the rendezvous of a member's channel (its process group)."""
    return NAMESPACE + member_key(nonce, "pg/")
