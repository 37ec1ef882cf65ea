"""The contrib plugin, installed with pip like a user's plugin, then used through `forge`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.contrib_install import pip_install_copy
from tests.helpers.timing import scaled

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
FORGE = [sys.executable, "-m", "forgerl.cli"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """pip-install (a copy of) contrib/countdown into a separate folder (not the shared venv)."""
    return pip_install_copy(ROOT / "contrib" / "countdown", tmp_path_factory.mktemp("install"))


def test_listed_by_forge_plugins_list(installed):
    proc = subprocess.run([*FORGE, "plugins", "list", "--json"], capture_output=True, text=True, env=installed)
    rows = {r["name"]: r for r in json.loads(proc.stdout)}
    assert rows["countdown"]["distribution"] == "forgerl-countdown"
    assert {(b["kind"], b["name"]) for b in rows["countdown"]["backends"]} == {("task", "countdown"), ("reward", "countdown")}


def test_used_by_forge_run(installed, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [*FORGE, "run", "--model", "tiny", "--generator", "hf", "--task", "countdown", "--reward", "countdown", "--steps", "1",
         "--output", str(out), "--set", "loop.prompts_per_step=2", "--set", "loop.sampling.max_tokens=8",
         "--set", "task.options.eval_size=2"],
        capture_output=True, text=True, env=installed, timeout=scaled(300),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert "reward/countdown" in row and row["step"] == 1
    config = (out / "config.yaml").read_text()
    assert "name: countdown" in config and "numbers: 3" in config


def test_units_is_listed_once_pip_installed(tmp_path):
    """contrib/units's packaging: pip-installed, its entry point registers its task and
    environment (its own tests run the kits and a short run from the checkout)."""
    env = pip_install_copy(ROOT / "contrib" / "units", tmp_path)
    proc = subprocess.run([*FORGE, "plugins", "list", "--json"], capture_output=True, text=True, env=env,
                          timeout=scaled(60))  # fmt: skip
    rows = {r["name"]: r for r in json.loads(proc.stdout)}
    assert rows["units"]["distribution"] == "forgerl-units"
    assert {(b["kind"], b["name"]) for b in rows["units"]["backends"]} == {("task", "units"), ("environment", "units")}


def test_reasoning_gym_is_listed_once_pip_installed(tmp_path):
    """contrib/reasoning_gym's packaging: pip-installed (its library, reasoning-gym, comes with
    the test environment), its entry point registers its task and reward."""
    env = pip_install_copy(ROOT / "contrib" / "reasoning_gym", tmp_path)
    proc = subprocess.run([*FORGE, "plugins", "list", "--json"], capture_output=True, text=True, env=env,
                          timeout=scaled(60))  # fmt: skip
    rows = {r["name"]: r for r in json.loads(proc.stdout)}
    assert rows["reasoning_gym"]["distribution"] == "forgerl-reasoning-gym"
    backends = {(b["kind"], b["name"]): b for b in rows["reasoning_gym"]["backends"]}
    assert set(backends) == {("task", "reasoning_gym"), ("reward", "reasoning_gym")}
