"""`forge run` end to end, as a user runs it: real subprocesses, the tiny model, the local
scheduler, hf generator, fsdp trainer on gloo ranks (torchtitan too for `--resume`), shm transport."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ..helpers.hold_at_step import hold_env, marker
from ..helpers.requires import require_torchtitan
from ..helpers.timing import scaled, wait_until
from ..unit.fakedist import make_dist

pytestmark = pytest.mark.integration

FORGE = [sys.executable, "-m", "forgerl.cli"]
# The tiny random model never answers arithmetic right; a format reward that random text
# sometimes satisfies gives the groups reward variance, so the runs really train.
BASE = [
    "--model", "tiny",
    "--generator", "hf",
    "--set", "loop.prompts_per_step=2",
    "--set", "loop.group_size=4",
    "--set", "loop.sampling.max_tokens=12",
    "--set", "loop.eval_size=4",
    "--set", "trainer.options.lr=1e-3",
    # fp32 on every CPU (the default bf16 autocast on native-bf16 hardware would put the
    # trainer a few percent from the sampler): the gap checks below compare fp32 to fp32.
    "--set", "trainer.options.autocast_bf16=false",
]
SMALL = [*BASE, "--reward", "format", "--set", "rewards.0.options.pattern=\\d"]
CONTRACT_KEYS = {
    "step", "policy_version", "reward/mean", "time/step", "time/generate", "time/reward", "time/train",
    "time/sync", "staleness/mean", "samples/dropped_stale", "logprob_gap/mean", "logprob_gap/max",
    "throughput/gen_tokens_per_s", "clip/low_frac", "clip/high_frac", "kl/approx", "ratio/mean",
}


def forge(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``forge ARGS``; ``timeout`` is the test's patience, scaled like every deadline."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([*FORGE, *args], capture_output=True, text=True, env=full_env, timeout=scaled(timeout))


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def deterministic(row: dict) -> dict:
    """A metrics row without the wall-clock parts."""
    return {k: v for k, v in row.items() if not k.startswith(("time/", "throughput/"))}


@pytest.mark.parametrize("staleness", [0, 1])
def test_two_ranks_on_gloo(tmp_path, staleness):
    out = tmp_path / "run"
    proc = forge("run", *SMALL, "--steps", "3", "--output", str(out),
                 "--set", "trainer.ranks=2", "--set", f"loop.max_staleness={staleness}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["policy_version"] for r in rows] == [1, 2, 3]
    assert CONTRACT_KEYS <= set(rows[0]), CONTRACT_KEYS - set(rows[0])
    # Batch k is sampled with version max(0, k - staleness): never staler than allowed.
    assert [r["staleness/mean"] for r in rows] == [min(k, staleness) for k in range(3)]
    assert all(r["samples/dropped_stale"] == 0 for r in rows)
    assert any(r["grad_norm"] > 0 for r in rows), "nothing was learned from: no reward variance"
    assert "eval/accuracy" in rows[-1]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 3
    assert summary["eval_accuracy_start"] is not None and summary["eval_accuracy_end"] is not None
    logs = sorted(p.name for p in (out / "logs").glob("trainer*"))
    assert len(logs) == 2, logs
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-000003"
    if staleness == 0:
        # Same weights on both sides at sampling time: the logprobs must agree.
        assert max(r["logprob_gap/max"] for r in rows) < 1e-3


def _adapter_bytes(model_dir: Path, rank: int) -> int:
    """What a rank-``rank`` adapter on every projection of ``model_dir`` holds in fp32:
    A (rank x in) and B (out x rank) per linear layer, the output layer excepted."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    head = model.get_output_embeddings()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    assert len(linears) == 7 * model.config.num_hidden_layers
    return sum(rank * (m.in_features + m.out_features) * 4 for m in linears)


