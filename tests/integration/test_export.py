"""`forge export RUN_DIR --output DIR`: the policy of a run's checkpoint as a Hugging Face
folder that plain transformers loads with the trainer's logprobs (a LoRA adapter merged,
or written alone for PEFT), and one-line errors for what a user can get wrong.

A run directory is made as a run makes it, in process and cheaply: its config.yaml, and
checkpoints written by ``forgerl.checkpoints.checkpoint.save`` with the fsdp trainer's own ``save``
after real training steps on the tiny model."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from forgerl.testing.trainer_support import next_token_logprobs, reference_model  # noqa: E402
from tests.helpers import trainer_worker as worker  # noqa: E402

pytestmark = pytest.mark.integration

LORA = {"rank": 8, "alpha": 16}
TOL = 1e-5


def _make_run(model_dir: Path, run_dir: Path, lora: dict | None) -> tuple[object, dict[int, torch.Tensor]]:
    """A run directory with checkpoints of steps 1 and 2; the batch and the trainer's
    logprobs of it at each checkpoint."""
    from forgerl.checkpoints import checkpoint
    from forgerl.checkpoints.checkpoint_format import Snapshot, capture_rng
    from forgerl.configuration.config import RunConfig
    from forgerl.rundirs.runs import write_config

    options = {"lora": lora} if lora else {}
    config = RunConfig.model_validate(
        {"model": {"name": str(model_dir)}, "trainer": {"name": "fsdp", "options": options}, "loop": {"seed": 0}}
    )
    run_dir.mkdir()
    write_config(run_dir, config)
    trainer = worker.make_trainer(model_dir, run_dir, 2, **options)
    logprobs = {}
    try:
        batch = worker.on_policy(trainer, worker.make_batch(model_dir, rows=3, seed=4))
        for step in (1, 2):
            trainer.train_step(batch)
            rng, arrays = capture_rng()
            state = {"step": step, "policy_version": step, "task_state": {}, "next_rollout_index": step,
                     "time_totals": {}, "eval_start": None, "eval_last": None, "rng": rng}
            checkpoint.save(run_dir, step, Snapshot(state=state, arrays=arrays), trainer.save, keep=5)
            logprobs[step] = trainer.logprobs(batch)
    finally:
        trainer.close()
    return batch, logprobs


def forge_export(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``forge export ARGS`` in this process: exit status, stdout, stderr."""
    from forgerl.cli import main

    capsys.readouterr()
    try:
        main(["export", *args])
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def _logprobs_of(folder: Path, batch) -> torch.Tensor:
    return next_token_logprobs(reference_model(folder), batch, worker.TEMPERATURE)


@pytest.fixture(scope="module")
def full_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    run_dir = tmp_path_factory.mktemp("full") / "run"
    return run_dir, *_make_run(tiny_model_dir, run_dir, None)


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("peft")
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    return run_dir, *_make_run(tiny_model_dir, run_dir, LORA)


def _assert_policy(folder: Path, batch, expected: torch.Tensor, model_dir: Path) -> None:
    got = _logprobs_of(folder, batch)
    diff = worker.attended_diff(got, expected, batch)
    assert diff <= TOL, f"the exported model's logprobs are {diff} from the trainer's"
    base = _logprobs_of(model_dir, batch)
    assert worker.attended_diff(got, base, batch) > 1e-4, "the exported model is the base model"


