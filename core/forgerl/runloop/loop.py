"""The RL loop, driven by trainer rank 0.

Per step ``k``: take rollout batch ``k`` (made in a thread, overlapping training: by
:mod:`forgerl.rollouts.rollout` under ``loop.overlap: versioned``, by :mod:`forgerl.rollouts.overlap` under
``continuous``), drop samples staler than ``loop.max_staleness`` (counted from
their oldest token; ``loop.stale_samples: mask`` trains on their allowed tokens instead), compute
group-relative advantages, train on all ranks, export the new weights (version ``k+1``)
and push them through the transport into the generator, evaluate and checkpoint when due,
write one row of metrics.

A generator that declares ``receives_weights = False`` (it serves fixed weights) is never
sent any: the trainer's version still moves on with every step, the generator's stays at
0, and its samples are trained on whatever their version (off-policy, said once at start).
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any

from forgerl import events
from forgerl.checkpoints import checkpoint as ckpt
from forgerl.checkpoints.checkpoint_format import Snapshot, capture_rng, restore_rng
from forgerl.configuration.config import RunConfig
from forgerl.distill.scoring import TeacherScorer
from forgerl.errors import CheckpointError, CheckpointUnusable, ConfigError, RewardError
from forgerl.interfaces import Generator, RunContext, Task
from forgerl.registry.plugins import Registry
from forgerl.rollouts import problem_source
from forgerl.rollouts.env_rollouts import EnvironmentRollouts
from forgerl.rollouts.generator_idle import IdleClock, WatchedGenerator
from forgerl.rollouts.overlap import ContinuousBuffer, ContinuousProducer, default_in_flight
from forgerl.rollouts.problem_source import ProblemSource
from forgerl.rollouts.rollout import RolloutBatch, RolloutBuffer, RolloutProducer, Tokenizing
from forgerl.rollouts.staleness import age_counts, filter_stale, oldest_version
from forgerl.rundirs import runs
from forgerl.runloop.batching import Prepared, prepare_batch, tokens_by_age
from forgerl.runloop.distill_batch import distill_batch
from forgerl.runloop.evaluation import evaluate_samples, mean
from forgerl.runloop.metrics import MetricsWriter
from forgerl.runloop.reward_metrics import component_mean, per_source_metrics
from forgerl.runloop.spmd import TrainerDriver
from forgerl.samples.capture import Recorder
from forgerl.samples.redact import reward_secrets
from forgerl.types import Problem, SamplingParams, reserved_component_error

log = logging.getLogger("forgerl.runloop.loop")

PHASES = ("generate", "reward", "train", "sync", "eval", "checkpoint")

#: The rollout hand-over of either overlap mode, and the thread that fills it.
Buffer = RolloutBuffer | ContinuousBuffer
Producer = RolloutProducer | ContinuousProducer


class Interrupted(Exception):
    """SIGTERM/SIGINT arrived; the loop checkpoints and stops at the step boundary."""


class Loop:
    def __init__(
        self,
        config: RunConfig,
        registry: Registry,
        ctx: RunContext,
        driver: TrainerDriver,
        generator: Generator,
        task: Task,
        rewards: Any,
        sender: Any,
        tokenizer: Any,
        teacher: TeacherScorer | None = None,
        processor: Any = None,
    ):
        self.config = config
        self.registry = registry
        self.ctx = ctx
        self.run_dir = ctx.run_dir
        self.driver = driver
        self.generator = generator
        #: False for a generator that serves fixed weights (Generator.receives_weights).
        self.receives_weights = bool(getattr(type(generator), "receives_weights", True))
        self.task = task
        self.rewards = rewards
        self.sender = sender
        #: ``objective: distill``: scores each step's samples (None: the rewards' GRPO).
        self.teacher = teacher
        #: A vision-language model's processor renders prompts with images (None: text only).
        self.tokenizing = Tokenizing(
            tokenizer,
            processor,
            config.images.limits(),
            # No generator (a supervised run without evaluation) samples nothing: no image reaches it.
            images_refused=None if getattr(type(generator), "accepts_images", False) else (
                f"generator {config.generator.name!r} does not take images yet; use generator hf (docs/vision.md)"
            ),
        )
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.step = 0  # completed steps
        self.policy_version = 0
        self.time_totals = {p: 0.0 for p in PHASES}
        self.eval_start: float | None = None
        #: The whole evaluation before the first step (every eval/* key), for summary.json.
        self.eval_start_row: dict[str, float] | None = None
        self.eval_last: float | None = None
        self.stop_requested = threading.Event()
        self.last_batch_task_state: dict[str, Any] = {}
        self.pending_restored: list[RolloutBatch] = []
        #: Problems a checkpoint handed back (drawn, not yet in a batch): drawn first.
        self.requeued: list[Problem] = []
        #: The generator's idle time (time/generator_idle_frac); tests give it a clock.
        self.idle = IdleClock()
        #: Multi-turn rollouts through the configured environment; None: single-turn.
        self.environment = EnvironmentRollouts.from_config(
            config, registry, tokenizer, ctx.run_dir, context_length=_context_length(ctx.model_path),
            processor=processor,
        )
        #: What the model wrote, in <run_dir>/samples/ (None: logging.samples.enabled is off).
        self.samples = Recorder.for_run(
            config.logging.samples,
            run_dir=ctx.run_dir,
            tokenizer=tokenizer,
            seed=config.loop.seed,
            primary_reward=config.rewards[0].name,
            secrets=reward_secrets(config),
            sources=[s for s in (getattr(o, "secrets", None) for o in (generator, self.environment)) if callable(s)],
        )

    # -------------------------------------------------------------------- state

    def snapshot(self, task_state: dict[str, Any], pending: list[RolloutBatch]) -> Snapshot:
        """The loop's part of a checkpoint (JSON and arrays: nothing is pickled)."""
        rng, arrays = capture_rng()
        state = {
            "step": self.step,
            "policy_version": self.policy_version,
            "task_state": task_state,
            "next_rollout_index": self.step + len(pending),
            "time_totals": self.time_totals,
            "eval_start": self.eval_start,
            "eval_start_row": self.eval_start_row,
            "eval_last": self.eval_last,
            "rng": rng,
        }
        return Snapshot(state=state, rollouts=pending, arrays=arrays)

    def restore(self) -> Path | None:
        """Resume from the newest usable checkpoint (trainer on every rank, then the loop's
        state); returns its folder, or None when the run has no checkpoint yet."""
        found = ckpt.restore(
            self.run_dir, self.driver.load, keep=self.config.checkpoint.keep
        )
        if found is None:
            return None
        path, snap = found
        state = snap.state
        self.step = state["step"]
        self.policy_version = state["policy_version"]
        try:
            task_state, self.requeued = problem_source.split(state["task_state"])
        except ValueError as exc:
            raise CheckpointUnusable(f"{path / ckpt.LOOP_STATE}: {exc}") from None
        self.task.load_state_dict(task_state)
        self.time_totals.update(state["time_totals"])
        self.eval_start = state["eval_start"]
        self.eval_start_row = state.get("eval_start_row")  # absent from 0.2.0's checkpoints
        self.eval_last = state["eval_last"]
        # Task state after the last batch that exists (trained or pending): the producer
        # continues from there.
        self.last_batch_task_state = state["task_state"]
        try:
            restore_rng(snap)
        except CheckpointError as exc:
            raise CheckpointUnusable(f"{path / ckpt.LOOP_STATE}: {exc}") from None
        self.pending_restored = [self._with_images(b) for b in snap.rollouts]
        return path

    def _with_images(self, batch: RolloutBatch) -> RolloutBatch:
        """A restored batch with its prompts' images again: a checkpoint keeps token ids,
        not pixels. Each image prompt is rendered anew (the same files, the same
        processor) and must give the ids it had; an episode whose images cannot be had
        back is left out (one line), never trained on ids without their pixels."""
        from forgerl.errors import ImageError, NotSupported
        from forgerl.images import has_images

        kept = []
        for e in batch.episodes:
            if e.messages is not None and has_images(e.messages):
                # An environment's images came from its turns, which are not replayed.
                log.warning("restored trajectory of problem %r left out: its images are not in checkpoints", e.problem.id)
                continue
            if not has_images(e.problem.prompt):
                kept.append(e)
                continue
            try:
                ids, images = self.tokenizing.render(e.problem)
            except (ImageError, NotSupported) as exc:
                log.warning("restored sample of problem %r left out: %s", e.problem.id, exc)
                continue
            if ids != list(e.prompt_token_ids):
                log.warning("restored sample of problem %r left out: its images now render to other ids", e.problem.id)
                continue
            e.images = images
            kept.append(e)
        batch.episodes = kept
        return batch

    # -------------------------------------------------------------------- run

    def run(self) -> dict[str, Any]:
        cfg = self.config
        steps = cfg.loop.steps
        ckpt.clean_staging(self.run_dir)
        resume_from = self.restore()
        pending: list[RolloutBatch] = self.pending_restored
        if resume_from is not None:
            log.info("resumed from %s at step %d (policy version %d)", resume_from, self.step, self.policy_version)
        if self.samples is not None:
            # The steps after the checkpoint are made again: their records too, not beside the old ones.
            self.samples.resume(self.step if resume_from is not None else None)
        metrics = MetricsWriter(
            self.run_dir,
            hooks=self.registry.hooks,
            resume_step=self.step if resume_from is not None else None,
        )
        self.registry.hooks.run_start(config=cfg, run_dir=self.run_dir)
        if not self.receives_weights:
            said = (
                f"generator {cfg.generator.name!r} takes no weight updates: every rollout comes from "
                "the initial weights, so training is off-policy"
            )
            log.warning("%s", said)
            # Also on `forge run`'s progress output: the user chose the generator, not the log file.
            events.announce(said, stage="generator", state="warning", run_dir=self.run_dir)
        if resume_from is not None and self.policy_version > 0:
            # A fresh generator serves the base model (version 0): bring it to the
            # checkpoint's weights before it makes a single rollout.
            self.sync_weights(self.policy_version)

        source = ProblemSource(self.task, self.requeued)
        if not resume_from:
            self.last_batch_task_state = source.state_dict()
        buffer, producer = self.rollouts(source, pending)
        status = "completed"
        # The step the newest checkpoint holds: a stop right after a periodic checkpoint
        # needs no second one (a preemption's grace period is short).
        saved_step = self.step if resume_from is not None else None
        try:
            if self.step < steps:
                if self.evaluates() and cfg.loop.eval_at_start and self.step == 0 and self.eval_start is None:
                    with events.phase("evaluating the base model on the held-out problems", stage="eval",
                                      key=f"eval:{cfg.generator.name}:{cfg.model.name}", run_dir=self.run_dir):
                        row = self.evaluate()
                    self.eval_start, self.eval_start_row = row["eval/accuracy"], row
                    self.eval_last = self.eval_start
                producer.start()
                events.announce(f"training: steps {self.step + 1} to {steps}", stage="loop", state="start",
                                run_dir=self.run_dir, step=self.step, steps=steps)
            while self.step < steps:
                if self.stop_requested.is_set():
                    raise Interrupted()
                row, self.last_batch_task_state = self.train_one(buffer)
                due_eval = cfg.loop.eval_every and self.step % cfg.loop.eval_every == 0
                if self.evaluates() and (due_eval or self.step == steps):
                    row.update(self.evaluate())
                    self.eval_last = row["eval/accuracy"]
                # The row goes to metrics.jsonl before the checkpoint. A run killed between
                # the two resumes from the previous checkpoint, which drops this row and
                # redoes the step; the other order would lose the row of a step the
                # checkpoint holds. A failed checkpoint (CheckpointWriteError, a full disk)
                # leaves the row written too: the step happened, and resuming from the
                # previous checkpoint redoes it. Trackers (step_end) hear of it once saved.
                written = metrics.append(row)
                if (cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0) or self.step == steps:
                    t = time.perf_counter()
                    self.save(buffer, producer)
                    saved_step = self.step
                    self.time_totals["checkpoint"] += time.perf_counter() - t
                metrics.publish(self.step, written)
                if self.samples is not None and (recorded := self.samples.take()):
                    self.registry.hooks.step_samples(step=self.step, samples=recorded, run_dir=self.run_dir)
        except Interrupted:
            status = "interrupted"
            buffer.stop()
            if saved_step != self.step:
                t = time.perf_counter()
                self.save(buffer, producer)
                self.time_totals["checkpoint"] += time.perf_counter() - t
        except BaseException:
            status = "failed"
            raise
        finally:
            buffer.stop()
            if self.environment is not None:
                self.environment.close()  # an agent endpoint stops serving
            summary = self.summary(status)
            try:
                runs.atomic_write_text(self.run_dir / runs.SUMMARY_FILE, json.dumps(summary, indent=2))
            except OSError as exc:  # a full disk must not hide the error that ended the run
                log.warning("could not write %s: %s", runs.SUMMARY_FILE, exc)
            self.registry.hooks.run_end(summary=summary, run_dir=self.run_dir)
            metrics.close()
        return summary

    def rollouts(self, source: ProblemSource, pending: list[RolloutBatch]) -> tuple[Buffer, Producer]:
        """The buffer and the producer thread (not started) of ``loop.overlap``, continuing
        after the ``pending`` batches; the producer's generator reports to :attr:`idle`."""
        cfg = self.config.loop
        next_index = self.step + len(pending)
        generator = WatchedGenerator(self.generator, self.idle)
        sampling = SamplingParams(
            max_tokens=cfg.sampling.max_tokens,
            temperature=cfg.sampling.temperature,
            top_p=cfg.sampling.top_p,
            top_k=cfg.sampling.top_k,
        )
        buffer: Buffer
        producer: Producer
        if cfg.overlap == "continuous":
            buffer = ContinuousBuffer(
                prompts_per_step=cfg.prompts_per_step,
                max_staleness=cfg.max_staleness,
                max_in_flight=cfg.max_in_flight or default_in_flight(cfg.prompts_per_step, cfg.max_staleness),
                next_index=next_index,
                version=self.served_version(),
                task_state=source.task.state_dict(),
                requeued=list(source.requeued),
            )
            producer = ContinuousProducer(
                buffer=buffer,
                generator=generator,
                source=source,
                score=self.rewards.score,
                tokenizing=self.tokenizing,
                group_size=cfg.group_size,
                sampling=sampling,
                seed=cfg.seed,
                last_group=cfg.steps * cfg.prompts_per_step - 1,
            )
        else:
            buffer = RolloutBuffer(cfg.max_staleness, next_index=next_index, version=self.served_version())
            producer = RolloutProducer(
                buffer=buffer,
                generator=generator,
                source=source,
                score=self.rewards.score,
                tokenizing=self.tokenizing,
                prompts_per_step=cfg.prompts_per_step,
                group_size=cfg.group_size,
                sampling=sampling,
                seed=cfg.seed,
                start=next_index,
                last=cfg.steps - 1,
                environment=self.environment,
            )
        for b in pending:
            buffer.ready[b.index] = b
        return buffer, producer

    def train_one(self, buffer: Buffer) -> tuple[dict[str, Any], dict[str, Any]]:
        cfg = self.config
        S = cfg.loop.max_staleness
        k = self.step
        idle_mark = self.idle.mark()
        t_step = time.perf_counter()
        rollouts = buffer.get(k)
        wait_s = time.perf_counter() - t_step
        # A sample's staleness counts from its oldest token. Fixed weights (receives_weights
        # False) are never stale: nothing newer exists to sample.
        min_version = self.policy_version - S if self.receives_weights else None
        stale = filter_stale(rollouts.episodes, min_version=min_version, mode=cfg.loop.stale_samples)
        prepare: Callable[..., Prepared] = prepare_batch
        if self.teacher is not None:  # objective: distill (the one place the objective decides)
            prepare = partial(distill_batch, distill=cfg.distill, scorer=self.teacher)
        prepared = prepare(
            stale.kept,
            cfg.algorithm,
            max_tokens=self.max_completion_tokens(),
            pad_id=self.pad_id,
            trainer_version=self.policy_version,
            min_version=min_version,
        )
        ages = tokens_by_age(prepared.batch) if prepared.batch is not None else {}
        if self.samples is not None:
            # Before the step trains: a step that fails still shows what it was given.
            self.samples.train(rollouts.episodes, step=k + 1, trained={id(e) for e in stale.kept})
        t = time.perf_counter()
        train_metrics: dict[str, float] = {}
        if prepared.batch is not None:
            train_metrics = self.driver.train_step(prepared.batch)
        train_s = time.perf_counter() - t
        self.step += 1
        t = time.perf_counter()
        if isinstance(buffer, RolloutBuffer):
            # Versioned: every batch meant for the current version must be made before it
            # changes. (Continuous: the generator updates with its requests in flight.)
            buffer.wait_done_through(min(self.step - 1 + S, cfg.loop.steps - 1))
        sync_bytes = self.sync_weights(self.step)
        buffer.set_version(self.served_version())
        sync_s = time.perf_counter() - t
        for name, secs in (("generate", rollouts.gen_seconds), ("reward", rollouts.reward_seconds),
                           ("train", train_s), ("sync", sync_s)):
            self.time_totals[name] += secs
        eps = rollouts.episodes
        row: dict[str, Any] = {
            "step": self.step,
            # Wall-clock time (Unix seconds) of the step's end: `forge report` plots
            # against it, and a resumed run's gap shows as one.
            "time/wall": time.time(),
            "policy_version": self.policy_version,
            "reward/mean": mean(e.reward for e in eps),
            "reward/failed": rollouts.rewards_failed,
        }
        for name in sorted({n for e in eps for n in e.reward_components}):
            if f"reward/{name}" in row:  # refused where components are made; a Loop's own rewards object may not
                raise RewardError(f"a reward component is named {name!r}: {reserved_component_error(name)}")
            row[f"reward/{name}"] = component_mean(eps, name)
        row.update(per_source_metrics(eps))
        staleness = [self.policy_version - 1 - oldest_version(e.completion) for e in eps]
        row.update(
            {
                "staleness/mean": mean(staleness),
                "staleness/tokens_masked": stale.tokens_masked,
                "samples/dropped_stale": stale.dropped,
                "samples/trained": len(prepared.episodes),
                "groups/filtered_zero_variance": prepared.filtered_groups,
                "completion/mean_tokens": mean(len(e.completion.token_ids) for e in eps),
                "completion/truncated_frac": mean(e.completion.finish_reason == "length" for e in eps),
                "time/step": time.perf_counter() - t_step,
                "time/wait_rollouts": wait_s,
                "time/generate": rollouts.gen_seconds,
                "time/reward": rollouts.reward_seconds,
                "time/train": train_s,
                "time/sync": sync_s,
                "throughput/gen_tokens_per_s": rollouts.gen_tokens / max(rollouts.gen_seconds, 1e-9),
                "time/generator_idle_frac": self.idle.idle_frac(idle_mark),
            }
        )
        if sync_bytes is not None:
            row["sync/bytes"] = sync_bytes
        for age, tokens in age_counts(ages, S).items():
            row[f"staleness/tokens_age_{age}"] = tokens
        train_tokens = float(prepared.batch.attention_mask.sum()) if prepared.batch is not None else 0.0
        row["throughput/train_tokens_per_s"] = train_tokens / max(train_s, 1e-9)
        row.update(rollouts.extra)  # env/* with an environment; nothing otherwise
        row.update(prepared.metrics)  # distill/* and time/teacher under objective: distill
        row.update(train_metrics)
        return row, rollouts.task_state

    def max_completion_tokens(self) -> int:
        """The longest a sample's completion can be (overlong handling measures against it):
        a trajectory's tokens after its first prompt, else one completion's."""
        if self.environment is None:
            return self.config.loop.sampling.max_tokens
        if self.environment.sources is None:
            return self.config.environment.max_total_tokens
        # A mixture's other sources are single completions: the longer of the two bounds.
        return max(self.config.environment.max_total_tokens, self.config.loop.sampling.max_tokens)

    # -------------------------------------------------------------------- weights

    def served_version(self) -> int:
        """The version the rollout gate waits for: the generator's, or the trainer's when
        the generator takes no weights (its own never moves)."""
        return self.generator.policy_version if self.receives_weights else self.policy_version

    def sync_weights(self, version: int) -> int | None:
        """Export the trainer's weights as ``version`` and load them into the generator
        (only the version moves on when the generator takes no weights). Returns the bytes
        the transport moved (None: its sender does not count them)."""
        if not self.receives_weights:
            self.policy_version = version
            return 0
        weights = self.driver.export_weights(version)
        timeout = self.config.transport.timeout
        errors: list[BaseException] = []

        def receive() -> None:
            try:
                self.generator.update_weights(version)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)

        receiver = threading.Thread(target=receive, name="forge-weight-update", daemon=True)
        receiver.start()
        self.sender.send(weights, timeout=timeout)
        receiver.join(timeout + 5)
        if receiver.is_alive():
            from forgerl.errors import TransportTimeout

            raise TransportTimeout(f"the generator did not load weight version {version} within {timeout} s")
        if errors:
            raise errors[0]
        self.policy_version = version
        moved = getattr(self.sender, "last_send_bytes", None)
        return int(moved) if moved is not None else None

    # -------------------------------------------------------------------- eval

    def evaluates(self) -> bool:
        """Whether the run evaluates at all (an RL run always does; a supervised run only
        with ``sft.evaluate``, :class:`forgerl.runloop.sft_loop.SFTLoop`)."""
        return True

    def evaluate(self) -> dict[str, float]:
        """The held-out row (:mod:`forgerl.runloop.evaluation`), timed as the ``eval`` phase."""
        cfg = self.config
        t = time.perf_counter()
        problems = self.task.eval_problems()
        if cfg.loop.eval_size:
            problems = problems[: cfg.loop.eval_size]
        record = None
        if self.samples is not None:
            record = partial(self.samples.evaluation, step=self.step, policy_version=self.policy_version)
        row = evaluate_samples(cfg, problems, self.generator, self.rewards, self.tokenizing, record, self.environment)
        what = "problems"
        if self.environment is not None:
            what = "trajectories" if self.environment.sources is None else "problems and trajectories"
        self.time_totals["eval"] += time.perf_counter() - t
        log.info(
            "held-out accuracy after %d steps: %.4f (%d %s)", self.step, row["eval/accuracy"], row["eval/samples"], what
        )
        return row

    # -------------------------------------------------------------------- checkpoint

    def save(self, buffer: Buffer, producer: Producer) -> None:
        """Checkpoint at a step boundary: trainer state on all ranks, then the loop state,
        including rollouts already made for later steps (they were sampled from older
        weights than the checkpoint holds, so they cannot be made again after resume).
        A full disk or an unwritable folder raises CheckpointWriteError and leaves the
        previous checkpoint as the latest."""
        if isinstance(buffer, ContinuousBuffer):
            # Batches finished so far, and the task as drawn with every drawn problem not
            # in one of them handed back (forgerl.rollouts.problem_source): taken at one instant.
            pending, task_state = buffer.saved(self.step)
        else:
            pending = [b for b in buffer.pending() if b.index >= self.step]
            # The producer may be consuming the task right now: use the state recorded
            # with the last finished batch, never the live one.
            task_state = pending[-1].task_state if pending else self.last_batch_task_state
        ckpt.save(
            self.run_dir,
            self.step,
            self.snapshot(task_state, pending),
            self.driver.save,
            keep=self.config.checkpoint.keep,
        )

    def summary(self, status: str) -> dict[str, Any]:
        return {
            "status": status,
            "steps": self.step,
            "policy_version": self.policy_version,
            "eval_accuracy_start": self.eval_start,
            "eval_accuracy_end": self.eval_last,
            "eval_start": self.eval_start_row,
            "time": {k: round(v, 3) for k, v in self.time_totals.items()},
            "run_dir": str(self.run_dir),
        }


def _context_length(model_path: Path | None) -> int | None:
    """The model folder's context length, where its config.json gives one."""
    from forgerl.runloop.preflight import folder_context_length

    if model_path is None:
        return None
    try:
        return folder_context_length(Path(model_path))
    except ConfigError:
        return None


def install_stop_handlers(loop: Loop | None) -> None:
    """SIGTERM/SIGINT ask for a checkpoint and a clean stop at the next step boundary."""

    def handler(signum: int, frame: FrameType | None) -> None:  # noqa: ARG001
        if loop is not None:
            loop.stop_requested.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