def test_lora_run_moves_only_the_adapter_and_serves_it(tmp_path, tiny_model_dir):
    """``--set trainer.options.lora.rank=8`` with the hf generator: each update moves the
    adapter alone, and the generator samples with it (the trainer's logprobs equal the
    sampler's; the large learning rate moves the policy far enough from the base model
    within one step that sampling without the adapter would show as a gap)."""
    pytest.importorskip("peft")
    out = tmp_path / "run"
    proc = forge("run", *SMALL, "--steps", "3", "--output", str(out), "--set", "loop.eval_at_start=false",
                 "--set", "trainer.options.lora.rank=8", "--set", "trainer.options.lr=5e-2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert any(r["grad_norm"] > 0 for r in rows), "nothing was learned from: no reward variance"
    adapter = _adapter_bytes(tiny_model_dir, 8)
    assert [r["sync/bytes"] for r in rows] == [adapter] * 3
    assert max(r["logprob_gap/max"] for r in rows) < 1e-3, [r["logprob_gap/max"] for r in rows]


@pytest.mark.parametrize("trainer", ["fsdp", "torchtitan"])
def test_resume_after_sigkill_matches_an_uninterrupted_run(tmp_path, trainer):
    if trainer == "torchtitan":
        require_torchtitan()
    common = [*SMALL, "--trainer", trainer, "--steps", "4", "--set", "checkpoint.every=1",
              "--set", "loop.max_staleness=1", "--set", "loop.eval_every=2"]
    whole = tmp_path / "whole"
    proc = forge("run", *common, "--output", str(whole))
    assert proc.returncode == 0, proc.stderr[-3000:]

    cut = tmp_path / "cut"
    front = subprocess.Popen([*FORGE, "run", *common, "--output", str(cut)], env=hold_env(2),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        # Held at step 2, once its checkpoint is saved: no race with a fast machine.
        wait_until(lambda: marker(cut, 2).exists(), 240, "the run to reach its second checkpoint", interval=0.2)
        job = json.loads((cut / "job.json").read_text())
        pids = [p["pid"] for p in job["processes"]]
        for pid in pids:  # a crash, not a clean exit
            os.kill(pid, signal.SIGKILL)
        front.wait(timeout=scaled(60))
    finally:
        if front.poll() is None:
            front.kill()
    assert front.returncode != 0
    assert [r["step"] for r in metrics(cut)] == [1, 2]

    proc = forge("run", "--resume", str(cut))
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed, reference = metrics(cut), metrics(whole)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(resumed, reference):
        assert deterministic(a) == pytest.approx(deterministic(b), rel=1e-6, abs=1e-7), a["step"]


RAISING_REWARD = """
import os

from forgerl.backends import RewardBackend
from forgerl.hookspecs import hookimpl
from forgerl.interfaces import Reward


class Flaky(Reward):
    def __init__(self, options):
        self.calls = 0

    def score(self, sample):
        self.calls += 1
        if self.calls % 2:
            # A service's error that quotes its token: never written into the run's samples.
            raise RuntimeError("reward service exploded; token " + os.environ.get("FLAKY_API_TOKEN", ""))
        return 1.0


@hookimpl
def forge_rewards():
    return [RewardBackend(name="flaky", factory=Flaky)]
"""


def test_a_raising_reward_does_not_stop_the_run(tmp_path):
    site = make_dist(tmp_path / "site", "fake-flaky", "1.0", {"flaky": RAISING_REWARD})
    out = tmp_path / "run"
    token = "flaky-token-3141592653"
    env = {"PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "FLAKY_API_TOKEN": token}
    proc = forge("run", *BASE, "--steps", "2", "--reward", "flaky", "--reward", "format", "--output", str(out),
                 "--set", "loop.eval_at_start=false", "--set", "rewards.1.options.pattern=\\d", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(out)
    assert len(rows) == 2
    assert all(r["reward/failed"] > 0 for r in rows)
    assert all(0 < r["reward/flaky"] < 1 for r in rows)
    # Its samples say which failed and why; `forge samples --failed` shows just those.
    from forgerl.samples import read_samples

    failed = [r for r in read_samples(out) if r.error is not None]  # the held-out ones too
    assert len([r for r in failed if r.kind == "train"]) == sum(r["reward/failed"] for r in rows)
    assert all(r.error.endswith("reward service exploded; token [redacted]") for r in failed), failed[0].error
    assert not [p for p in (out / "samples").iterdir() if token in p.read_text()]
    shown = forge("samples", str(out), "--failed", "--json", "--limit", "100")
    assert [json.loads(line)["error"] for line in shown.stdout.splitlines()] == [r.error for r in failed]


# Registration is light and imports fine; the implementation module names a dependency
# that is not installed. The plugin also has a run_end hook, as a tracker would.
MISSING_DEPENDENCY_REWARD = """
import json
from forgerl.backends import RewardBackend
from forgerl.hookspecs import hookimpl


@hookimpl
def forge_rewards():
    return [RewardBackend(name="needs_dep", factory="fake_needs_impl:NeedsDep")]


@hookimpl
def forge_run_end(summary, run_dir):
    (run_dir / "run_end_hook.json").write_text(json.dumps(dict(summary)))
"""


def test_a_backend_whose_module_fails_to_import_ends_the_run_cleanly(tmp_path):
    site = make_dist(tmp_path / "site", "fake-needs", "1.0", {"needs": MISSING_DEPENDENCY_REWARD})
    (site / "fake_needs_impl.py").write_text("import no_such_dependency_q\n")
    out = tmp_path / "run"
    env = {"PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = forge("run", *BASE, "--steps", "1", "--reward", "needs_dep", "--output", str(out), env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    what = "reward 'needs_dep' of plugin 'needs' (fake-needs 1.0) cannot be loaded"
    assert what in proc.stderr and "no_such_dependency_q" in proc.stderr, proc.stderr[-3000:]
    log = (out / "logs" / "trainer-0.log") if (out / "logs" / "trainer-0.log").exists() else None
    logs = [p.read_text() for p in (out / "logs").glob("trainer*")] if log is None else [log.read_text()]
    errors = [line for text in logs for line in text.splitlines() if line.startswith("forge: error:")]
    assert len(errors) == 1 and what in errors[0], logs
    assert not any("Traceback" in text for text in logs), logs
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps"] == 0, summary
    assert what in summary["error"]
    assert json.loads((out / "run_end_hook.json").read_text()) == summary


def test_bad_config_starts_nothing(tmp_path):
    out = tmp_path / "run"
    proc = forge("run", "--model", "tiny", "--output", str(out), "--set", "loop.group_size=0")
    assert proc.returncode == 2 and "loop.group_size" in proc.stderr
    assert not out.exists()
