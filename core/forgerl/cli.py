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
from pathlib import Path
from typing import Any

import click

from forgerl import __version__
from forgerl.api_version import PLUGIN_API_VERSION
from forgerl.commands import config as config_commands
from forgerl.commands import fleet as fleet_command
from forgerl.commands import jobs as job_commands
from forgerl.commands import plugins as plugin_commands
from forgerl.commands import report as report_command
from forgerl.commands.launching import config_options, launch, launch_options
from forgerl.commands.samples import samples as samples_command
from forgerl.commands.session import State as _State
from forgerl.commands.session import fail as _fail
from forgerl.commands.session import registry as _registry
from forgerl.configuration.env import debug_enabled
from forgerl.errors import ForgeError

EXIT_USER_ERROR = 2


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

@cli.command()
@config_options
@launch_options
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
    launch(config_file, sets, resume_dir, restart_dir, dry_run, wait, quiet, kwargs)


@cli.command()
@config_options
@click.option("--data", multiple=True, metavar="FILE",
              help="JSONL or Parquet file of demonstrations (repeatable): messages, prompt + completion, or text rows.")
@click.option("--eval/--no-eval", "evaluate", default=None,
              help="Evaluate on the task's held-out problems through the generator (default: with --task).")
@launch_options
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
    launch(config_file, (*implied, *sets), resume_dir, restart_dir, dry_run, wait, quiet, kwargs)


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
    launch(config_file, (*implied, *sets), resume_dir, None, dry_run, wait, quiet, kwargs, base=base)



for _command in (plugin_commands.plugins, config_commands.config_group, job_commands.status, job_commands.logs,
                 job_commands.cancel, fleet_command.fleet, report_command.report, samples_command):
    cli.add_command(_command)


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
