"""Samples across a resume: a run killed during a step (its records written, its
checkpoint not) and resumed records each step's samples once, none lost and none twice,
an evaluation's too, after a torn last line as well; the folder stays within its bounds.

The loop runs for real around the fakes of test_loop_fixed_weights (no model, no
processes); the kill is a trainer that raises in the middle of a step, after the step's
records were written and before its checkpoint."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from forgerl.configuration.config import RunConfig
from forgerl.interfaces import RunContext
from forgerl.registry.plugins import build_registry
from forgerl.runloop.loop import Loop
from forgerl.runloop.spmd import TrainerDriver
from forgerl.samples import SampleRecord, SampleWriter, read_samples
from forgerl.samples.writer import SAMPLES_DIR, segments

from .test_loop_fixed_weights import (
    GROUP,
    PROMPTS,
    FakeGenerator,
    FakeRewards,
    FakeSender,
    FakeTask,
    FakeTokenizer,
)
from .test_loop_fixed_weights import FakeTrainer as _FakeTrainer


class Killed(Exception):
    """What a SIGKILL would be, without the processes."""


class FakeTrainer(_FakeTrainer):
    def __init__(self, die_at: int | None = None) -> None:
        super().__init__()
        self.die_at = die_at

    def train_step(self, batch: Any) -> dict[str, float]:
        if len(self.batches) + 1 == self.die_at:
            raise Killed(f"killed in step {self.die_at}")
        return super().train_step(batch)


def loop(run_dir: Path, trainer: FakeTrainer, steps: int) -> Loop:
    config = RunConfig.model_validate({
        "generator": {"name": "fake"},
        "loop": {"steps": steps, "prompts_per_step": PROMPTS, "group_size": GROUP, "eval_at_start": True,
                 "eval_every": 2, "eval_size": 1, "sampling": {"max_tokens": 8}},
        "checkpoint": {"every": 2},
        "transport": {"timeout": 30},
        "logging": {"tensorboard": False, "progress": False},
    })  # fmt: skip
    return Loop(config, build_registry(), RunContext.for_run(config, run_dir), TrainerDriver(trainer, 1),
                FakeGenerator(), FakeTask(), FakeRewards(), FakeSender(), FakeTokenizer())  # fmt: skip


def on_disk(run_dir: Path) -> Counter[tuple[str, int]]:
    """Records of each (kind, step) in the files, every line counted (not the reader's view)."""
    lines = [line for seg in segments(run_dir / SAMPLES_DIR) for line in seg.read_bytes().splitlines()]
    return Counter((r.kind, r.step) for r in map(SampleRecord.from_json, lines))


def test_a_run_killed_in_a_step_and_resumed_records_each_step_once(tmp_path):
    first = loop(tmp_path, FakeTrainer(die_at=3), steps=4)
    try:
        first.run()
    except Killed:
        pass
    else:
        raise AssertionError("the first run was not killed")
    per_step = PROMPTS * GROUP
    # Killed in step 3: its records are written, its checkpoint (every 2) is not.
    assert on_disk(tmp_path) == {("eval", 0): 1, ("train", 1): per_step, ("train", 2): per_step, ("eval", 2): 1,
                                 ("train", 3): per_step}  # fmt: skip
    (seg,) = segments(tmp_path / SAMPLES_DIR)
    with open(seg, "ab") as f:  # and the kill tore a line
        f.write(b'{"kind": "train", "step": 3, "compl')

    trainer = FakeTrainer()
    summary = loop(tmp_path, trainer, steps=4).run()
    assert "load" in trainer.calls and summary["status"] == "completed", (trainer.calls, summary)
    expected = {("eval", 0): 1, ("train", 1): per_step, ("train", 2): per_step, ("eval", 2): 1,
                ("train", 3): per_step, ("train", 4): per_step, ("eval", 4): 1}  # fmt: skip
    assert on_disk(tmp_path) == expected  # every line a record: none twice, the torn line gone
    assert Counter((r.kind, r.step) for r in read_samples(tmp_path)) == expected


def test_drop_after_keeps_the_rotation_bounded_and_writing_goes_on(tmp_path):
    writer = SampleWriter(tmp_path / SAMPLES_DIR, max_file_bytes=2048, keep_files=3)

    def rec(step: int) -> SampleRecord:
        return SampleRecord(kind="train", step=step, prompt="q", completion="y" * 200)

    for step in range(1, 13):
        writer.write([rec(step), rec(step)])
    before = segments(tmp_path / SAMPLES_DIR)
    assert len(before) == 3
    kept_steps = sorted({r.step for r in read_samples(tmp_path)})
    dropped = writer.drop_after(9)
    assert dropped == 2 * sum(1 for s in kept_steps if s > 9)
    assert {r.step for r in read_samples(tmp_path)} == {s for s in kept_steps if s <= 9}
    for step in range(10, 13):
        writer.write([rec(step), rec(step)])
    files = segments(tmp_path / SAMPLES_DIR)
    assert len(files) <= 3 and all(f.stat().st_size <= 2048 for f in files), [f.stat().st_size for f in files]
    assert Counter(r.step for r in read_samples(tmp_path))[12] == 2
    assert not [p for p in (tmp_path / SAMPLES_DIR).iterdir() if p.name.endswith(".tmp")]
    writer.drop_after(None)  # starting again from step 0
    assert read_samples(tmp_path) == [] and segments(tmp_path / SAMPLES_DIR) == []
