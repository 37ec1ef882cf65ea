"""The ``forge`` command.

Errors a user can fix are printed as one line (``forge: error: ...``) with exit status 2;
``--debug`` (or FORGE_DEBUG=1) shows the traceback instead. Nothing heavy is imported
until a command needs it: ``forge --help`` and ``forge plugins list`` never import torch.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from forgerl import __version__
from forgerl.api_version import PLUGIN_API_VERSION
from forgerl.commands.samples import samples as samples_command
from forgerl.configuration.env import debug_enabled
from forgerl.configuration.kinds import FLAGS, REGISTRATION_HOOKS
from forgerl.errors import ForgeError, NotSupported

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.backends import Backend
    from forgerl.interfaces import Scheduler
    from forgerl.registry.plugin_info import PluginInfo
    from forgerl.registry.plugins import Registry

_Command = TypeVar("_Command", bound=Callable[..., Any])

EXIT_USER_ERROR = 2


class _State:
    debug = False
    registry: Registry | None = None


def _registry() -> Registry:
    """The plugin registry, built once per command (plugins load once, hooks trace once)."""
    if _State.registry is None:
        from forgerl.registry.plugins import build_registry

        _State.registry = build_registry(collect=False)  # backends are collected when a command needs them
    return _State.registry


def _fail(message: str) -> None:
    # One line, whatever the message holds: a user error is never spread over lines.
    click.echo(f"forge: error: {' '.join(str(message).split())}", err=True)


class _Terminated(BaseException):
    """SIGINT, SIGTERM or SIGHUP arrived outside the local scheduler's supervision (which
    handles them itself): stop at once. A BaseException, so ``except Exception`` blocks on
    the way do not swallow it; not a KeyboardInterrupt, which click would turn into a
    blank line plus "Aborted!"."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated(signum)


# ----------------------------------------------------------------------------- root


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
@click.version_option(
    __version__, prog_name="forge", message=f"%(prog)s %(version)s (plugin API {PLUGIN_API_VERSION})"
)
def cli(debug: bool) -> None:
    """forgerl: reinforcement-learning post-training for language models.

    \b
    forge run                       the default demo (SmolLM2-135M on arithmetic, CPU)
    forge run --model tiny --steps 3
    forge run run.yaml --generator vllm --scheduler slurm
    forge sft --data demos.jsonl --output runs/sft     supervised fine-tuning (docs/sft.md)
    forge run --model runs/sft      RL from another run's weights
    forge eval runs/rl --k 8        pass@k of a run's checkpoint (docs/eval.md)
    forge plugins list              backends and whether they can run here
    forge report runs/A runs/B      plots of runs, overlaid, as one HTML page
    forge samples RUN_DIR --worst   what the model wrote, lowest reward first
    forge export RUN_DIR --output DIR   the trained model as a Hugging Face folder
    """
    _State.debug = _State.debug or debug


# ------------------------------------------------------------------------------ run

def _config_options(f: _Command) -> _Command:
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


def _flags(kwargs: dict[str, Any]) -> dict[str, Any]:
    flags = {key: kwargs.get(key) for key in FLAGS}
    flags["rewards"] = list(kwargs.get("rewards") or ())
    return flags


def _launch_options(f: _Command) -> _Command:
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


@cli.command()
@_config_options
@_launch_options
def run(
    config_file: str | None,
    sets: tuple[str, ...],
    resume_dir: str | None,
    restart_dir: str | None,
    dry_run: bool,
    wait: bool | None,
    quiet: bool,
    **kwargs: Any,
) -> None:
    """Run (or submit) a post-training run."""
    _launch(config_file, sets, resume_dir, restart_dir, dry_run, wait, quiet, kwargs)


@cli.command()
@_config_options
@click.option("--data", multiple=True, metavar="FILE",
              help="JSONL or Parquet file of demonstrations (repeatable): messages, prompt + completion, or text rows.")
@click.option("--eval/--no-eval", "evaluate", default=None,
              help="Evaluate on the task's held-out problems through the generator (default: with --task).")
