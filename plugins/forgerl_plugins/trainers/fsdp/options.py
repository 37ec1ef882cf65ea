"""Options of the backends registered in forgerl_plugins.trainers.fsdp (imported only when validated)."""

from __future__ import annotations

from forgerl_plugins.trainers.shared.options import ShardedTrainerOptions


class FSDPTrainerOptions(ShardedTrainerOptions):
    """The shared trainer options; FSDP2 itself needs none (one unit per decoder layer)."""
