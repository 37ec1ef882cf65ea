"""One short run with the plugin, as a user runs it from a checkout without installing it
(``FORGE_PLUGINS`` names the plugin module): the tiny model, the in-process hf generator,
two reasoning-gym datasets scored by their own scorers in the reward worker processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration

SRC = Path(__file__).resolve().parents[1] / "src"


def test_a_short_run_on_reasoning_gym(tmp_path):
    from forgerl.testing.timing import scaled

    config = {
        "task": {"name": "reasoning_gym", "options": {
            "datasets": [{"name": "chain_sum", "config": {"min_terms": 2, "max_terms": 2}}, {"name": "basic_arithmetic"}],
            "size": 20, "eval_size": 2}},
        "rewards": [{"name": "reasoning_gym"}],
    }  # fmt: skip
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "run"
    env = {
        **os.environ,
        "FORGE_PLUGINS": "forgerl_reasoning_gym.plugin",
        "PYTHONPATH": os.pathsep.join([str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "forgerl.cli", "run", str(tmp_path / "run.yaml"), "--model", "tiny", "--generator", "hf",
         "--steps", "1", "--output", str(out), "--set", "loop.prompts_per_step=2", "--set", "loop.group_size=2",
         "--set", "loop.sampling.max_tokens=12"],
        capture_output=True, text=True, env=env, timeout=scaled(300),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    [row] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["step"] == 1 and row["reward/failed"] == 0, row
    assert "reward/reasoning_gym" in row and "reward/reasoning_gym/answered" in row, sorted(row)