@_launch_options
def sft(
    config_file: str | None,
    sets: tuple[str, ...],
    data: tuple[str, ...],
    evaluate: bool | None,
    resume_dir: str | None,
    restart_dir: str | None,
    dry_run: bool,
    wait: bool | None,
    quiet: bool,
    **kwargs: Any,
) -> None:
    """Supervised fine-tuning on demonstrations (docs/sft.md): a run like `forge run`'s, of
    objective sft. --task NAME names the task whose held-out problems evaluate the model
    (and whose worked answers are the demonstrations when no --data is given). Start RL
    from the result with `forge run --model runs/NAME`."""
    implied = ["objective=sft"]
    if data:
        # A file here is named absolutely: the run's processes may start elsewhere.
        named = [str(Path(d).resolve()) if Path(d).is_file() else d for d in data]
        implied.append(f"sft.data={json.dumps(named)}")
    elif kwargs.get("task"):
        implied.append("sft.task_demonstrations=true")
    if evaluate is None and kwargs.get("task"):
        evaluate = True
    if evaluate is not None:
        implied.append(f"sft.evaluate={'true' if evaluate else 'false'}")
    # Before the user's own --set values, which may refine them.
    _launch(config_file, (*implied, *sets), resume_dir, restart_dir, dry_run, wait, quiet, kwargs)


@cli.command("eval")
@click.argument("model", required=False)
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="A run config file to start from.")
@click.option("--task", help="Task whose held-out problems are evaluated (default: the run's, for a run).")
@click.option("--environment", help="Environment for multi-turn episodes (calculator, guess, ...).")
@click.option("--reward", "rewards", multiple=True, help="Reward (repeatable; default: the run's, for a run).")
@click.option("--k", "k", type=click.IntRange(min=1, max=1024), help="Samples per problem (default 1).")
@click.option("--temperature", type=click.FloatRange(min=0, max=100), help="Sampling temperature (loop.eval_temperature).")
@click.option("--problems", type=click.IntRange(min=0), help="Evaluate the first N held-out problems (0: all).")
@click.option("--confidence", type=click.FloatRange(min=0, max=1, min_open=True, max_open=True),
              help="Level of the confidence intervals (default 0.95).")
@click.option("--batch-size", type=click.IntRange(min=1), help="Samples generated and scored at once (default 64).")
@click.option("--generator", help="Generator backend (vllm, sglang, hf, ...).")
@click.option("--transport", help="Weight transport (shm, nccl, rdma, ...).")
@click.option("--scheduler", help="Scheduler (local, slurm, kubernetes, ...).")
@click.option("--output", help="Results directory (default runs/<timestamp>).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Set any config key, e.g. loop.sampling.max_tokens=256.")
@click.option("--resume", "resume_dir", type=click.Path(file_okay=False),
              help="Finish the evaluation in this directory (finished samples are kept, not redone).")
@click.option("--dry-run", is_flag=True, help="Print what would be started or submitted; start nothing.")
@click.option("--wait/--no-wait", default=None, help="Follow a submitted job to its end (default for local runs).")
@click.option("--quiet", "-q", is_flag=True, help="No progress lines (the summary is still printed).")
def eval_command(
    model: str | None,
    config_file: str | None,
    k: int | None,
    temperature: float | None,
    problems: int | None,
    confidence: float | None,
    batch_size: int | None,
    sets: tuple[str, ...],
    resume_dir: str | None,
    dry_run: bool,
    wait: bool | None,
    quiet: bool,
    **kwargs: Any,
) -> None:
    """Score a model on a task's held-out problems (docs/eval.md): k samples per problem,
    mean@k and pass@k with confidence intervals, per source and per reward component,
    written to DIR/eval_samples.jsonl and DIR/eval_summary.json. MODEL is a named model, a
    Hugging Face folder or a run (runs/NAME: its newest checkpoint, with its task, rewards
    and sampling). Generation goes through the generator and scheduler as `forge run`'s."""
    from forgerl.runloop import eval_command as ev

    ev.check_model_argument(model, resume_dir)
    base, note = ev.run_base(model) if model and resume_dir is None else (None, None)
    if note:
        click.echo(f"forge: {note}", err=True)
    kwargs["model"] = model
    implied = ev.implied_sets(k, temperature, problems, confidence, batch_size)
    _launch(config_file, (*implied, *sets), resume_dir, None, dry_run, wait, quiet, kwargs, base=base)


