"""A supervised run's parts: which processes it needs, the checks before launch, and its
loop on trainer rank 0 (:func:`build_loop`, called by :mod:`forgerl.worker`).

A supervised run is a trainer-only job unless it evaluates (``sft.evaluate``): then it
has a generator (with its server roles, a transport, the rewards) exactly as an RL run
of the same config would, and the same job shape on every scheduler."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forgerl.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.config import RunConfig
    from forgerl.interfaces import Generator, RunContext, Task
    from forgerl.plugins import Registry
    from forgerl.sft.data import Demonstrations
    from forgerl.sft.loop import SFTLoop
    from forgerl.spmd import TrainerDriver

log = logging.getLogger("forgerl.sft")


def uses_generator(config: RunConfig) -> bool:
    """Whether the run samples (RL) or evaluates through a generator: only then does it
    start generator servers, a transport and the rewards."""
    return config.objective != "sft" or config.sft.evaluate


def uses_task(config: RunConfig) -> bool:
    """Whether the run builds its task: for problems, held-out problems or demonstrations."""
    return uses_generator(config) or config.sft.task_demonstrations


def check_before_run(config: RunConfig, registry: Registry, *, local_files: bool) -> None:
    """Before launch (:func:`forgerl.preflight.check_run`): the task gives demonstrations
    where they are asked of it, and the data files are there and hold demonstrations
    (where the run's processes see this machine's files)."""
    if config.objective != "sft":
        return
    if config.sft.task_demonstrations:
        task = registry.require("task", config.task.name).load_factory()
        gives = getattr(task, "gives_demonstrations", None)
        if not (callable(gives) and gives()):
            raise ConfigError(
                f"sft.task_demonstrations: task {config.task.name!r} gives no demonstrations (its class does not "
                "implement demonstration()); give sft.data files instead, or a task that does (arithmetic)"
            )
    if local_files and config.sft.data:
        from forgerl.sft.data import check_files

        check_files(config.sft)


def load_demonstrations(config: RunConfig, task: Task | None, tokenizer: Any, run_dir: Path) -> Demonstrations:
    """The run's demonstrations, rendered with ``tokenizer``: every row of the data files
    (a bad row is a DataError now, before the first step), or the task's worked answers."""
    from forgerl import events
    from forgerl.sft.data import FileExamples, TaskExamples, file_demonstrations, render_all
    from forgerl.sft.render import Renderer

    sft = config.sft
    renderer = Renderer(tokenizer, loss_on=sft.loss_on, max_length=sft.max_length, overlong=sft.overlong)
    if sft.task_demonstrations:
        assert task is not None, "a run with task demonstrations builds its task"
        return TaskExamples(task, renderer, config.task.name)
    with events.phase(f"reading and rendering {len(sft.data)} data file(s)", stage="data", run_dir=run_dir):
        examples, outcomes = render_all(file_demonstrations(sft), renderer)
    left_out = outcomes["too_long"] + outcomes["nothing_to_train"]
    said = (f"{len(examples)} demonstrations ({sum(len(e.input_ids) for e in examples)} tokens); "
            f"{outcomes['truncated']} truncated to sft.max_length={sft.max_length}, {left_out} left out")  # fmt: skip
    log.info("%s", said)
    events.announce(said, stage="data", state="warning" if left_out or outcomes["truncated"] else "info",
                    run_dir=run_dir)  # fmt: skip
    return FileExamples(examples, seed=config.loop.seed, shuffle=sft.shuffle, outcomes=outcomes)


def build_loop(
    config: RunConfig,
    registry: Registry,
    ctx: RunContext,
    driver: TrainerDriver,
    tokenizer: Any,
    *,
    task: Task | None,
    generator: Generator | None,
    rewards: Any,
    sender: Any,
) -> SFTLoop:
    """The loop of a supervised run on trainer rank 0."""
    from forgerl.sft.loop import SFTLoop

    data = load_demonstrations(config, task, tokenizer, ctx.run_dir)
    evaluation = task if config.sft.evaluate else None
    return SFTLoop(config, registry, ctx, driver, data, tokenizer, evaluation=evaluation, generator=generator,
                   rewards=rewards, sender=sender)  # fmt: skip
