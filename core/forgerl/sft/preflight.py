"""What ``forge run`` checks of a supervised run before anything is created
(:func:`forgerl.runloop.preflight.check_run` calls :func:`check_before_run`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from forgerl.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.configuration.sections import RunConfig
    from forgerl.registry.plugins import Registry


def check_before_run(config: RunConfig, registry: Registry, *, local_files: bool) -> None:
    """Before launch (:func:`forgerl.runloop.preflight.check_run`): the task gives demonstrations
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
