"""The job of a supervised run on every scheduler: the RL run's trainer role, alone (no
generator, transport or rewards to start) unless it evaluates, when it is the RL run's
whole job; a trainer that does not train the objective is refused before launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from forgerl.configuration.config import build_config
from forgerl.registry.plugins import build_registry
from forgerl.registry.resolve import resolve
from forgerl.rundirs.runs import build_job
from tests.helpers.timing import scaled

SFT = ["objective=sft", "sft.data=[demos.jsonl]"]


def job(tmp_path: Path, sets: list[str]):
    registry = build_registry()
    config = resolve(build_config(flags={"model": "tiny", "generator": "vllm"}, sets=sets), registry)
    return build_job(config, registry, tmp_path / "run"), registry


def test_the_sft_job_is_the_trainer_role_of_an_rl_run(tmp_path):
    rl, registry = job(tmp_path, [])
    sft, _ = job(tmp_path, SFT)
    assert [r.name for r in rl.roles] == ["trainer", "vllm"]
    assert sft.roles == rl.roles[:1] and sft.env == rl.env
    evaluating, _ = job(tmp_path, [*SFT, "sft.evaluate=true"])
    assert evaluating.roles == rl.roles, "a run that evaluates starts the generator an RL run would"
    script = registry.require("scheduler", "slurm").build({}).render(sft)
    assert "forgerl.worker" in script and "forgerl.server_role" not in script
    volume = {"name": "runs", "pvc": "runs", "mount_path": str(tmp_path)}
    manifests = registry.require("scheduler", "kubernetes").build({"image": "forgerl:test", "volumes": [volume]}).render(sft)
    assert "forgerl.worker" in manifests and "forgerl.server_role" not in manifests


def test_a_trainer_that_does_not_train_sft_is_refused_before_launch(tmp_path):
    demos = tmp_path / "demos.jsonl"
    demos.write_text(json.dumps({"text": "a b c"}) + "\n")
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "FORGE_PLUGINS": "tests.helpers.grpo_only_trainer",
           "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p)}  # fmt: skip
    env.pop("FORGE_DEBUG", None)
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "forgerl.cli", "sft", "--data", str(demos), "--model", "tiny", "--trainer", "grpo_only",
         "--output", str(out)],
        capture_output=True, text=True, env=env, timeout=scaled(120),
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("forge: error: objective sft is not one the grpo_only trainer trains (grpo): "
                                   "use --trainer fsdp or torchtitan, or another objective"), proc.stderr
    assert not out.exists()
