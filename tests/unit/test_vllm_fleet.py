"""Attaching a run to a shared vLLM fleet (``generator.options.fleet``): what is refused,
with one line and exit status 2, before anything starts; the fleet's server flags; the
names runs' adapters are served under. Serving itself: tests/integration/test_vllm_fleet.py."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.timing import scaled

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")


def _fleet(directory: Path, model: str = "tiny", *, endpoints: int = 1, max_rank: int = 16) -> Path:
    """A fleet directory as the fleet's process leaves it (``endpoints`` servers up)."""
    directory.mkdir(parents=True, exist_ok=True)
    info = {"directory": str(directory), "model": model, "replicas": 1, "max_adapters": 2, "max_rank": max_rank}
    (directory / "fleet.json").write_text(json.dumps(info))
    for i in range(endpoints):
        (directory / "generators").mkdir(exist_ok=True)
        (directory / "generators" / f"vllm-{i}.json").write_text(json.dumps({"host": "127.0.0.1", "port": 1}))
    return directory


def _forge_run(tmp_path: Path, *sets: str) -> subprocess.CompletedProcess:
    args = ["run", "--model", "tiny", "--generator", "vllm", "--dry-run", "--output", str(tmp_path / "out")]
    for s in sets:
        args += ["--set", s]
    env = {k: v for k, v in os.environ.items() if k != "FORGE_DEBUG"}
    return subprocess.run(
        [sys.executable, "-m", "forgerl.cli", *args], capture_output=True, text=True, env=env, timeout=scaled(60)
    )


def _one_line(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@needs_vllm
def test_a_full_weight_run_is_refused_a_shared_fleet(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path / "fleet")
    _one_line(_forge_run(tmp_path, f"generator.options.fleet={fleet}"), "must train a LoRA adapter", "lora.rank")


@needs_vllm
def test_a_fleet_directory_that_does_not_exist_or_is_no_fleet_is_refused(tmp_path: Path) -> None:
    lora = "trainer.options.lora.rank=8"
    missing = tmp_path / "nowhere"
    _one_line(_forge_run(tmp_path, lora, f"generator.options.fleet={missing}"), "does not exist", "start the fleet")
    (tmp_path / "plain").mkdir()
    _one_line(_forge_run(tmp_path, lora, f"generator.options.fleet={tmp_path / 'plain'}"), "not a generator fleet")
    stopped = _fleet(tmp_path / "stopped", endpoints=0)
    _one_line(_forge_run(tmp_path, lora, f"generator.options.fleet={stopped}"), "no server endpoint", "running")


@needs_vllm
def test_a_run_on_another_base_model_than_the_fleet_is_refused(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path / "fleet", model="/models/some-other-model")
    proc = _forge_run(tmp_path, "trainer.options.lora.rank=8", f"generator.options.fleet={fleet}")
    _one_line(proc, "serves model '/models/some-other-model'", "trains 'tiny'")


def test_what_else_a_fleet_cannot_take_is_refused(tmp_path: Path) -> None:
    from forgerl.adapters import LoraOptions
    from forgerl.errors import ConfigError
    from forgerl.interfaces import RunContext
    from forgerl_plugins.generators.vllm.generator import VLLMGenerator

    fleet = _fleet(tmp_path / "fleet", max_rank=8)
    context = RunContext(run_dir=tmp_path / "run", model_name="tiny", adapter=LoraOptions(rank=16))
    options = VLLMGenerator.Options(fleet=str(fleet))
    with pytest.raises(ConfigError, match="above the fleet's largest rank 8"):
        VLLMGenerator.roles(options, context=context)
    context = RunContext(run_dir=tmp_path / "run", model_name="tiny", adapter=LoraOptions(rank=8))
    with pytest.raises(ConfigError, match="update_policy abort"):
        VLLMGenerator.roles(VLLMGenerator.Options(fleet=str(fleet), update_policy="abort"), context=context)
    # All well: the run starts no server of its own.
    assert VLLMGenerator.roles(options, context=context) == []


def test_each_run_has_an_adapter_name_of_its_own(tmp_path: Path) -> None:
    from forgerl.interfaces import RunContext
    from forgerl_plugins.generators.vllm.fleet import adapter_name

    a = adapter_name(RunContext(run_dir=tmp_path / "runs" / "a"))
    b = adapter_name(RunContext(run_dir=tmp_path / "other" / "a"))  # the same last part
    assert a != b and a.startswith("forge-adapter-a-")
    assert adapter_name(RunContext(run_dir=tmp_path / "runs" / "a")) == a  # a resumed run: its own again
    odd = adapter_name(RunContext(run_dir=tmp_path / "we ird/../x y"))
    assert all(c.isalnum() or c in "-_." for c in odd), odd


def test_the_fleets_servers_hold_as_many_adapters_as_asked(tmp_path: Path) -> None:
    from forgerl.interfaces import RunContext
    from forgerl_plugins.generators.vllm import fleet, server

    config = fleet.fleet_config("tiny", max_adapters=3, max_rank=12)
    context = RunContext.for_run(config, tmp_path)
    assert context.adapter is not None
    flags = server.adapter_flags(context.adapter, config.generator.options.max_adapters)
    assert flags == ["--enable-lora", "--max-loras", "3", "--max-cpu-loras", "3", "--max-lora-rank", "16"]


def test_the_fleet_command_refuses_another_generator_with_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "FORGE_DEBUG"}
    proc = subprocess.run(
        [sys.executable, "-m", "forgerl.cli", "fleet", "--dir", str(tmp_path / "f"),
         "--model", "tiny", "--set", "generator.options.fleet=/elsewhere"],
        capture_output=True, text=True, env=env, timeout=scaled(60),
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "forge: error: a fleet's servers attach to no other fleet: leave generator.options.fleet unset"
    ]
    assert not (tmp_path / "f").exists()  # nothing started


