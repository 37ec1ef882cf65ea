"""``forge samples RUN_DIR``: what the model wrote, read from the run's sample records."""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.samples.records import SampleRecord

#: Characters of a prompt shown without --full (its end: where the question usually is).
PROMPT_CHARS = 400


@click.command("samples")
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--step", type=click.IntRange(min=0), help="Only this step (0: the evaluation before training).")
@click.option("--kind", type=click.Choice(["train", "eval"]), help="Only training or only held-out samples.")
@click.option("--worst", "order", flag_value="worst", help="Lowest reward first.")
@click.option("--best", "order", flag_value="best", help="Highest reward first.")
@click.option("--failed", is_flag=True, help="Only samples a reward or the environment failed.")
@click.option("--grep", "grep", metavar="TEXT", help="Only samples whose prompt, messages, completion or error "
              "contain TEXT (any case).")
@click.option("--limit", "-n", type=click.IntRange(min=1), default=20, show_default=True,
              help="Most samples shown.")
@click.option("--full", is_flag=True, help="Show whole prompts (default: their last characters).")
@click.option("--json", "as_json", is_flag=True, help="Print the matching records as JSON lines.")
@click.option("--correct", is_flag=True, help="Only samples the primary reward calls correct.")
@click.option("--min-reward", type=float, metavar="X", help="Only samples with a reward of at least X.")
@click.option("--export", "export", metavar="FILE", help="Write the matching samples as SFT rows (JSONL, TRL's "
              "formats; `forge sft --data FILE` trains on them) instead of showing them; '-': standard output. "
              "Takes training samples unless --kind says (a `forge eval` folder: its own).")
@click.option("--best-k", type=click.IntRange(min=1), metavar="K", help="With --export: at most K rows per "
              "problem, the highest rewards.")
def samples(run_dir: str, step: int | None, kind: str | None, order: str | None, failed: bool, grep: str | None,
            limit: int, full: bool, as_json: bool, correct: bool, min_reward: float | None, export: str | None,
            best_k: int | None) -> None:
    """Show what the model wrote during a run: each sample's prompt, completion, reward and
    its components, advantage, policy version, finish reason and failure (recorded in
    RUN_DIR/samples/; docs/samples.md). With --export, write them as supervised data
    (rejection-sampling fine-tuning: docs/sft.md)."""
    from forgerl.errors import UserError
    from forgerl.samples.reader import read_samples, select

    records = read_samples(run_dir)
    if step is not None and not any(r.step == step for r in records):
        steps = sorted({r.step for r in records})
        held = f"steps {steps[0]} to {steps[-1]}" if steps else "no samples"
        raise UserError(f"{run_dir} has no samples of step {step} (it holds {held})")
    if export is not None:
        if as_json:
            raise UserError("--export writes rows, --json prints records: give one of them")
        kind = kind or _export_kind(run_dir)
        chosen = select(records, step=step, kind=kind, failed=failed, grep=grep)
        _export(run_dir, kind, chosen, export, correct=correct, min_reward=min_reward, best_k=best_k)
        return
    if best_k is not None:
        raise UserError("--best-k chooses the rows of --export; give --export FILE")
    if correct:
        records = [r for r in records if r.correct is True]
    if min_reward is not None:
        records = [r for r in records if r.reward is not None and r.reward >= min_reward]
    shown = select(records, step=step, kind=kind, failed=failed, grep=grep, order=order, limit=limit)
    if as_json:
        for r in shown:
            click.echo(r.to_json())
        return
    if not shown:
        click.echo("no samples match", err=True)
        return
    for r in shown:
        click.echo(render(r, full=full))
    matched = len(select(records, step=step, kind=kind, failed=failed, grep=grep))
    if matched > len(shown):
        click.echo(f"({len(shown)} of {matched} matching samples shown; --limit shows more)", err=True)


def _export_kind(run_dir: str) -> str:
    """What --export takes without --kind: a run's training samples (its held-out ones would
    teach the evaluation's answers), a `forge eval` folder's own."""
    from pathlib import Path

    from forgerl.samples.writer import SAMPLES_DIR

    return "train" if (Path(run_dir) / SAMPLES_DIR).is_dir() or Path(run_dir).name == SAMPLES_DIR else "eval"


def _export(run_dir: str, kind: str, records: list[SampleRecord], path: str, *, correct: bool,
            min_reward: float | None, best_k: int | None) -> None:
    from forgerl.errors import UserError
    from forgerl.sft.from_samples import sft_rows, write_rows

    made = sft_rows(records, correct=correct, min_reward=min_reward, best_k=best_k)
    if not made.rows:
        hint = " (--kind eval takes held-out ones)" if kind == "train" and not records else ""
        raise UserError(f"nothing to export: {len(records)} {kind} samples of {run_dir} match{hint}, "
                        f"{made.summary()}")
    try:
        write_rows(made.rows, path)
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
    click.echo(f"wrote {made.summary()} to {path}" if path != "-" else f"{made.summary()}", err=True)


def render(r: SampleRecord, *, full: bool = False) -> str:
    """One record as a few readable lines."""
    from forgerl.samples.records import message_text

    where = [f"step {r.step}", r.kind]
    if r.group is not None:
        where.append(f"group {r.group}" + (f" #{r.index}" if r.index is not None else ""))
    elif r.index is not None:
        where.append(f"#{r.index}")
    if r.problem_id:
        where.append(f"problem {r.problem_id}")
    if r.source:
        where.append(f"source {r.source}")
    if r.policy_version is not None:
        where.append(f"version {r.policy_version}")
    score = []
    if r.reward is not None:
        parts = ", ".join(f"{k} {v:.3g}" for k, v in sorted(r.components.items()))
        score.append(f"reward {r.reward:.4g}" + (f" ({parts})" if parts else ""))
    if r.advantage is not None:
        score.append(f"advantage {r.advantage:+.3f}")
    if r.correct is not None:
        score.append("correct" if r.correct else "wrong")
    if r.finish_reason:
        score.append(f"finish {r.finish_reason}")
    score.append(f"{r.prompt_tokens}+{r.completion_tokens} tokens")
    lines = [click.style("── " + " · ".join(where), bold=True), "   " + " · ".join(score)]
    if r.error:
        lines.append(click.style(f"   FAILED: {r.error}", fg="red"))
    if r.messages:
        lines.append("   messages:")
        for m in r.messages:
            content = message_text(m)
            role = m.get("role", "?") if isinstance(m, dict) else "?"
            lines.append(f"   [{role}]")
            lines.append(_indent(str(content) if full or role != "system" else _tail(str(content))))
    else:
        prompt = r.prompt if full else _tail(r.prompt)
        lines += ["   prompt:", _indent(prompt)]
    lines += ["   completion:", _indent(r.completion), ""]
    return "\n".join(lines)


def _tail(text: str) -> str:
    return text if len(text) <= PROMPT_CHARS else "…" + text[-PROMPT_CHARS:]


def _indent(text: str) -> str:
    return textwrap.indent(text.rstrip("\n") or "(empty)", "     ", lambda line: True)
