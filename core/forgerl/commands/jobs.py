"""``forge status``, ``forge logs`` and ``forge cancel`` of a submitted run (a run directory,
or a job id with ``--scheduler``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from forgerl.commands.session import registry
from forgerl.errors import NotSupported

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.interfaces import Scheduler


def _job_scheduler(job: str, scheduler_name: str | None) -> tuple[Scheduler, str, str]:
    from forgerl.api import job_scheduler

    return job_scheduler(job, scheduler_name, registry=registry())


_scheduler_option = click.option("--scheduler", "scheduler_name", help="Scheduler of a bare job id.")


@click.command()
@click.argument("job")
@_scheduler_option
def status(job: str, scheduler_name: str | None) -> None:
    """State of a submitted run (a run directory, or a job id with --scheduler)."""
    scheduler, job_id, _ = _job_scheduler(job, scheduler_name)
    st = scheduler.status(job_id)
    line = f"{job_id}: {st.state.value}"
    if st.exit_code is not None:
        line += f" (exit {st.exit_code})"
    if st.detail:
        line += f" - {st.detail}"
    click.echo(line)


@click.command()
@click.argument("job")
@_scheduler_option
@click.option("--role", help="Only this role's logs.")
def logs(job: str, scheduler_name: str | None, role: str | None) -> None:
    """Logs of a submitted run."""
    scheduler, job_id, name = _job_scheduler(job, scheduler_name)
    if not scheduler.supports_logs:
        where = Path(job) / "logs" if Path(job).is_dir() else "the run directory's logs/ folder"
        raise NotSupported(f"scheduler {name!r} cannot show logs; read the files in {where}")
    for line in scheduler.logs(job_id, role=role):
        click.echo(line.rstrip("\n"))


@click.command()
@click.argument("job")
@_scheduler_option
def cancel(job: str, scheduler_name: str | None) -> None:
    """Stop a submitted run."""
    scheduler, job_id, _ = _job_scheduler(job, scheduler_name)
    st = scheduler.status(job_id)
    if st.state.finished:  # nothing is stopped or rewritten: the outcome stays what it was
        exit_code = "" if st.exit_code is None else f" (exit {st.exit_code})"
        click.echo(f"{job_id} had already finished: {st.state.value}{exit_code}; nothing to cancel")
        return
    scheduler.cancel(job_id)
    click.echo(f"cancelled {job_id}")
