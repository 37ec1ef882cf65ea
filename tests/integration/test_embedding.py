"""docs/embedding.md's example runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.timing import scaled

pytestmark = pytest.mark.integration

DOC = Path(__file__).resolve().parents[2] / "docs" / "embedding.md"


def test_embedding_example_runs(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert blocks, "no python example in docs/embedding.md"
    script = tmp_path / "example.py"
    script.write_text(blocks[0])
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=scaled(300), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("completed 1 "), proc.stdout


def test_plugins_by_import_path_reach_the_run_processes(tmp_path, monkeypatch):
    import forgerl
    from forgerl.rundirs.runs import build_job

    mod = tmp_path / "my_forge_plugin.py"
    mod.write_text(
        "from forgerl.backends import RewardBackend\n"
        "from forgerl.hookspecs import hookimpl\n"
        "@hookimpl\n"
        "def forge_rewards():\n"
        "    return [RewardBackend(name='mine', factory='builtins:dict')]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = forgerl.build_registry(plugins=["my_forge_plugin"])
    assert "mine" in registry.backends("reward")
    config = forgerl.load_config(registry=registry, flags={"model": "tiny", "rewards": ["mine"]})
    job = build_job(config, registry, tmp_path / "run")
    assert job.env["FORGE_PLUGINS"] == "my_forge_plugin"


def test_a_missing_plugin_module_is_a_user_error():
    import forgerl
    from forgerl.errors import PluginLoadError

    with pytest.raises(PluginLoadError, match="no_such_plugin_module"):
        forgerl.build_registry(plugins=["no_such_plugin_module"])
