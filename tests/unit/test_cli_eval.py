"""`forge eval`'s bad input: one line, exit status 2, no traceback, nothing started."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .test_cli import assert_one_line_error, forge


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((), "forge eval needs the model to evaluate"),
        (("tiny", "--k", "0"), "Invalid value for '--k'"),
        (("tiny", "--problems", "-1"), "Invalid value for '--problems'"),
        (("tiny", "--confidence", "1"), "Invalid value for '--confidence'"),
        (("tiny", "--task", "nosuch", "--dry-run"), "no task 'nosuch'"),
        (("./nowhere", "--dry-run"), "model './nowhere': no such folder"),
        (("tiny", "--set", "eval.k=0", "--dry-run"), "eval.k"),
        (("tiny", "--set", "eval.nosuch=1", "--dry-run"), "eval.nosuch"),
        (("--resume", "nowhere"), "'nowhere' is not a run directory"),
    ],
)
def test_bad_input_is_one_line_and_exit_status_2(tmp_path: Path, args: tuple[str, ...], needle: str) -> None:
    proc = forge("eval", *args, cwd=tmp_path)
    assert_one_line_error(proc, needle)
    assert not (tmp_path / "runs").exists(), "nothing was created"


def test_a_run_without_a_checkpoint_is_refused(tmp_path: Path) -> None:
    (tmp_path / "runs" / "empty").mkdir(parents=True)
    (tmp_path / "runs" / "empty" / "config.yaml").write_text("model:\n  name: tiny\n")
    proc = forge("eval", "runs/empty", "--dry-run", cwd=tmp_path)
    assert_one_line_error(proc, "model 'runs/empty' is a run without a checkpoint yet")
    # A training run's directory is not an evaluation to finish.
    proc = forge("eval", "--resume", "runs/empty", "--dry-run", cwd=tmp_path)
    assert_one_line_error(proc, "objective cannot change when resuming", "given 'eval'")


def test_resuming_an_evaluation_keeps_how_its_samples_were_drawn_and_scored(tmp_path: Path) -> None:
    """An evaluation's finished samples are kept on --resume: a new temperature, sampling or
    reward would mix two evaluations in one result. More samples per problem may be asked."""
    run = tmp_path / "runs" / "ev"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("objective: eval\nmodel:\n  name: tiny\ntask:\n  name: arithmetic\n"
                                     "generator:\n  name: hf\nloop:\n  eval_temperature: 1.0\n")  # fmt: skip
    for change, needle in [
        (("--set", "loop.eval_temperature=0.5"), "loop.eval_temperature cannot change when resuming"),
        (("--set", "loop.sampling.max_tokens=7"), "loop.sampling.max_tokens cannot change when resuming"),
        (("--set", "rewards=[{name: format}]"), "rewards cannot change when resuming"),
    ]:
        proc = forge("eval", "--resume", "runs/ev", *change, "--dry-run", cwd=tmp_path)
        assert_one_line_error(proc, needle, "the samples already written were made with")
    proc = forge("eval", "--resume", "runs/ev", "--k", "8", "--dry-run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr


def test_a_mistyped_run_directory_is_not_asked_of_the_hub(tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    proc = forge("eval", "runs/typo", "--dry-run", cwd=tmp_path)
    assert_one_line_error(proc, "model 'runs/typo': no such folder or run (runs holds no 'typo')")
    assert os.listdir(tmp_path / "runs") == []


def test_the_dry_run_is_one_worker_without_a_trainer(tmp_path: Path) -> None:
    proc = forge("eval", "tiny", "--task", "arithmetic", "--k", "4", "--generator", "hf", "--set",
                 "trainer.ranks=2", "--dry-run", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "1 process on this machine" in proc.stdout and "rank 0 of 1" in proc.stdout, proc.stdout
