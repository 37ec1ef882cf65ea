"""The vllm generator's parts that need no running server: the role, the server command,
endpoint discovery and its errors. (Real servers: tests/integration/test_vllm.py.)"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from forgerl.configuration.config import RunConfig
from forgerl.errors import GeneratorUnreachable
from forgerl.interfaces import RunContext
from forgerl_plugins.generators.vllm import server
from forgerl_plugins.generators.vllm.generator import VLLMGenerator
from forgerl_plugins.serving import launcher
from tests.helpers.timing import scaled


def _ctx(run_dir: Path) -> RunContext:
    return RunContext.for_run(RunConfig.model_validate({"generator": {"name": "vllm"}}), run_dir)


def _generator(options: VLLMGenerator.Options, run_dir: Path):
    """A vllm generator as a run builds it; its transport carries nothing in these tests."""
    from forgerl_plugins.generators.vllm.generator import VLLMGenerator
    from forgerl_plugins.transports.shm.transport import ShmTransport

    transport = ShmTransport(ShmTransport.Options(directory=str(run_dir / "weights")), context=None)
    return VLLMGenerator(options, context=_ctx(run_dir), transport=transport)


def test_the_role_runs_the_launcher_per_replica_and_restarts_it(tmp_path):
    (role,) = server.roles(VLLMGenerator.Options(replicas=3, max_restarts=2), context=_ctx(tmp_path))
    assert role.name == "vllm" and role.replicas == 3 and role.max_restarts == 2 and not role.primary
    # The core's server role entry, which calls VLLMGenerator.serve (tests/unit/test_server_role.py).
    assert role.command[1:] == ("-m", "forgerl.server_role", "--run-dir", str(tmp_path), "--role", "vllm")
    # The replica index comes from FORGE_REPLICA, so one command serves every replica.
    assert "--replica" not in role.command


def test_the_server_command_passes_options_through(tmp_path):
    options = VLLMGenerator.Options(
        tensor_parallel_size=2,
        max_model_len=512,
        kv_cache_gb=0.5,
        enforce_eager=False,
        engine_args={"max_num_seqs": 8, "enable_prefix_caching": False, "enable_chunked_prefill": True},
    )
    cmd = server.server_command(options, tmp_path, "float32", 4321)
    text = " ".join(cmd)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    for part in (
        f"--model {tmp_path}", "--host 127.0.0.1", "--port 4321", "--dtype float32",
        "--tensor-parallel-size 2", "--max-model-len 512", f"--kv-cache-memory-bytes {2**29}",
        "--worker-extension-cls forgerl_plugins.generators.vllm.worker_extension.ForgeWorkerExtension",
        # The trainer's contract is log_softmax(logits / T): vLLM's logprobs after temperature.
        "--logprobs-mode processed_logprobs",
        "--max-num-seqs 8", "--no-enable-prefix-caching", "--enable-chunked-prefill",
    ):  # fmt: skip
        assert part in text, part
    assert "--enforce-eager" not in cmd
    assert "--dtype bfloat16" in " ".join(
        server.server_command(VLLMGenerator.Options(dtype="bfloat16"), tmp_path, "float32", 1)
    )


def test_on_the_cpu_build_prompts_are_prefilled_whole_so_seeds_work(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 2048}')
    monkeypatch.setattr(server, "is_cpu_build", lambda: True)
    text = " ".join(server.server_command(VLLMGenerator.Options(), tmp_path, "float32", 1))
    assert "--no-enable-chunked-prefill --max-num-batched-tokens 2048" in text
    # max_model_len bounds prompts when set; the user's engine_args come last and win.
    options = VLLMGenerator.Options(max_model_len=512, engine_args={"enable_chunked_prefill": True})
    cmd = server.server_command(options, tmp_path, "float32", 1)
    assert "--max-num-batched-tokens 512" in " ".join(cmd)
    assert cmd.index("--enable-chunked-prefill") > cmd.index("--no-enable-chunked-prefill")
    # No seeds, no need: chunked prefill stays on (vLLM's default).
    cmd = server.server_command(VLLMGenerator.Options(send_seed=False), tmp_path, "float32", 1)
    assert "--no-enable-chunked-prefill" not in cmd
    monkeypatch.setattr(server, "is_cpu_build", lambda: False)  # GPU builds rewind seeded generators
    assert "--no-enable-chunked-prefill" not in server.server_command(
        VLLMGenerator.Options(), tmp_path, "float32", 1
    )


def test_the_server_environment_has_dev_mode_and_the_key_but_no_trainer_rendezvous(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("RANK", "0")
    env = server.server_env(VLLMGenerator.Options(env={"VLLM_CPU_OMP_THREADS_BIND": "0"}), "secret")
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_API_KEY"] == "secret"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert "MASTER_PORT" not in env and "RANK" not in env


def test_a_synchronous_run_binds_every_core_to_vllms_cpu_worker():
    """vLLM's CPU build keeps a core out of its binding by default; in a synchronous run
    nothing else needs it while vLLM generates. A user's own binding always wins."""
    from forgerl_plugins.generators.vllm.cpu_cores import binding_env

    assert binding_env(0, {}, {}) == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert binding_env(1, {}, {}) == {}, "overlapping phases share the cores: keep vLLM's split"
    assert binding_env(0, {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}, {}) == {}
    assert binding_env(0, {}, {"VLLM_CPU_OMP_THREADS_BIND": "0"}) == {}


