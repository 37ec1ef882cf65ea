"""How ``forge run``, ``forge sft`` and ``forge eval`` start a run: the options they share,
the config built from file, flags and ``--set``, the plan, the submission, and following
the job to its end (its exit status is the command's)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from forgerl.commands.session import registry
from forgerl.configuration.kinds import FLAGS
from forgerl.errors import ForgeError

_Command = TypeVar("_Command", bound=Callable[..., Any])

def config_options(f: _Command) -> _Command:
    """Options shared by `forge run` and `forge config show`."""
    opts = [
        click.argument("config_file", required=False, type=click.Path(dir_okay=False)),
        click.option("--generator", help="Generator backend (vllm, sglang, hf, ...)."),
        click.option("--trainer", help="Trainer backend (fsdp, torchtitan, ...)."),
        click.option("--transport", help="Weight transport (shm, nccl, rdma, ...)."),
        click.option("--scheduler", help="Scheduler (local, slurm, kubernetes, ...)."),
        click.option("--task", help="Task, the source of prompts (arithmetic, file, ...)."),
        click.option("--reward", "rewards", multiple=True, help="Reward (repeatable; replaces the configured list)."),
        click.option("--model", help="Named model (tiny, smollm2-135m-instruct), local folder or hub id."),
        click.option("--steps", type=click.IntRange(min=0), help="Training steps."),
        click.option("--output", help="Run directory (default runs/<timestamp>)."),
        click.option("--environment", help="Environment for multi-turn rollouts (calculator, guess, ...)."),
        click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Set any config key, e.g. loop.group_size=8."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def flags(kwargs: dict[str, Any]) -> dict[str, Any]:
    flags = {key: kwargs.get(key) for key in FLAGS}
    flags["rewards"] = list(kwargs.get("rewards") or ())
    return flags


def launch_options(f: _Command) -> _Command:
    """Options shared by `forge run` and `forge sft`: how the run starts and is followed."""
    opts = [
        click.option("--resume", "resume_dir", type=click.Path(file_okay=False),
                     help="Continue the run in this directory."),
        click.option("--restart", "restart_dir", type=click.Path(file_okay=False),
                     help="Train the run in this directory again from step 0 (it has no checkpoint); "
                     "its finished metrics rows are kept aside."),
        click.option("--dry-run", is_flag=True, help="Print what would be started or submitted; start nothing."),
        click.option("--wait/--no-wait", default=None,
                     help="Follow a submitted job to its end (default for local runs)."),
        click.option("--quiet", "-q", is_flag=True, help="No progress lines or bar (the summary is still printed)."),
    ]  # fmt: skip
    for opt in reversed(opts):
        f = opt(f)
    return f


def launch(
    config_file: str | None,
    sets: tuple[str, ...],
    resume_dir: str | None,
    restart_dir: str | None,
    dry_run: bool,
    wait: bool | None,
    quiet: bool,
    kwargs: dict[str, Any],
    base: dict[str, Any] | None = None,
) -> None:
    from forgerl import api
    from forgerl.configuration.config import build_config, read_yaml
    from forgerl.rundirs import runs

    if restart_dir is not None:
        if resume_dir is not None:
            from forgerl.errors import ConfigError

            raise ConfigError("give --resume (continue from the checkpoint) or --restart (from step 0), not both")
        resume_dir = restart_dir  # the same run directory and saved config; only the start differs
    refuse_conflicting_flags(config_file, resume_dir, kwargs.get("output"))
    plugin_registry = registry()
    if resume_dir:
        base = read_yaml(runs.existing_run_dir(resume_dir) / runs.CONFIG_FILE)
        base.pop("output", None)
        saved = build_config(base=base)
        given = build_config(sets=sets, flags=flags(kwargs), base=base)
        runs.check_resume_changes(saved, given, resume_dir)
    config = api.load_config(config_file, sets=sets, flags=flags(kwargs), registry=plugin_registry, base=base)
    plan = api.plan(config, registry=plugin_registry, resume_dir=resume_dir, create=not dry_run,
                    restart=restart_dir is not None)
    for note in plan.notes:
        click.echo(f"forge: {note}", err=True)
    if dry_run:
        click.echo(f"# run directory: {plan.run_dir}  (nothing was created)")
        click.echo(f"# scheduler: {plan.config.scheduler.name}")
        click.echo(plan.render())
        return
    from forgerl.events import events_size
    from forgerl.runloop.progress import follow_run, job_text

    progress = plan.config.logging.progress and not quiet
    events_from = events_size(plan.run_dir)
    handle = plan.scheduler.submit(plan.job)
    try:
        runs.write_submission(plan.run_dir, handle)
    except ForgeError:
        # Without submission.json nothing could find the job again: stop it, then say why.
        try:
            plan.scheduler.cancel(handle.job_id)
        except Exception:  # noqa: BLE001 - the disk error is the one to report
            pass
        raise
    if plan.scheduler.detached and not wait:
        click.echo(f"submitted {handle.job_id} to {handle.scheduler}; run directory {plan.run_dir}")
        click.echo(f"follow it with `forge status {plan.run_dir}` and `forge logs {plan.run_dir}`")
        return
    click.echo(f"run directory: {plan.run_dir}", err=True)
    if progress:
        verb = "submitted" if plan.scheduler.detached else "started"
        click.echo(f"forge: {verb} {job_text(plan.job)} with the {plan.config.scheduler.name} scheduler; "
                   f"logs in {plan.run_dir / 'logs'}", err=True)
    status = follow_run(plan.scheduler, handle, plan.run_dir, plan.config, progress=progress,
                        events_from=events_from)
    sys.exit(0 if status.exit_code in (0, None) and status.state.value == "completed" else (status.exit_code or 1))


def refuse_conflicting_flags(config_file: str | None, resume_dir: str | None, output: str | None) -> None:
    """Flags that would otherwise be silently ignored, or silently mean the default."""
    from forgerl.errors import ConfigError

    if output is not None and not output.strip():
        raise ConfigError("--output is empty: give the run directory, or leave --output out for runs/<timestamp>")
    if resume_dir is not None and not resume_dir.strip():
        raise ConfigError("--resume is empty: give the run directory of the run to continue")
    if resume_dir and config_file:
        raise ConfigError(
            f"give a config file or --resume, not both: a resumed run continues with {resume_dir}/config.yaml "
            "(change its settings with --set)"
        )
    if resume_dir and output is not None:
        raise ConfigError(
            f"--resume continues the run in {resume_dir}; --output is for new runs (leave one of them out)"
        )
