"""What every trainer rank runs: ``python -m forgerl.worker --run-dir DIR``.

The scheduler starts it with the torch.distributed environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT). Every rank builds the trainer; rank 0 also builds the task,
rewards, transport and generator and drives the loop; other ranks follow rank 0.
Exit status: 0 completed, 2 a user-fixable error (one line on stderr), 143 stopped by
SIGTERM/SIGINT after checkpointing, 1 anything else (with a traceback in the log).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import logging
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from forgerl.configuration.env import debug_enabled
from forgerl.errors import ForgeError

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.interfaces import Trainer
    from forgerl.registry.plugins import Registry
    from forgerl.runloop.spmd import TrainerDriver


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="forgerl.worker")
    parser.add_argument("--run-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    # A crash in native code (an abort in a collective library) prints every thread's
    # Python stack into the rank's log, so the log says where it happened.
    faulthandler.enable()
    try:
        return run_worker(args.run_dir.resolve())
    except ForgeError as exc:
        if not exc.user_fixable or debug_enabled():
            raise
        _say(f"forge: error: {exc}")
        return 2


def _say(line: str) -> None:
    """Print the error line to stderr (the rank's log). On a full disk even that can fail:
    the exit status (2) still says it was the user's to fix, and ``forge run`` reports a
    full disk itself; an OSError here must not turn it into a crash."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass


def exit_now(code: int) -> NoReturn:
    """End a worker whose parts are all closed without running interpreter finalization.

    Finalization tears down torch's C++ objects (process-group threads, pending work
    holding tensors) and Python's in no fixed order. Once in CI a gloo trainer rank that
    had done all its work aborted on the way out (SIGABRT, 'terminate called without an
    active exception'; not reproduced in 60 runs here), failing a finished run. Nothing
    is lost by skipping it: checkpoints, metrics and logs are written and closed by now.
    It recurred in a rank of the trainer kit's two-rank check (TorchTitan, rank 1, after
    its results were due), which now ends through here too (forgerl.testing.trainer_rank).
    If it recurs elsewhere, faulthandler prints the stack into the rank's log."""
    for finish in (logging.shutdown, sys.stdout.flush, sys.stderr.flush):
        try:
            finish()
        except OSError:  # a full disk under the log: the exit status must still be ``code``
            pass
    os._exit(code)


def run_worker(run_dir: Path) -> int:
    from forgerl import events
    from forgerl.deprecation import ForgeDeprecationWarning
    from forgerl.registry.plugins import build_registry
    from forgerl.rundirs import runs

    if os.environ.get("RANK", "0") == "0":
        # A plugin's use of a deprecated name goes to this rank's log: say it where the user looks.
        events.forward_warnings(ForgeDeprecationWarning, run_dir=run_dir)
    registry = build_registry()
    config = runs.load_config(run_dir, registry)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    logging.basicConfig(
        level=config.logging.level.upper(),
        format=f"%(asctime)s rank{rank} %(name)s %(levelname)s: %(message)s",
        stream=sys.stderr,
    )
    log = logging.getLogger("forgerl.worker")
    if rank == 0:
        events.announce(f"started (pid {os.getpid()}); importing torch", stage="worker", run_dir=run_dir)

    import torch

    # Ranks share the machine's cores; without this each rank starts one thread per core.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    torch.manual_seed(config.loop.seed)

    from forgerl.interfaces import RunContext
    from forgerl.models.resolve import resolve_model
    from forgerl.runloop.spmd import TrainerDriver

    # On rank 0, a run that fails before its loop starts (a backend whose module does not
    # import, a model that cannot be built) still ends like any run: summary.json says
    # failed and forge_run_end hears of it.
    starting = _ends_run_if_start_fails(registry, run_dir, log) if rank == 0 else contextlib.nullcontext()
    with starting:
        with _phase(rank, run_dir, f"preparing model {config.model.name}", stage="model",
                    key=f"model:{config.model.name}", detail="a named model is built or converted on first use only"):
            model_path = resolve_model(config.model, registry)
        ctx = RunContext.for_run(config, run_dir, model_path=model_path, rank=rank, world_size=world)
        if config.objective == "eval":  # forge eval: one worker, the generator alone
            return _run_eval(config, registry, ctx, model_path, log)
        log.info("model %s; trainer %s on %d rank(s)", model_path, config.trainer.name, world)
        with _phase(rank, run_dir, f"building trainer {config.trainer.name} on {world} rank(s)", stage="trainer",
                    key=f"trainer:{config.trainer.name}:{config.model.name}"):
            trainer = registry.require("trainer", config.trainer.name).build(config.trainer.options, context=ctx)

    if rank != 0:
        # Rank 0 decides when to stop (after checkpointing): ignore the scheduler's
        # SIGTERM here so that the checkpoint's collectives can finish.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            _follow_rank0(trainer, log)
        finally:
            trainer.close()
        return 0

    from transformers import AutoTokenizer

    from forgerl.configuration.needs import uses_generator, uses_task
    from forgerl.rewards.rewarding import RewardSet
    from forgerl.runloop.loop import Loop, install_stop_handlers

    driver = TrainerDriver(trainer, world)
    generator = sender = transport = rewards = teacher = None
    task = None
    try:
        with _ends_run_if_start_fails(registry, run_dir, log):
            if uses_task(config):
                task = registry.require("task", config.task.name).build(
                    config.task.options, seed=config.loop.seed
                )
            # A supervised run that does not evaluate samples nothing: no generator.
            if uses_generator(config):
                rewards = RewardSet.from_config(config, registry)
                transport = registry.require("transport", config.transport.name).build(
                    config.transport.options, context=ctx
                )
                sender = transport.sender()
                with events.phase(f"starting generator {config.generator.name}", stage="generator", run_dir=run_dir,
                                  key=f"generator:{config.generator.name}:{config.model.name}"):
                    generator = registry.require("generator", config.generator.name).build(
                        config.generator.options, context=ctx, transport=transport
                    )
            tokenizer = AutoTokenizer.from_pretrained(model_path)
            loop: Loop
            if config.objective == "sft":
                from forgerl.runloop.sft_run import build_loop

                loop = build_loop(config, registry, ctx, driver, tokenizer, task=task, generator=generator,
                                  rewards=rewards, sender=sender)  # fmt: skip
            else:
                assert generator is not None and task is not None, "an RL run builds its generator and task"
                teacher = _build_teacher(config, registry, ctx)
                from forgerl.images.render import load_processor

                loop = Loop(config, registry, ctx, driver, generator, task, rewards, sender, tokenizer, teacher,
                            processor=load_processor(model_path))  # fmt: skip
            install_stop_handlers(loop)
        summary = loop.run()  # writes summary.json and calls forge_run_end itself
    finally:
        # If shutting down hangs (a stuck collective or thread), say where in the log.
        faulthandler.dump_traceback_later(60, exit=False)
        _stop_other_ranks(driver, log)
        for part in (teacher, rewards, generator, sender, transport, trainer):
            if part is not None:
                try:
                    part.close()
                except Exception:
                    log.exception("closing %s failed", type(part).__name__)
        faulthandler.cancel_dump_traceback_later()
    return 143 if summary["status"] == "interrupted" else 0


def _run_eval(config: Any, registry: Registry, ctx: Any, model_path: Path, log: logging.Logger) -> int:
    """``objective: eval`` (``forge eval``): task, rewards, transport and generator as an RL
    run builds them, then :func:`forgerl.runloop.eval_run.run_eval` instead of a loop."""
    from transformers import AutoTokenizer

    from forgerl import events
    from forgerl.images.render import load_processor
    from forgerl.rewards.rewarding import RewardSet
    from forgerl.runloop.eval_run import install_stop_handler, run_eval

    run_dir = ctx.run_dir
    generator = transport = rewards = None
    try:
        with _ends_run_if_start_fails(registry, run_dir, log):
            task = registry.require("task", config.task.name).build(config.task.options, seed=config.loop.seed)
            rewards = RewardSet.from_config(config, registry)
            transport = registry.require("transport", config.transport.name).build(
                config.transport.options, context=ctx
            )
            with events.phase(f"starting generator {config.generator.name}", stage="generator", run_dir=run_dir,
                              key=f"generator:{config.generator.name}:{config.model.name}"):  # fmt: skip
                generator = registry.require("generator", config.generator.name).build(
                    config.generator.options, context=ctx, transport=transport
                )
            tokenizer = AutoTokenizer.from_pretrained(model_path)
            processor = load_processor(model_path)  # a VLM's, for prompts with images
            stop = install_stop_handler()
        summary = run_eval(config, registry, ctx, task, generator, rewards, tokenizer, stop=stop,
                           processor=processor)  # fmt: skip
    finally:
        for part in (rewards, generator, transport):
            if part is not None:
                try:
                    part.close()
                except Exception:
                    log.exception("closing %s failed", type(part).__name__)
    return 143 if summary["status"] == "interrupted" else 0


def _build_teacher(config: Any, registry: Registry, ctx: Any) -> Any:
    """The teacher of ``objective: distill`` (its scorer, with the run's timeout); None
    otherwise. A served teacher's client waits here until its server is ready."""
    if config.objective != "distill":
        return None
    from forgerl import events
    from forgerl.distill.scoring import TeacherScorer
    from forgerl.distill.tokenizers import check_teacher_tokenizer

    # Again here: `forge run` checks before launch only where it sees the run's files (not
    # on a Kubernetes cluster); equal tokenizer files make it a byte comparison.
    check_teacher_tokenizer(config, registry)
    choice = config.distill.teacher
    with events.phase(f"starting teacher {choice.name}", stage="teacher", run_dir=ctx.run_dir,
                      key=f"teacher:{choice.name}"):  # fmt: skip
        teacher = registry.require("teacher", choice.name).build(choice.options, context=ctx)
    return TeacherScorer(teacher, timeout=config.distill.timeout)


def _phase(rank: int, run_dir: Path, message: str, **kw: Any) -> contextlib.AbstractContextManager[object]:
    """A progress event (:mod:`forgerl.events`) from rank 0; every rank does the work."""
    from forgerl import events

    return events.phase(message, run_dir=run_dir, **kw) if rank == 0 else contextlib.nullcontext()


@contextlib.contextmanager
def _ends_run_if_start_fails(registry: Registry, run_dir: Path, log: logging.Logger) -> Iterator[None]:
    """Write summary.json (status ``failed``, or ``interrupted`` for Ctrl-C) and call
    ``forge_run_end`` when the body raises, then let the error go on: a tracker plugin
    closes its run and the user finds why in the run directory, as for a run that failed
    later. A summary the run had before (one being resumed) keeps its step counts."""
    try:
        yield
    except BaseException as exc:
        status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
        summary = _start_failure_summary(run_dir, status, exc)
        from forgerl.rundirs import runs

        try:
            runs.atomic_write_text(run_dir / runs.SUMMARY_FILE, json.dumps(summary, indent=2))
        except OSError as write_error:  # a full disk must not hide the error that ended the run
            log.warning("could not write %s: %s", runs.SUMMARY_FILE, write_error)
        try:
            registry.hooks.run_end(summary=summary, run_dir=run_dir)
        except Exception:
            log.exception("a forge_run_end hook failed")
        raise


def _start_failure_summary(run_dir: Path, status: str, exc: BaseException) -> dict[str, Any]:
    """The keys of :meth:`forgerl.runloop.loop.Loop.summary`, plus ``error`` (one line)."""
    from forgerl.rundirs import runs

    try:
        before = json.loads((run_dir / runs.SUMMARY_FILE).read_text())
        before = before if isinstance(before, dict) else {}
    except (OSError, ValueError):
        before = {}
    error = str(exc) if isinstance(exc, ForgeError) and exc.user_fixable else f"{type(exc).__name__}: {exc}"
    return {
        "status": status,
        "steps": before.get("steps", 0),
        "policy_version": before.get("policy_version", 0),
        "eval_accuracy_start": before.get("eval_accuracy_start"),
        "eval_accuracy_end": before.get("eval_accuracy_end"),
        "eval_start": before.get("eval_start"),
        "time": {},
        "run_dir": str(run_dir),
        "error": " ".join(error.split()),
    }


def _follow_rank0(trainer: Trainer, log: logging.Logger) -> None:
    """Ranks > 0 run rank 0's calls until it says stop. A checkpoint that failed on every
    rank at once (full disk; a checkpoint the trainer refuses while resuming) is rank 0's
    to report and act on: it writes the step's metrics and stops the run, or tries an
    earlier checkpoint. So keep following instead of dying with a second error."""
    from forgerl.errors import CheckpointError
    from forgerl.runloop.spmd import follow

    while True:
        try:
            follow(trainer)
            return
        except CheckpointError as exc:
            log.warning("%s (rank 0 decides what happens next)", exc)


def _stop_other_ranks(driver: TrainerDriver, log: logging.Logger) -> None:
    """Tell ranks > 0 to stop. When one of them is dead (killed, crashed) this fails at
    once (gloo: connection reset); say so instead of hiding the error that ended the run
    behind a second traceback. The scheduler reports which rank died."""
    try:
        driver.stop()
    except Exception as exc:  # noqa: BLE001 - the run is ending; this must not mask why
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        log.error("could not reach the other trainer ranks to stop them (one is gone?): %s", first[:300])


if __name__ == "__main__":
    exit_now(main())
