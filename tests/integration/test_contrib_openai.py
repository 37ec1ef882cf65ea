"""The contrib ``openai`` generator plugin, installed with pip like a user's plugin, trains
through ``forge run`` against a real OpenAI-compatible server: the session's vLLM server
(tests/helpers/shared_vllm.py) serving the tiny model."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.contrib_install import pip_install_copy
from tests.helpers.timing import scaled

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "contrib" / "openai_compat"
FORGE = [sys.executable, "-m", "forgerl.cli"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """pip-install (a copy of) contrib/openai_compat into a separate folder (not the shared venv)."""
    return pip_install_copy(PLUGIN, tmp_path_factory.mktemp("install"))


@pytest.fixture(scope="module")
def served(shared_vllm):
    """The session's vLLM server (tests/helpers/shared_vllm.py) at the tiny model's own
    weights: the run trains the folder it serves, and its key goes in OPENAI_API_KEY."""
    return shared_vllm.openai_endpoint()


def test_listed_by_forge_plugins_list(installed):
    proc = subprocess.run(
        [*FORGE, "plugins", "list", "--json"], capture_output=True, text=True, env=installed
    )
    rows = {r["name"]: r for r in json.loads(proc.stdout)}
    assert rows["openai_compat"]["distribution"] == "forgerl-openai-compat"
    assert [(b["kind"], b["name"]) for b in rows["openai_compat"]["backends"]] == [("generator", "openai")]


def test_forge_run_trains_on_the_servers_completions(installed, served, tmp_path):
    model, base_url = served.model_dir, served.base_url
    out = tmp_path / "run"
    proc = subprocess.run(
        [*FORGE, "run", "--model", str(model), "--generator", "openai", "--steps", "3", "--output", str(out),
         "--set", f"generator.options.base_url={base_url}",
         "--set", "loop.prompts_per_step=2", "--set", "loop.group_size=4", "--set", "loop.sampling.max_tokens=8",
         "--set", "loop.eval_size=2", "--set", "logging.progress=false"],
        capture_output=True, text=True, env={**installed, "OPENAI_API_KEY": served.api_key}, timeout=scaled(600),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The loop says it once in the trainer's log (logs/trainer-0.log) ...
    log = (out / "logs" / "trainer-0.log").read_text()
    said = [line for line in log.splitlines() if "off-policy" in line]
    assert (
        len(said) == 1
        and "'openai' takes no weight updates: every rollout comes from the initial weights" in said[0]
    ), said
    # ... and on forge run's progress output, through the run's events.
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    warned = [e for e in events if e.get("state") == "warning" and "takes no weight updates" in e["message"]]
    assert len(warned) == 1, events
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["samples/dropped_stale"] == 0 for r in rows), rows
    assert all(r["samples/trained"] > 0 or r["groups/filtered_zero_variance"] > 0 for r in rows), rows
    assert [r["staleness/mean"] for r in rows] == [0, 1, 2]  # version 0's samples, trained at 1, 2, 3
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["policy_version"] == 3
