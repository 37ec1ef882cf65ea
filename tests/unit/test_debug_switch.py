"""FORGE_DEBUG means the same in ``forge`` and in a run's worker processes: unset, "",
"0", "false" and "no" are off (a user error is one line), anything else is on (the
traceback is kept). The worker used to take FORGE_DEBUG=0 for on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from forgerl.configuration.env import debug_enabled, env_flag
from tests.helpers.timing import scaled


@pytest.mark.parametrize("value", [None, "", "0", "false", "no", " False ", "NO"])
def test_off_values(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("FORGE_DEBUG", raising=False)
    else:
        monkeypatch.setenv("FORGE_DEBUG", value)
    assert not debug_enabled() and not env_flag("FORGE_DEBUG")


@pytest.mark.parametrize("value", ["1", "true", "yes", "on", "2"])
def test_on_values(monkeypatch, value):
    monkeypatch.setenv("FORGE_DEBUG", value)
    assert debug_enabled() and env_flag("FORGE_DEBUG")


def _run(args: list[str], debug: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "FORGE_DEBUG": debug}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=scaled(60))


@pytest.mark.parametrize(("debug", "on"), [("0", False), ("false", False), ("1", True)])
def test_forge_and_the_worker_agree(tmp_path: Path, debug: str, on: bool):
    (tmp_path / "config.yaml").write_text("loop:\n  steps: -1\n")  # a user error: one line, or a traceback
    forge = _run(["-m", "forgerl.cli", "config", "validate", str(tmp_path / "config.yaml")], debug)
    worker = _run(["-m", "forgerl.worker", "--run-dir", str(tmp_path)], debug)
    for proc in (forge, worker):
        assert ("Traceback" in proc.stderr) == on, (debug, proc.args, proc.stderr[-2000:])
        assert "loop.steps" in proc.stderr, proc.stderr[-2000:]
        if not on:
            assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, (proc.args, proc.stderr)
