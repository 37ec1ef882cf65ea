"""The examples of docs/plugins.md, run as written: the tutorial's reward plugin (its
registration module must stay light) and the experiment-tracker plugin."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.timing import scaled

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"


def code_blocks(doc: str) -> dict[str, str]:
    """Python blocks of a doc whose first line is ``# path``, by that path."""
    blocks = re.findall(r"```python\n# (\S+)\n(.*?)```", (DOCS / doc).read_text(), flags=re.S)
    return {path: body for path, body in blocks}


def test_plugin_tutorial_works_and_its_registration_module_stays_light(tmp_path: Path):
    """The tutorial's files, written out as they stand in plugins.md: registering the
    backend imports neither pydantic nor the implementation, and the backend builds from
    an options dict and scores, as does the tutorial's own test."""
    blocks = code_blocks("plugins.md")
    for path in ("src/forgerl_brevity/plugin.py", "src/forgerl_brevity/options.py",
                 "src/forgerl_brevity/reward.py", "tests/test_brevity.py"):
        assert path in blocks, f"docs/plugins.md has no block starting '# {path}'"
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(blocks[path])
    (tmp_path / "src/forgerl_brevity/__init__.py").write_text("")
    script = textwrap.dedent(
        """
        import sys
        from forgerl_brevity.plugin import forge_rewards
        [backend] = forge_rewards()
        heavy = [m for m in ("pydantic", "forgerl_brevity.options", "forgerl_brevity.reward")
                 if m in sys.modules]
        assert not heavy, f"registering imported {heavy}"
        reward = backend.build({"target_chars": 5})
        from forgerl.types import Problem, RewardInput
        print(reward.score(RewardInput(Problem(id="1", prompt="p"), "0123456789")))
        import test_brevity
        test_brevity.test_short_beats_long()
        """
    )
    shim = REPO / ".pyshim"
    shims = [str(shim)] if shim.is_dir() else []  # a worktree's import shim, when there is one
    path = [str(tmp_path / "src"), str(tmp_path / "tests"), *shims, *sys.path]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=scaled(60), env=env)
    assert done.returncode == 0, done.stderr
    assert "RewardResult(value=0.5, components={'chars': 10.0}" in done.stdout, done.stdout


def test_tracker_example_in_plugins_md_forwards_metrics(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """The W&B example registers as a plugin (hook names and arguments are checked by
    pluggy) and forwards each step's row, without None values, to the tracker."""
    import types

    from forgerl.config import RunConfig
    from forgerl.plugins import build_registry

    calls = []

    class FakeRun:
        def log(self, data, step):
            calls.append(("log", data, step))

        def finish(self, exit_code):
            calls.append(("finish", exit_code))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or FakeRun()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    plugin = types.ModuleType("forgerl_wandb_example")
    source = code_blocks("plugins.md")["src/forgerl_wandb/plugin.py"]
    exec(compile(source, "docs/plugins.md", "exec"), plugin.__dict__)

    registry = build_registry(entry_points=False, plugins=[plugin], strict=True, disabled=set())
    run_dir = tmp_path / "20261203-120000"
    registry.hooks.run_start(config=RunConfig(), run_dir=run_dir)
    row = {"step": 1, "reward/mean": 0.5, "loss/policy": None}  # None: a NaN loss, as metrics.jsonl has it
    registry.hooks.step_end(step=1, metrics=row, run_dir=run_dir)
    registry.hooks.run_end(summary={"status": "failed"}, run_dir=run_dir)

    assert [c[0] for c in calls] == ["init", "log", "finish"]
    assert calls[0][1]["id"] == run_dir.name
    assert calls[1][1:] == ({"step": 1, "reward/mean": 0.5}, 1)
    assert calls[2] == ("finish", 1)