def test_full_weight_run_exports_the_trained_policy(full_run, tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    run_dir, batch, logprobs = full_run
    out = tmp_path / "model"
    code, stdout, err = forge_export(str(run_dir), "--output", str(out), capsys=capsys)
    assert code == 0, err
    assert stdout.strip() == str(out)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer_config.json"} <= names, names
    assert not list(out.parent.glob(".model.tmp-*")), "the temporary folder was left behind"
    _assert_policy(out, batch, logprobs[2], tiny_model_dir)

    # --step picks an older checkpoint: the policy after one step, not two.
    older = tmp_path / "step1"
    assert forge_export(str(run_dir), "--output", str(older), "--step", "1", capsys=capsys)[0] == 0
    _assert_policy(older, batch, logprobs[1], tiny_model_dir)
    assert worker.attended_diff(logprobs[1], logprobs[2], batch) > 1e-5, "steps 1 and 2 are the same policy"


def test_lora_run_exports_a_merged_model(lora_run, tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    run_dir, batch, logprobs = lora_run
    out = tmp_path / "merged"
    code, _, err = forge_export(str(run_dir), "--output", str(out), capsys=capsys)
    assert code == 0, err
    assert not (out / "adapter_config.json").exists(), "a merged model is a plain model"
    _assert_policy(out, batch, logprobs[2], tiny_model_dir)


def test_lora_adapter_only_loads_in_peft(lora_run, tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    from peft import PeftModel

    run_dir, batch, logprobs = lora_run
    out = tmp_path / "adapter"
    code, _, err = forge_export(str(run_dir), "--output", str(out), "--adapter-only", capsys=capsys)
    assert code == 0, err
    assert {p.name for p in out.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    assert json.loads((out / "adapter_config.json").read_text())["r"] == LORA["rank"]
    model = PeftModel.from_pretrained(reference_model(tiny_model_dir), str(out)).eval()
    got = next_token_logprobs(model, batch, worker.TEMPERATURE)
    assert worker.attended_diff(got, logprobs[2], batch) <= TOL
    assert worker.attended_diff(got, _logprobs_of(tiny_model_dir, batch), batch) > 1e-4


def test_mistakes_are_one_line_and_leave_nothing(full_run, tmp_path: Path, capsys, monkeypatch) -> None:
    run_dir, _, _ = full_run
    empty_run = tmp_path / "fresh"
    empty_run.mkdir()
    (empty_run / "config.yaml").write_text((run_dir / "config.yaml").read_text())
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    # Unwritable even for root (who may write into a folder without write permission).
    unwritable = Path("/proc") / f"forgerl-export-{tmp_path.name}"
    titan_run = tmp_path / "titan"
    shutil.copytree(run_dir, titan_run)
    config = titan_run / "config.yaml"
    config.write_text(config.read_text().replace("name: fsdp", "name: torchtitan"))
    assert "name: torchtitan" in config.read_text()
    cases = [
        ([str(run_dir), "--output", str(tmp_path / "o7"), "--step", "-1"], "--step"),
        ([str(tmp_path / "nowhere"), "--output", str(tmp_path / "o1")], "not a run directory"),
        ([str(tmp_path), "--output", str(tmp_path / "o2")], "not a run directory"),
        ([str(empty_run), "--output", str(tmp_path / "o3")], "has no checkpoint"),
        ([str(run_dir), "--output", str(tmp_path / "o4"), "--step", "7"], "no checkpoint of step 7; its checkpoints are of steps: 1, 2"),
        ([str(run_dir), "--output", str(full)], "exists and is not empty"),
        ([str(run_dir), "--output", str(unwritable)], "not writable|cannot write"),
        ([str(run_dir), "--output", str(tmp_path / "o5"), "--adapter-only"], "not a LoRA adapter"),
    ]
    for args, message in cases:
        code, _, err = forge_export(*args, capsys=capsys)
        assert code == 2, (args, err)
        assert re.search(message, err) and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (args, err)
    # A torchtitan run where TorchTitan is not installed (test_torchtitan_export.py exports
    # torchtitan runs where it is).
    monkeypatch.setitem(sys.modules, "torchtitan", None)  # find_spec: not installed
    code, _, err = forge_export(str(titan_run), "--output", str(tmp_path / "o6"), capsys=capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert re.search(r"needs the torchtitan trainer it was trained with, unavailable here: needs torchtitan: pip install", err), err
    assert (full / "keep.txt").read_text() == "mine" and len(list(full.iterdir())) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "full", "titan"], (
        "a failed export left something behind"
    )


def test_a_checkpoint_that_fails_while_exporting_leaves_nothing(full_run, tmp_path: Path, capsys) -> None:
    run_dir, _, _ = full_run
    broken = tmp_path / "run"
    shutil.copytree(run_dir, broken)
    metadata = broken / "checkpoints" / "step-000002" / "trainer" / ".metadata"
    metadata.write_bytes(b"x" * metadata.stat().st_size)  # same size: only reading it tells
    code, _, err = forge_export(str(broken), "--output", str(tmp_path / "model"), capsys=capsys)
    assert code == 2 and ".metadata" in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"], "a failed export left something behind"


def test_a_real_lora_run_exports_one_policy_both_ways(tmp_path: Path, capsys) -> None:
    """A real `forge run` (named model, hf generator, fsdp trainer process) writes the
    config.yaml and checkpoint `forge export` reads: the merged folder and the adapter on
    its base give the same logprobs, which are not the base model's."""
    import subprocess
    import sys

    from peft import PeftModel

    from forgerl.configuration.config import ModelConfig
    from forgerl.models.resolve import resolve_model
    from forgerl.testing.registry import registry_for

    from ..helpers.timing import scaled

    run_dir = tmp_path / "run"
    # test_run_e2e.py's small run: a format reward random text sometimes satisfies, so the
    # group's rewards vary and the one step moves the adapter.
    args = ["--model", "tiny", "--generator", "hf", "--steps", "1", "--reward", "format",
            "--set", "rewards.0.options.pattern=\\d", "--set", "loop.prompts_per_step=2",
            "--set", "loop.group_size=4", "--set", "loop.sampling.max_tokens=12", "--set", "loop.eval_size=4",
            "--set", "trainer.options.lr=1e-3", "--set", "trainer.options.autocast_bf16=false",
            "--set", "trainer.options.lora.rank=8", "--output", str(run_dir), "-q"]
    proc = subprocess.run([sys.executable, "-m", "forgerl.cli", "run", *args], capture_output=True, text=True,
                          timeout=scaled(300))
    assert proc.returncode == 0, proc.stderr[-2000:]
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    assert forge_export(str(run_dir), "--output", str(merged), capsys=capsys)[0] == 0
    assert forge_export(str(run_dir), "--output", str(adapter), "--adapter-only", capsys=capsys)[0] == 0

    base_dir = resolve_model(ModelConfig(name="tiny"), registry_for())
    batch = worker.make_batch(base_dir, rows=3, seed=4)
    got = _logprobs_of(merged, batch)
    peft = PeftModel.from_pretrained(reference_model(base_dir), str(adapter)).eval()
    assert worker.attended_diff(got, next_token_logprobs(peft, batch, worker.TEMPERATURE), batch) <= TOL
    assert worker.attended_diff(got, _logprobs_of(base_dir, batch), batch) > 1e-4, "the step changed nothing"
