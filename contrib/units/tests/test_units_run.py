"""One short run with the plugin, as a user runs it from a checkout without installing it
(``FORGE_PLUGINS`` names the plugin module): the tiny model, the in-process hf generator,
the task's questions played as trajectories in the environment."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SRC = Path(__file__).resolve().parents[1] / "src"


def test_a_short_run_on_the_units_task_and_environment(tmp_path):
    from forgerl.testing.timing import scaled

    out = tmp_path / "run"
    env = {
        **os.environ,
        "FORGE_PLUGINS": "forgerl_units.plugin",
        "PYTHONPATH": os.pathsep.join([str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "forgerl.cli", "run", "--model", "tiny", "--generator", "hf", "--task", "units",
         "--environment", "units", "--steps", "1", "--output", str(out), "--set", "loop.prompts_per_step=2",
         "--set", "loop.group_size=2", "--set", "loop.sampling.max_tokens=12", "--set", "task.options.eval_size=2",
         "--set", "environment.max_turns=2", "--set", "environment.max_total_tokens=48"],
        capture_output=True, text=True, env=env, timeout=scaled(300),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    [row] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["step"] == 1 and row["env/failed"] == 0, row
    assert "reward/correct" in row and "env/turns_mean" in row, sorted(row)
    config = (out / "config.yaml").read_text()
    assert "name: units" in config and "tolerance: 0.001" in config