def test_endpoint_files_are_written_atomically_and_privately(tmp_path):
    path = server.endpoint_file(tmp_path, 1)
    launcher.write_endpoint(path, {"port": 1})
    assert json.loads(path.read_text()) == {"port": 1}
    assert path.stat().st_mode & 0o077 == 0, oct(path.stat().st_mode)
    assert [p.name for p in path.parent.iterdir()] == ["vllm-1.json"]


def test_a_replica_that_never_comes_up_is_a_one_line_error_naming_its_log(tmp_path):
    pytest.importorskip("httpx")

    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "vllm-0.log").write_text("loading...\nOSError: no such model\n")
    start = time.monotonic()
    with pytest.raises(GeneratorUnreachable) as err:
        _generator(VLLMGenerator.Options(startup_timeout=1.0), tmp_path)
    message = str(err.value)
    took = time.monotonic() - start
    assert took < scaled(10), f"gave up after {took:.1f} s with startup_timeout 1 s"  # not a hang
    assert "\n" not in message and str(tmp_path / "logs" / "vllm-0.log") in message
    assert "OSError: no such model" in message  # the last thing the server said


def test_a_replica_whose_launcher_reported_a_failure_fails_at_once(tmp_path):
    pytest.importorskip("httpx")

    error = "vLLM failed its first request (HTTP 500: RuntimeError: boom)"
    launcher.write_endpoint(server.endpoint_file(tmp_path, 0), {"error": error, "time": time.time()})
    start = time.monotonic()
    with pytest.raises(
        GeneratorUnreachable, match="replica 0 failed to start: vLLM failed its first request"
    ):
        _generator(VLLMGenerator.Options(startup_timeout=scaled(60)), tmp_path)
    took = time.monotonic() - start
    # At once, not at the startup timeout (six times longer than this bound, at any scale).
    assert took < scaled(10), f"took {took:.1f} s: it waited for its startup timeout"


def test_files_left_by_an_earlier_job_are_not_taken_for_this_ones(tmp_path):
    """A resumed run's directory still holds the last job's endpoint files: an old failure
    report and an endpoint of a server that is gone must not count."""
    pytest.importorskip("httpx")

    from forgerl_plugins.generators.common.replica import process_start_time

    # An hour before this process began (not before now: a test process of a long suite
    # may be older than an hour, and the job's start is what counts).
    old = process_start_time() - 3600
    launcher.write_endpoint(server.endpoint_file(tmp_path, 0), {"error": "old failure", "time": old})
    port = launcher.free_port("127.0.0.1")  # nothing listens there
    launcher.write_endpoint(
        server.endpoint_file(tmp_path, 1),
        {"instance": "old", "host": "127.0.0.1", "port": port, "api_key": "k", "started": old},
    )
    with pytest.raises(GeneratorUnreachable) as err:
        _generator(VLLMGenerator.Options(replicas=2, startup_timeout=1.5), tmp_path)
    assert "did not become healthy" in str(err.value) and "old failure" not in str(err.value)


def test_the_backend_is_registered_with_its_roles():
    from forgerl.registry.plugins import build_registry

    backend = build_registry().get("generator", "vllm")
    assert backend.implemented and backend.requires == ("vllm",) and backend.extra == "vllm"
    assert backend.factory is VLLMGenerator and backend.options is VLLMGenerator.Options
    assert backend.roles is VLLMGenerator.roles and backend.preflight is VLLMGenerator.preflight


@pytest.mark.parametrize(
    ("stage", "prepack", "eager", "asked"),
    [(True, True, True, True), (True, True, False, False), (False, True, True, False), (True, False, True, False)],
)
def test_the_workers_pack_ahead_only_with_staging_on_an_eager_server(tmp_path, stage, prepack, eager, asked):
    """A compiled model (enforce_eager off) may have traced the packed layers into its
    graphs, where a swap under the pause would not reach: it is reloaded instead."""
    from forgerl_plugins.generators.common.replica import Replica
    from forgerl_plugins.generators.vllm.engine import VLLMEngine
    from forgerl_plugins.transports.shm.transport import ShmTransport

    options = VLLMGenerator.Options(stage_updates=stage, prepack_updates=prepack, enforce_eager=eager)
    transport = ShmTransport(ShmTransport.Options(directory=str(tmp_path / "weights")), context=None)
    engine = VLLMEngine(options, context=_ctx(tmp_path), transport=transport)
    r = Replica(0, tmp_path / "log", tmp_path / "vllm-0.json", "vllm")
    assert engine._load_request(r, 3).get("prepack", False) is asked
    assert "prepack" not in engine._load_request(r, 0)  # the base model, from its folder
