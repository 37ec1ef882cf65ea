"""``python -m forgerl.server_role``: every server role's process. It loads the run's config
once, finds the backend that declares the role, and calls its ``serve`` with the validated
options model, the run's context (a generator's servers get the run's model folder), the
role and the replica; its return value is the process's exit status. Mistakes are one line
and exit status 2. The backends here (tests/helpers/served_echo.py) record what they got;
the real servers: tests/integration/test_vllm.py, test_sglang_double.py,
test_reward_model_served.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from forgerl import server_role
from forgerl.configuration.config import build_config
from forgerl.registry.plugins import build_registry
from forgerl.registry.resolve import resolve
from forgerl.rundirs import runs
from forgerl.types import JobSpec
from tests.helpers.served_echo import PLUGIN
from tests.helpers.timing import scaled

REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, model: Path, **base: Any) -> tuple[Path, JobSpec]:
    """A run directory as ``forge run`` writes it (the resolved config.yaml) and its job."""
    registry = build_registry(plugins=[PLUGIN])
    config = resolve(build_config(flags={"model": str(model)}, base=base), registry)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    runs.write_config(run_dir, config)
    return run_dir, runs.build_job(config, registry, run_dir)


def _seen(run_dir: Path, role: str, replica: int) -> dict[str, Any]:
    return json.loads((run_dir / "served" / f"{role}-{replica}.json").read_text())


def test_each_replica_of_a_generator_role_serves_with_the_options_model_and_the_runs_model(
    tmp_path, tiny_model_dir
):
    run_dir, job = _run(
        tmp_path, tiny_model_dir,
        generator={"name": "served_echo", "options": {"replicas": 2, "exit_status": 7}},
        loop={"max_staleness": 1},
    )  # fmt: skip
    [role] = [r for r in job.roles if r.name == "echo"]
    assert role.command[1:] == ("-m", "forgerl.server_role", "--run-dir", str(run_dir), "--role", "echo")
    # The role's own command, as a scheduler runs it: the job's environment (which loads
    # the plugin) and the replica's index.
    path = os.pathsep.join([str(REPO / "core"), str(REPO / "plugins"), str(REPO), *sys.path])
    for replica in range(role.replicas):
        env = {**os.environ, **job.env, "PYTHONPATH": path, "FORGE_ROLE": "echo", "FORGE_REPLICA": str(replica)}
        done = subprocess.run(role.command, env=env, capture_output=True, text=True, timeout=scaled(120))
        assert done.returncode == 7, done.stderr  # serve's return value
        seen = _seen(run_dir, "echo", replica)
        assert seen["replica"] == replica and seen["role"] == "echo" and seen["pid"] != os.getpid()
        # Typed options (validated once, defaults in), and run facts from the context.
        assert seen["options_class"] == "ServedEchoGenerator.Options"
        assert seen["options"] == {"replicas": 2, "exit_status": 7}
        assert seen["model_path"] == str(tiny_model_dir.resolve()) and seen["model_name"] == str(tiny_model_dir)
        assert seen["max_staleness"] == 1 and seen["run_dir"] == str(run_dir)


def test_a_reward_role_is_served_with_that_rewards_options_and_no_policy_model(
    tmp_path, tiny_model_dir, monkeypatch
):
    run_dir, job = _run(
        tmp_path, tiny_model_dir,
        generator={"name": "hf"},
        rewards=[
            {"name": "format"},
            {"name": "served_echo", "options": {"server": "echo-a", "label": 1, "exit_status": 3}},
            {"name": "served_echo", "options": {"server": "echo-b", "label": 2}},
        ],
    )  # fmt: skip
    assert [r.name for r in job.roles if not r.primary] == ["echo-a", "echo-b"]
    monkeypatch.setenv("FORGE_PLUGINS", PLUGIN)
    monkeypatch.setenv("FORGE_REPLICA", "0")
    assert server_role.main(["--run-dir", str(run_dir), "--role", "echo-b", "--replica", "4"]) == 0
    seen = _seen(run_dir, "echo-b", 4)  # --replica wins over FORGE_REPLICA
    assert seen["options_class"] == "ServedEchoReward.Options" and seen["options"]["label"] == 2
    assert seen["model_path"] is None, "a reward's server serves its own model, not the policy"
    assert server_role.main(["--run-dir", str(run_dir), "--role", "echo-a"]) == 3
    assert _seen(run_dir, "echo-a", 0)["options"]["label"] == 1


def test_a_role_no_backend_of_the_run_declares_is_one_line_and_status_2(tmp_path, tiny_model_dir, capsys):
    run_dir, _ = _run(tmp_path, tiny_model_dir, generator={"name": "hf"})
    assert server_role.main(["--run-dir", str(run_dir), "--role", "vllm"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("forge vllm: error: no backend of the run") and "'vllm'" in err
    assert "\n" not in err and "Traceback" not in err


def test_a_run_directory_without_its_config_is_one_line_and_status_2(tmp_path, capsys):
    assert server_role.main(["--run-dir", str(tmp_path), "--role", "vllm"]) == 2
    err = capsys.readouterr().err.strip()
    assert "config.yaml" in err and "\n" not in err


@pytest.mark.parametrize("argv", [["--role", "vllm"], ["--run-dir", "x"]])
def test_the_run_directory_and_the_role_are_required(argv):
    with pytest.raises(SystemExit) as exit_:
        server_role.main(argv)
    assert exit_.value.code == 2