def test_forge_fleet_refuses_a_generator_that_serves_no_fleet_with_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "FORGE_DEBUG"}
    proc = subprocess.run(
        [sys.executable, "-m", "forgerl.cli", "fleet", "--generator", "hf", "--dir", str(tmp_path / "f"), "--model", "tiny"],
        capture_output=True, text=True, env=env, timeout=scaled(60),
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("forge: error: generator 'hf' cannot serve a shared fleet"), lines
    assert "--generator vllm" in lines[0]
    assert not (tmp_path / "f").exists()


def test_a_directory_with_a_running_fleet_is_refused_a_second_one(tmp_path: Path) -> None:
    from forgerl.errors import ConfigError
    from forgerl_plugins.generators.vllm import fleet

    directory = _fleet(tmp_path / "fleet")
    config = fleet.fleet_config("tiny", max_adapters=2, max_rank=8)
    endpoint = directory / "generators" / "vllm-0.json"
    endpoint.write_text(json.dumps({"host": "127.0.0.1", "port": 1, "pid": os.getpid()}))  # a live server's
    with pytest.raises(ConfigError, match="holds a running fleet"):
        with fleet.started(directory, config):
            pass
    assert not (directory / "config.yaml").exists()  # nothing written, nothing started


def test_forge_fleet_refuses_a_mistyped_model_before_it_starts_anything(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "FORGE_DEBUG"}
    proc = subprocess.run(
        [sys.executable, "-m", "forgerl.cli", "fleet", "--dir", str(tmp_path / "f"), "--model", "smollm-135"],
        capture_output=True, text=True, env=env, timeout=scaled(60),
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "forge: error: no named model 'smollm-135'; did you mean 'smollm2-135m-instruct'? "
        "(named models: smollm2-135m-instruct, tiny, tiny-vl)"
    ]
    assert not (tmp_path / "f").exists()  # nothing started


def test_a_fleet_whose_servers_stop_for_good_ends_with_one_line(tmp_path: Path) -> None:
    # The core's loop against a generator class whose fleet's servers have spent their
    # restarts: it must say why and exit 1, not wait for Ctrl-C forever.
    from contextlib import contextmanager
    from types import SimpleNamespace

    from forgerl.fleet import serve_fleet

    class Fleet:
        replicas, model, directory = 1, "tiny", tmp_path

        def ready(self) -> bool:
            return False

        def ended(self) -> str | None:
            return "role 'vllm' replica 0 exited with code 1 after 3 restarts"

    class Generator:
        @staticmethod
        @contextmanager
        def start_fleet(directory, **kwargs):
            yield Fleet()

    backend = SimpleNamespace(factory=Generator, load_part=lambda ref, part: ref)
    registry = SimpleNamespace(require=lambda kind, name: backend)
    said: list[str] = []
    failed: list[str] = []
    code = serve_fleet(registry, "fake", tmp_path, model="tiny", max_adapters=1, max_rank=8,  # type: ignore[arg-type]
                       say=said.append, fail=failed.append)  # fmt: skip
    assert code == 1
    assert failed == ["forge fleet: error: the fleet's servers stopped: role 'vllm' replica 0 exited with code 1 "
                      "after 3 restarts"]  # fmt: skip
    assert not any("ready" in line for line in said)