def _launch(
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
    _refuse_conflicting_flags(config_file, resume_dir, kwargs.get("output"))
    registry = _registry()
    if resume_dir:
        base = read_yaml(runs.existing_run_dir(resume_dir) / runs.CONFIG_FILE)
        base.pop("output", None)
        saved = build_config(base=base)
        given = build_config(sets=sets, flags=_flags(kwargs), base=base)
        runs.check_resume_changes(saved, given, resume_dir)
    config = api.load_config(config_file, sets=sets, flags=_flags(kwargs), registry=registry, base=base)
    plan = api.plan(config, registry=registry, resume_dir=resume_dir, create=not dry_run,
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


def _refuse_conflicting_flags(config_file: str | None, resume_dir: str | None, output: str | None) -> None:
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


# -------------------------------------------------------------------------- plugins


@cli.group()
def plugins() -> None:
    """Installed plugins and their backends."""


@plugins.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def plugins_list(as_json: bool) -> None:
    """Every plugin: distribution, version, hooks, backends and whether each can run here."""
    registry = _registry()
    rows: list[dict[str, Any]] = []
    for info in sorted(registry.listing().values(), key=lambda i: (not i.first_party, i.name, i.distribution)):
        rows.append(
            {
                "name": info.name,
                "distribution": info.distribution,
                "version": info.version,
                "status": info.status,
                "error": info.error,
                "hooks": info.hooks,
                "backends": [_backend_row(registry, info, b) for b in info.backends],
            }
        )
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for row in rows:
        head = f"{row['name']}  ({row['distribution']} {row['version']})"
        if row["status"] != "loaded":
            head += f"  [{row['status']}{': ' + row['error'] if row['error'] else ''}]"
        click.echo(head)
        for b in row["backends"]:
            mark = "ok " if b["available"] else "-- "
            why = "" if b["available"] else f"  (unavailable: {b['reason']})"
            click.echo(f"  {mark}{b['kind']:<11} {b['name']:<22} {b['description']}{why}")
        other = [h for h in row["hooks"] if h not in REGISTRATION_HOOKS.values()]
        if other:
            click.echo(f"     hooks: {', '.join(other)}")


def _backend_row(registry: Registry, info: PluginInfo, backend: Backend) -> dict[str, Any]:
    """One backend of one plugin; a name another plugin claims too cannot be used."""
    clash = registry.clash(backend.kind, backend.name)
    reason = clash.reason_for(info) if clash is not None else backend.unavailable_reason()
    return {
        "kind": backend.kind,
        "name": backend.name,
        "description": backend.description,
        "available": reason is None,
        "reason": reason,
        "clash": clash.message() if clash is not None else None,
    }


# --------------------------------------------------------------------------- config


@cli.group("config")
def config_group() -> None:
    """Show, validate and describe run configurations."""


@config_group.command("show")
@_config_options
def config_show(config_file: str | None, sets: tuple[str, ...], **kwargs: Any) -> None:
    """Print the resolved config (defaults < file < flags < --set), backend options filled in."""
    from forgerl import api
    from forgerl.registry.resolve import rewards_unused

    registry = _registry()
    config = api.load_config(config_file, sets=sets, flags=_flags(kwargs), registry=registry)
    text = config.to_yaml()
    unused = rewards_unused(config, registry)
    if unused is not None:
        # A YAML comment: the output still loads as the same config.
        text = text.replace("\nrewards:\n", f"\n# rewards: not used in this run: {unused}\nrewards:\n", 1)
    click.echo(text, nl=False)


@config_group.command("schema")
@click.option("--markdown", is_flag=True, help="The config reference (docs/config.md) instead.")
@click.option(
    "--builtin-only", is_flag=True, help="Leave out the options of third-party backends (as docs/config.md)."
)
def config_schema(markdown: bool, builtin_only: bool) -> None:
    """Print the JSON schema of the run config, every installed backend's options included."""
    from forgerl.registry import configdoc

    if markdown:
        click.echo(configdoc.render_markdown(_registry(), third_party=not builtin_only), nl=False)
        return
    click.echo(json.dumps(configdoc.json_schema(_registry(), third_party=not builtin_only), indent=2))


@config_group.command("validate")
@click.argument("config_file", type=click.Path(dir_okay=False))
def config_validate(config_file: str) -> None:
    """Check a config file: structure, backend names and every backend's options."""
    from forgerl import api

    api.load_config(config_file, registry=_registry())
    click.echo(f"{config_file}: ok")


# ------------------------------------------------------------------- jobs: status/logs/cancel


def _job_scheduler(job: str, scheduler_name: str | None) -> tuple[Scheduler, str, str]:
    from forgerl.api import job_scheduler

    return job_scheduler(job, scheduler_name, registry=_registry())


_scheduler_option = click.option("--scheduler", "scheduler_name", help="Scheduler of a bare job id.")


@cli.command()
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


@cli.command()
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


@cli.command()
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


# ---------------------------------------------------------------------------- fleet


@cli.command()
@click.option("--dir", "directory", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="The fleet's directory (its servers' endpoints and logs); runs attach to it.")
@click.option("--model", required=True, help="The base model, as a run's model.name names it.")
@click.option("--generator", default="vllm", show_default=True, help="Generator backend whose servers serve the fleet.")
@click.option("--max-adapters", type=click.IntRange(min=1, max=256), default=4, show_default=True,
              help="Adapters a server holds at once.")
@click.option("--max-rank", type=click.IntRange(min=1, max=512), default=16, show_default=True,
              help="The largest adapter rank a run may train.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="generator.options.* (and model.*) settings.")
def fleet(directory: Path, model: str, generator: str, max_adapters: int, max_rank: int, sets: tuple[str, ...]) -> None:
    """Start generator servers that several runs share, each training its own LoRA adapter
    (runs attach with --set generator.options.fleet=DIR). Serves until Ctrl-C or SIGTERM."""
    from forgerl.fleet import serve_fleet

    code = serve_fleet(_registry(), generator, directory, model=model, max_adapters=max_adapters,
                       max_rank=max_rank, sets=sets, say=click.echo,
                       fail=lambda line: click.echo(line, err=True))  # fmt: skip
    if code:
        sys.exit(code)


# --------------------------------------------------------------------------- report


@cli.command()
@click.argument("run_dirs", nargs=-1, required=True, metavar="RUN_DIR...")
@click.option("--output", "-o", type=click.Path(), help="File to write (default RUN_DIR/report.html for one run, "
              "./report.html for several); with --format png, a folder, or NAME.png for the overview alone.")
@click.option("--format", "fmt", type=click.Choice(["html", "png"]), default="html", show_default=True,
              help="One self-contained HTML page, or one PNG per plot.")
@click.option("--label", "labels", multiple=True, help="Name of each run in the plots, in order (default: "
              "the directory's name).")
def report(run_dirs: tuple[str, ...], output: str | None, fmt: str, labels: tuple[str, ...]) -> None:
    """Plot runs (finished, failed or still going): reward, accuracy, lengths, staleness,
    logprob gap, entropy, grad norm and time per step, against step and wall time; several
    runs are overlaid, with a table of their config differences."""
    from forgerl.report import build_report

    for path in build_report(list(run_dirs), output, fmt, list(labels)):
        click.echo(str(path))


cli.add_command(samples_command)


# ------------------------------------------------------------------------------ main


def _add_plugin_commands() -> None:
    # Loading plugins is cheap (registration modules import no backend), and plugins
    # may add subcommands, so it happens before the command line is parsed.
    try:
        _registry().hooks.commands(cli)
    except ForgeError:
        # A broken plugin set must not make `forge --help` unusable; the command that
        # needs the registry reports the error itself.
        pass


def _stop_on_termination() -> dict[int, Any]:
    """Turn SIGINT/SIGTERM/SIGHUP into :class:`_Terminated`; returns the handlers to restore.

    Without this, SIGTERM during start-up (reading the config, pre-flight checks) would
    kill forge without a word. A signal the user chose to ignore (nohup) or handles
    themselves (an embedding program) is left alone. Only the main thread can install
    handlers."""
    previous: dict[int, Any] = {}
    if threading.current_thread() is not threading.main_thread():
        return previous
    defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL, signal.SIGHUP: signal.SIG_DFL}
    for sig, default in defaults.items():
        handler = signal.getsignal(sig)
        if handler == default:
            previous[sig] = handler
            signal.signal(sig, _raise_terminated)
    return previous


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    _State.debug = "--debug" in args or debug_enabled()
    previous_handlers = _stop_on_termination()
    try:
        _add_plugin_commands()
        cli.main(args=args, prog_name="forge", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        # A mistyped flag or argument is a user error like any other: one line, status 2.
        hint = ""
        if isinstance(exc, click.UsageError) and exc.ctx is not None:
            hint = f" (see `{exc.ctx.command_path} --help`)"
        _fail(exc.format_message() + hint)
        sys.exit(EXIT_USER_ERROR)
    except click.exceptions.Abort:
        _fail("aborted")
        sys.exit(130)
    except ForgeError as exc:
        if _State.debug or not exc.user_fixable:
            raise
        _fail(str(exc))
        sys.exit(EXIT_USER_ERROR)
    except KeyboardInterrupt:
        _fail("interrupted")
        sys.exit(130)
    except _Terminated as exc:
        _fail("interrupted" if exc.signum == signal.SIGINT else f"stopped by {signal.Signals(exc.signum).name}")
        sys.exit(128 + exc.signum)
    finally:
        # In-process callers (tests, embedding) get their own handlers back.
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)


if __name__ == "__main__":  # pragma: no cover
    main()
