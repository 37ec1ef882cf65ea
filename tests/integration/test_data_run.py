"""`forge run` on data built on disk: a mixture of a JSONL source and a streamed CSV source,
each scored by its own reward, reported per source; a wrong column refused before launch.
Real subprocesses, the tiny model, the hf generator."""

from __future__ import annotations

import csv
import json

import pytest
import yaml

from ..helpers.hold_at_step import kill_run_held_at
from .test_run_e2e import BASE, FORGE, deterministic, forge, metrics

pytestmark = pytest.mark.integration


def mixture_config(tmp_path):
    """A math JSONL source (in memory) and a words CSV source (streamed through a shuffle
    buffer), each with its own reward; the config file's path."""
    with (tmp_path / "math.jsonl").open("w") as f:
        for i in range(12):
            f.write(
                json.dumps({"question": f"What is {i} + 1?", "solution": str(i + 1), "level": i % 2}) + "\n"
            )
    with (tmp_path / "words.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "kind"])
        w.writerows([[f"Say a number, any number ({i}).", "digits"] for i in range(10)])
    config = {
        "task": {"name": "mixture", "options": {"sources": [
            {"name": "math", "weight": 1, "dataset": {
                "path": "math.jsonl", "columns": {"prompt": "question", "answer": "solution"}, "eval_fraction": 0.25}},
            {"name": "words", "weight": 1, "dataset": {
                "path": "words.csv", "columns": {"prompt": "text", "answer": None}, "streaming": True,
                "shuffle_buffer": 4, "eval_path": "words.csv"}},
        ]}},
        "rewards": [
            {"name": "math_answer", "sources": ["math"]},
            {"name": "format", "options": {"pattern": "\\d"}, "sources": ["words"]},
        ],
    }  # fmt: skip
    for source in config["task"]["options"]["sources"]:
        data = source["dataset"]
        data["path"] = str(tmp_path / data["path"])
        if "eval_path" in data:
            data["eval_path"] = str(tmp_path / data["eval_path"])
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    return str(tmp_path / "run.yaml")


def test_a_mixture_scores_each_source_with_its_own_reward(tmp_path):
    out = tmp_path / "out"
    proc = forge("run", mixture_config(tmp_path), *BASE, "--steps", "2", "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        # 2 prompts a step, alternating sources, 4 completions each
        assert row["source_samples/math"] == 4 and row["source_samples/words"] == 4, row
        assert {
            "source/math/reward",
            "source/math/math_answer",
            "source/words/reward",
            "source/words/format",
        } <= set(row)
        assert "source/math/format" not in row and "source/words/math_answer" not in row
        assert row["reward/format"] == row["source/words/format"], (
            "a reward's mean is over the samples it scored"
        )
    held_out = {"eval/source/math/accuracy", "eval/source/words/accuracy", "eval/source/words/reward"}
    assert held_out <= set(rows[-1]), sorted(rows[-1])
    state = json.loads(next(out.glob("checkpoints/step-*/**/loop.json")).read_text())["task_state"]
    assert set(state["drawn"]) == {"math", "words"} and state["sources"]["words"]["streaming"] is True


def test_a_mixture_runs_one_source_through_its_environment(tmp_path):
    """environment.sources: the math rows are calculator trajectories (the environment's
    verdict), the words rows single completions scored by their reward, in one run."""
    from forgerl.samples.reader import read_samples

    out = tmp_path / "out"
    proc = forge("run", mixture_config(tmp_path), *BASE, "--steps", "1", "--output", str(out),
                 "--set", "environment.name=calculator", "--set", "environment.sources=[math]",
                 "--set", "environment.max_turns=2", "--set", "environment.max_total_tokens=40")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = metrics(out)
    assert row["source_samples/math"] == 4 and row["source_samples/words"] == 4, row
    assert "env/turns_mean" in row and "source/words/format" in row
    assert "source/math/math_answer" not in row, "the environment gave the math rows their reward"
    assert {"eval/source/math/accuracy", "eval/source/words/accuracy"} <= set(row)
    train = [r for r in read_samples(out) if r.kind == "train"]
    assert {r.source for r in train} == {"math", "words"}
    for r in train:
        assert (r.messages is not None) == (r.source == "math"), (r.source, r.messages)


def test_a_wrong_column_is_one_line_before_launch(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"question": "1+1", "answer": "2"}\n')
    proc = forge("run", *BASE, "--task", "dataset", "--set", f"task.options.path={path}",
                 "--set", "task.options.columns.prompt=problem", "--output", str(tmp_path / "out"))  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        f"forge: error: {path} row 1: no column 'problem' (columns.prompt); columns: question, answer"
    )
    assert not (tmp_path / "out").exists()


def test_a_streamed_mixture_resumes_at_the_same_rows(tmp_path):
    """Killed after its second step and resumed, the run trains on what an unbroken one
    trains on: every per-source metric of steps 3 and 4 matches (the streamed source goes on
    at the same row, through the same shuffle buffer; groups stay whole)."""
    config = mixture_config(tmp_path)
    common = [config, *BASE, "--steps", "4", "--set", "checkpoint.every=1", "--set", "loop.max_staleness=1"]
    whole = tmp_path / "whole"
    proc = forge("run", *common, "--output", str(whole))
    assert proc.returncode == 0, proc.stderr[-3000:]
    cut = tmp_path / "cut"
    kill_run_held_at([*FORGE, "run", *common, "--output", str(cut)], cut, 2)
    assert [r["step"] for r in metrics(cut)] == [1, 2]
    proc = forge("run", "--resume", str(cut))
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed, reference = metrics(cut), metrics(whole)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(resumed, reference, strict=True):
        assert any(k.startswith("source/words/") for k in a)
        assert deterministic(a) == pytest.approx(deterministic(b), rel=1e-6, abs=1e-7), a["step"]
