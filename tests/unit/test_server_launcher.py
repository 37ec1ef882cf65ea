"""The launcher every served engine shares (forgerl_plugins.serving.launcher.serve), with a
stand-in server on loopback: the served reward model's uses of it (its own folder for the
endpoint file, fields its first request learned), the server's environment and engine
flags. (The role's command line: tests/unit/test_server_role.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from forgerl_plugins.rewards import reward_server
from forgerl_plugins.serving import launcher
from forgerl_plugins.serving.service import answers_file, read_answers
from tests.helpers.timing import scaled, wait_until

STAND_IN = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass

HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""

# Runs serve() in its own process: it installs signal handlers and blocks while it watches.
LAUNCHER = """
import os, sys
from pathlib import Path
from forgerl_plugins.serving import launcher

run_dir, first, stand_in, startup = Path(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4])

class Starting:
    def done(self):
        pass

plan = launcher.ServerPlan(
    role="reward-model-test", engine="Stand-in", host="127.0.0.1",
    startup_timeout=startup, health_interval=0.2, liveness_timeout=startup,
    command=lambda port: [sys.executable, stand_in, str(port)], env=dict(os.environ), api_key="key",
    first_request=lambda url, key: {"num_labels": 3} if first == "labels" else first,
    explain=lambda problem: f"could not classify ({problem})",
    endpoint={"model": "served"}, endpoint_dir="rewards",
)
sys.exit(launcher.serve(plan, run_dir, 0, Starting()))
"""


def _launch(tmp_path: Path, first: str) -> subprocess.Popen:
    (tmp_path / "stand_in.py").write_text(STAND_IN)
    (tmp_path / "launch.py").write_text(LAUNCHER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return subprocess.Popen(
        [sys.executable, str(tmp_path / "launch.py"), str(tmp_path), first,
         str(tmp_path / "stand_in.py"), str(scaled(60))],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def _endpoint(tmp_path: Path) -> dict[str, Any] | None:
    path = reward_server.endpoint_file(tmp_path, "reward-model-test", 0)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def test_the_endpoint_file_is_in_the_plans_folder_with_what_the_first_request_learned(tmp_path):
    child = _launch(tmp_path, "labels")
    try:
        data = wait_until(lambda: _endpoint(tmp_path), 60, "the endpoint file")
        assert data["num_labels"] == 3 and data["model"] == "served" and data["api_key"] == "key"
        assert not (tmp_path / launcher.ENDPOINT_DIR).exists(), "a reward's endpoint among the generators'"
        os.kill(int(data["pid"]), signal.SIGKILL)  # the server dies: the launcher says so
        assert child.wait(scaled(60)) == 128 + signal.SIGKILL
        assert _endpoint(tmp_path) is None, "a dead server's endpoint file was left behind"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_beside_the_endpoint_the_launcher_counts_the_probes_its_server_answered(tmp_path):
    """What a client reads to tell a server back in service (forgerl_plugins.serving.service):
    the count names the server's instance, grows with each probe answered, and goes with
    the server."""
    child = _launch(tmp_path, "labels")
    try:
        data = wait_until(lambda: _endpoint(tmp_path), 60, "the endpoint file")
        endpoint = reward_server.endpoint_file(tmp_path, "reward-model-test", 0)
        first = read_answers(endpoint, data["instance"])
        assert first is not None, "no count beside the endpoint file"
        wait_until(lambda: (read_answers(endpoint, data["instance"]) or 0) >= first + 2, 60, "two more answers")
        os.kill(int(data["pid"]), signal.SIGKILL)
        child.wait(scaled(60))
        assert not answers_file(endpoint).exists(), "a dead server's count was left behind"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_failed_first_request_is_written_as_the_error_with_the_plans_advice(tmp_path):
    child = _launch(tmp_path, "no /classify")
    output, _ = child.communicate(timeout=scaled(60))
    assert child.returncode == 1, output
    data = _endpoint(tmp_path)
    assert data is not None and data["error"] == "could not classify (no /classify)", data
    assert data["launcher_pid"] == child.pid and "port" not in data
    assert "forge reward-model-test launcher: could not classify (no /classify)" in output


def test_a_server_environment_has_no_trainer_rendezvous_and_the_users_env(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("RANK", "3")
    env = launcher.server_env({"X": "y"})
    assert "MASTER_PORT" not in env and "RANK" not in env
    assert env["X"] == "y" and env["PYTHONUNBUFFERED"] == "1"


def test_engine_arguments_become_each_engines_flags():
    from forgerl_plugins.generators.sglang.server import server_arg_flags
    from forgerl_plugins.serving.vllm_server import engine_arg_flags

    arguments = {"max_num_seqs": 8, "enable_x": True, "enable_y": False, "z": None, "ids": [1, 2], "cfg": {"a": 1}}
    common = ["--max-num-seqs", "8", "--enable-x", "--ids", "1", "2", "--cfg", '{"a": 1}']
    assert engine_arg_flags(arguments) == [*common[:3], "--no-enable-y", *common[3:]]  # vLLM spells false
    assert server_arg_flags(arguments) == common  # SGLang's booleans are bare flags: false is no flag
