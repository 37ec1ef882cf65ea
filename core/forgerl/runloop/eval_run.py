"""What ``forge eval`` runs (``objective: eval``; docs/eval.md), on the one worker of its job
(:mod:`forgerl.worker`): the task's held-out problems (``loop.eval_size`` of them), ``eval.k``
samples each, drawn and scored by :func:`forgerl.runloop.evaluation.score_samples` (the run's
own held-out evaluation's code path), ``eval.batch_size`` samples at a time.

Each finished batch is appended to ``eval_samples.jsonl`` (one JSON object per sample) before
the next starts; a resumed evaluation (``forge eval --resume DIR``) reads the file first and
draws only the ``(problem, index)`` pairs it lacks, so nothing finished is generated or scored
again. At the end ``eval_summary.json`` holds mean@k, pass@k, the rewards and their
components with confidence intervals (:mod:`forgerl.runloop.eval_stats`), overall and per
source, and ``summary.json`` says how the run ended, as any run's does.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from forgerl.images.parts import without_pixels
from forgerl.runloop.evaluation import EvalSample, score_samples
from forgerl.types import source_of

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.configuration.config import RunConfig
    from forgerl.interfaces import Generator, RunContext, Task
    from forgerl.registry.plugins import Registry

log = logging.getLogger("forgerl.eval")

SAMPLES_FILE = "eval_samples.jsonl"
SUMMARY_FILE = "eval_summary.json"


def install_stop_handler() -> threading.Event:
    """SIGTERM/SIGINT end the evaluation after the batch in progress is written."""
    stop = threading.Event()

    def handler(signum: int, frame: FrameType | None) -> None:  # noqa: ARG001
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def record(sample: EvalSample, prompt: str, model: str) -> dict[str, Any]:
    """One line of the results file (the per-sample schema runs share; extra keys allowed)."""
    p = sample.problem
    source = _source(p)
    messages = sample.messages or (p.prompt if isinstance(p.prompt, list) else None)
    return {
        "kind": "eval",
        "step": 0,  # the weights as given, as a run's evaluation before its first step: `forge samples` reads these
        "policy_version": sample.policy_version,
        "problem_id": p.id,
        "group": sample.group,
        "index": sample.index,
        "source": source if isinstance(source, str) else None,
        "prompt": prompt,
        # A trajectory's conversation where an environment ran it (as a run's records), else
        # the chat prompt; images as their type and size, never their pixels.
        "messages": without_pixels(messages) if messages is not None else None,
        "completion": sample.completion,
        "reward": sample.result.value,
        "components": dict(sample.result.components),
        "advantage": None,
        "correct": bool(sample.correct),
        "finish_reason": sample.finish_reason,
        "error": sample.result.error,
        "prompt_tokens": sample.prompt_tokens,
        "completion_tokens": sample.completion_tokens,
        "answer": p.answer,
        "model": model,
    }


def _source(p: Any) -> Any:
    """The mixture source the problem came from (docs/data.md), else its metadata's ``source``."""
    return (source_of(p) or p.metadata.get("source")) if isinstance(p.metadata, dict) else None


def read_records(path: Path) -> list[dict[str, Any]]:
    """The finished samples of ``path`` (a line cut off by a kill is left out: redone)."""
    out: list[dict[str, Any]] = []
    try:
        text = path.read_text()
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("group"), int) and isinstance(row.get("index"), int):
            out.append(row)
    return out


def write_records(path: Path, rows: list[dict[str, Any]]) -> None:
    """Append ``rows`` and make them durable before the next batch starts. A file whose
    last line a kill cut off gets a newline first, so the torn line stays alone."""
    with open(path, "ab") as f:
        if f.tell() > 0:
            with open(path, "rb") as r:
                r.seek(-1, os.SEEK_END)
                if r.read(1) != b"\n":
                    f.write(b"\n")
        f.write(b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in rows))
        f.flush()
        os.fsync(f.fileno())


def batches(todo: list[tuple[int, int]], size: int) -> Iterator[list[tuple[int, int]]]:
    for start in range(0, len(todo), size):
        yield todo[start : start + size]


