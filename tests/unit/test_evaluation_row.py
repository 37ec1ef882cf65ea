"""The held-out evaluation's row (core/forgerl/runloop/evaluation.py): besides accuracy and
reward, the mean of every reward component over the held-out problems, a component a
sample does not report counting 0 (as the training rows count it)."""

from __future__ import annotations

import pytest

from forgerl.runloop.evaluation import _row


def test_every_component_is_averaged_over_every_held_out_problem():
    row = _row(
        [1.0, 0.0, 1.0, 0.0],
        [1.0, 0.0, 1.0, 0.5],
        [{"correct": 1.0, "used_tool": 1.0}, {"correct": 0.0, "used_tool": 1.0}, {"correct": 1.0}, {}],
    )
    assert row["eval/accuracy"] == 0.5 and row["eval/reward"] == pytest.approx(0.625)
    assert row["eval/samples"] == 4
    assert row["eval/reward/used_tool"] == 0.5  # the failed trajectory ({}) used no tool
    assert row["eval/reward/correct"] == 0.5


def test_no_problems_no_components():
    assert _row([], [], []) == {"eval/accuracy": 0.0, "eval/reward": 0.0, "eval/samples": 0}
