"""Hook specifications of forgerl.

A plugin is a module (or object) with functions marked ``@hookimpl`` whose names match
these specs. Built-in backends are plugins too, registered through the same
``forgerl`` entry-point group as third-party ones. Every hook here is documented in
docs/hooks.md (a test checks).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    from pathlib import Path

    import click

    from forgerl.backends import (
        EnvironmentBackend,
        GeneratorBackend,
        ModelBackend,
        RewardBackend,
        SchedulerBackend,
        TaskBackend,
        TeacherBackend,
        TrainerBackend,
        TransportBackend,
    )
    from forgerl.configuration.config import RunConfig
    from forgerl.samples.records import SampleRecord

PROJECT = "forgerl"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

# --------------------------------------------------------------------------
# Backend registration. Called once each, when the registry is built; each
# returns the records of the backends the plugin provides (possibly none).
# --------------------------------------------------------------------------


@hookspec
def forge_generators() -> Iterable[GeneratorBackend]:
    """Generators selectable with ``--generator NAME``."""


@hookspec
def forge_trainers() -> Iterable[TrainerBackend]:
    """Trainers selectable with ``--trainer NAME``."""


@hookspec
def forge_rewards() -> Iterable[RewardBackend]:
    """Rewards selectable with ``--reward NAME`` (repeatable) or the ``rewards`` list."""


@hookspec
def forge_transports() -> Iterable[TransportBackend]:
    """Weight transports selectable with ``--transport NAME``."""


@hookspec
def forge_schedulers() -> Iterable[SchedulerBackend]:
    """Schedulers selectable with ``--scheduler NAME``."""


@hookspec
def forge_tasks() -> Iterable[TaskBackend]:
    """Tasks (prompt sources) selectable with ``--task NAME``."""


@hookspec
def forge_models() -> Iterable[ModelBackend]:
    """Named model sources selectable with ``--model NAME`` (besides local folders)."""


@hookspec
def forge_environments() -> Iterable[EnvironmentBackend]:
    """Environments (multi-turn, tool-using rollouts) selectable with ``--environment NAME``:
    subclasses of :class:`forgerl.environment.Environment`, or "module:Class" naming them."""


@hookspec
def forge_teachers() -> Iterable[TeacherBackend]:
    """Teachers for on-policy distillation, selected with ``distill.teacher.name``:
    subclasses of :class:`forgerl.distill.Teacher`, or "module:Class" naming them."""


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------


@hookspec
def forge_commands(cli: click.Group) -> None:
    """Add subcommands to ``forge``. Called once when the CLI starts, with the root group."""


# --------------------------------------------------------------------------
# Run events. Called on trainer rank 0 only, in the loop's process.
# --------------------------------------------------------------------------


@hookspec
def forge_run_start(config: RunConfig, run_dir: Path) -> None:
    """A run (or a resumed run) is about to take its first step."""


@hookspec
def forge_step_end(step: int, metrics: Mapping[str, float], run_dir: Path) -> None:
    """A training step finished; ``metrics`` is the row written to metrics.jsonl
    (e.g. forward it to an experiment tracker such as W&B)."""


@hookspec
def forge_step_samples(step: int, samples: Sequence[SampleRecord], run_dir: Path) -> None:
    """The sample records written since the last call (a step's, and any evaluation's), once
    the step's ``forge_step_end`` was called; not called when none were recorded (e.g. show
    them in an experiment tracker as a table)."""


@hookspec
def forge_run_end(summary: Mapping[str, Any], run_dir: Path) -> None:
    """The run ended (completed, failed or interrupted); ``summary`` has ``status``.
    Also called, with ``failed`` and an ``error`` line, when the run fails while starting
    (a backend that cannot be built): then no ``forge_run_start`` came before it."""
