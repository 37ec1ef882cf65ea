"""A supervised run's loop on trainer rank 0 (:func:`build_loop`, called by
:mod:`forgerl.worker`): its demonstrations loaded and rendered, then :class:`SFTLoop`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.configuration.config import RunConfig
    from forgerl.interfaces import Generator, RunContext, Task
    from forgerl.registry.plugins import Registry
    from forgerl.runloop.sft_loop import SFTLoop
    from forgerl.runloop.spmd import TrainerDriver
    from forgerl.sft.data import Demonstrations

log = logging.getLogger("forgerl.sft")


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
    from forgerl.runloop.sft_loop import SFTLoop

    data = load_demonstrations(config, task, tokenizer, ctx.run_dir)
    evaluation = task if config.sft.evaluate else None
    return SFTLoop(config, registry, ctx, driver, data, tokenizer, evaluation=evaluation, generator=generator,
                   rewards=rewards, sender=sender)  # fmt: skip
