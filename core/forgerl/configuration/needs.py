"""Which parts of a run its objective needs (read by the job, the pre-flight checks and
the worker alike). A supervised run is a trainer-only job unless it evaluates
(``sft.evaluate``): then it has a generator (with its server roles, a transport, the
rewards) exactly as an RL run of the same config would, and the same job shape on every
scheduler."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.configuration.sections import RunConfig


def uses_generator(config: RunConfig) -> bool:
    """Whether the run samples (RL) or evaluates through a generator: only then does it
    start generator servers, a transport and the rewards."""
    return config.objective != "sft" or config.sft.evaluate


def uses_task(config: RunConfig) -> bool:
    """Whether the run builds its task: for problems, held-out problems or demonstrations."""
    return uses_generator(config) or config.sft.task_demonstrations


def uses_trainer(config: RunConfig) -> bool:
    """Whether the run builds its trainer: not an evaluation (``forge eval``), whose one
    worker drives the generator alone."""
    return config.objective != "eval"
