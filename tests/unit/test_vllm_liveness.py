"""The launcher's liveness watch: a server that stops answering is killed with its children.

Real processes, no vLLM: a small HTTP server that answers ``/health`` and has a child of
its own stands in for vLLM's API server and its engine process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from forgerl_plugins.generators.common import liveness
from forgerl_plugins.generators.vllm.server import free_port, healthy
from tests.helpers.timing import wait_until

SERVER = textwrap.dedent(
    """
    import http.server, subprocess, sys
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"])
    print(engine.pid, flush=True)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
    """
)


@pytest.fixture
def server():
    port = free_port("127.0.0.1")
    child = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], stdout=subprocess.PIPE, text=True)
    engine = int(child.stdout.readline())
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: healthy(url, 1.0), 30, "the stand-in server to answer /health")
        yield child, engine, url
    finally:
        liveness.kill_tree(child.pid)
        child.wait()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended; only its parent has not reaped it yet


def test_a_stopped_server_is_killed_with_its_children(server):
    child, engine, url = server
    os.kill(child.pid, signal.SIGSTOP)
    why = liveness.watch(child, lambda t: healthy(url, t), interval=0.1, timeout=1.0)
    assert why is not None and "did not answer /health" in why, why
    assert child.returncode == -signal.SIGKILL
    wait_until(lambda: not _alive(engine), 10, f"the server's child {engine} to end")


def test_a_server_that_answers_is_left_alone_until_it_exits(server):
    child, engine, url = server
    answers: list[bool] = []

    def probe(timeout: float) -> bool:
        answers.append(healthy(url, timeout))
        if len(answers) == 10:  # ten answered probes, far longer than the timeout, then it exits
            child.terminate()
        return answers[-1]

    why = liveness.watch(child, probe, interval=0.1, timeout=0.3)
    assert why is None, why
    assert all(answers[:10]), answers
    assert child.returncode == -signal.SIGTERM
    assert _alive(engine), "the watch killed a live server's child"


def test_a_launcher_that_is_stopping_does_not_kill(server):
    child, _engine, _url = server
    os.kill(child.pid, signal.SIGSTOP)
    stopping = [False]

    def probe(timeout: float) -> bool:
        stopping[0] = True  # the scheduler asked the launcher to stop meanwhile
        os.kill(child.pid, signal.SIGCONT)
        child.terminate()
        return False

    assert liveness.watch(child, probe, interval=0.1, timeout=0.1, stopping=lambda: stopping[0]) is None
    assert child.returncode == -signal.SIGTERM