def run_eval(
    config: RunConfig,
    registry: Registry,
    ctx: RunContext,
    task: Task,
    generator: Generator,
    rewards: Any,
    tokenizer: Any,
    *,
    stop: threading.Event | None = None,
    processor: Any = None,
) -> dict[str, Any]:
    """Evaluate, resuming where the results file ends; returns (and writes) summary.json.
    ``processor``: a vision-language model's, for problems with images (docs/vision.md)."""
    from forgerl import events
    from forgerl.rollouts.env_rollouts import EnvironmentRollouts
    from forgerl.rollouts.rollout import Tokenizing
    from forgerl.rundirs import runs
    from forgerl.runloop.eval_stats import summarize
    from forgerl.samples.redact import Redactor, reward_secrets, run_keys

    run_dir = ctx.run_dir
    path = run_dir / SAMPLES_FILE
    problems = task.eval_problems()
    if config.loop.eval_size:
        problems = problems[: config.loop.eval_size]
    k = config.eval.k
    environment = EnvironmentRollouts.from_config(config, registry, tokenizer, run_dir, processor=processor)
    tokenizing = Tokenizing(tokenizer, processor, config.images.limits())
    # What a model writes can quote a key it saw: the run's keys and the rewards' tokens
    # never reach the results file (the redaction a run's own sample records get).
    redactor = Redactor(reward_secrets(config), [partial(run_keys, run_dir)])
    done = {(r["group"], r["index"]) for r in read_records(path)}
    todo = [(g, j) for g in range(len(problems)) for j in range(k) if (g, j) not in done]
    total = len(problems) * k
    said = f"evaluating {len(problems)} held-out problems x {k} samples"
    if done:
        said += f"; {total - len(todo)} samples already in {SAMPLES_FILE}, {len(todo)} to go"
    log.info("%s", said)
    events.announce(said, stage="eval", run_dir=run_dir)
    t0 = time.perf_counter()
    status = "completed"
    try:
        for pairs in batches(todo, config.eval.batch_size):
            if stop is not None and stop.is_set():
                status = "interrupted"
                break
            samples = score_samples(config, problems, pairs, generator, rewards, tokenizing, environment)
            redactor.refresh()
            write_records(path, [redactor.value(record(s, _prompt_text(s.problem, tokenizing), config.model.name))
                                 for s in samples])  # fmt: skip
            done.update(pairs)
            events.announce(f"{len(done)}/{total} samples scored", stage="eval", run_dir=run_dir)
    finally:
        if environment is not None:
            environment.close()
    rows = [r for r in read_records(path) if r["group"] < len(problems) and r["index"] < k]
    stats = summarize(_unique(rows), k, config.eval.confidence)
    stats.update({"model": config.model.name, "task": config.task.name, "environment": config.environment.name,
                  "temperature": config.loop.eval_temperature, "complete": status == "completed"})  # fmt: skip
    runs.atomic_write_text(run_dir / SUMMARY_FILE, json.dumps(stats, indent=2) + "\n")
    mean_k = stats[f"mean@{k}"]["mean"]
    summary: dict[str, Any] = {
        "status": status,
        "objective": "eval",
        "steps": 0,
        "policy_version": 0,
        "eval_accuracy_start": None,
        "eval_accuracy_end": mean_k,
        "eval_start": None,
        "eval": {key: stats[key] for key in ("problems", "samples", "k", f"mean@{k}", "pass")},
        "time": {"eval": round(time.perf_counter() - t0, 3)},
        "run_dir": str(run_dir),
    }
    runs.atomic_write_text(run_dir / runs.SUMMARY_FILE, json.dumps(summary, indent=2))
    try:
        registry.hooks.run_end(summary=summary, run_dir=run_dir)
    except Exception:
        log.exception("a forge_run_end hook failed")
    return summary


def _prompt_text(problem: Any, tokenizing: Any) -> str:
    """The prompt as text: a chat as the model's template renders it."""
    if isinstance(problem.prompt, str):
        return problem.prompt
    from forgerl.images import has_images
    from forgerl.images.parts import for_template

    if has_images(problem.prompt) and tokenizing.processor is not None:
        # The template's text, one placeholder per image (the pixels are not text).
        return str(tokenizing.processor.apply_chat_template(
            for_template(problem.prompt), add_generation_prompt=True, tokenize=False))  # fmt: skip
    return str(tokenizing.tokenizer.decode(tokenizing.prompt_ids(problem)))


def _unique(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per ``(group, index)``: the first written (a batch written twice, by a
    process killed between writing and exiting, counts once)."""
    seen: dict[tuple[int, int], dict[str, Any]] = {}
    for r in rows:
        seen.setdefault((r["group"], r["index"]), r)
    return list(seen.values())
