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

from forgerl_plugins.serving import liveness
from forgerl_plugins.serving.launcher import free_port, healthy
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
        if _alive(engine):  # a test that ended the server orphaned its child: ours to end
            os.kill(engine, signal.SIGKILL)


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


# ------------------------------------------------------------------ probes through the engine

ENGINE_SERVER = textwrap.dedent(
    """
    import http.server, sys, threading
    mode = sys.argv[2]  # "stuck": the engine never answers; "busy": it makes tokens, its queue is full
    made = [0]
    stuck = threading.Event()

    class Server(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/health":  # like vLLM's: answered by the HTTP process alone
                self.send_response(200)
                self.end_headers()
            elif self.path == "/metrics":
                if mode == "busy":
                    made[0] += 5
                body = (
                    "# TYPE vllm:generation_tokens_total counter\\n"
                    f'vllm:generation_tokens_total{{engine="0",model_name="m"}} {made[0]}.0\\n'
                    'vllm:prompt_tokens_total{engine="0",model_name="m"} 7.0\\n'
                ).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            else:
                self.send_response(404)
                self.end_headers()
        def do_POST(self):
            stuck.wait()  # a completion waits on the engine: forever here
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Server)
    server.daemon_threads = True
    print("up", flush=True)
    server.serve_forever()
    """
)


def _engine_server(mode: str) -> tuple[subprocess.Popen, str]:
    port = free_port("127.0.0.1")
    child = subprocess.Popen([sys.executable, "-c", ENGINE_SERVER, str(port), mode], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "up"
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: healthy(url, 1.0), 30, "the stand-in server to answer /health")
    return child, url


@pytest.fixture
def engine_server(request):
    child, url = _engine_server(request.param)
    try:
        yield child, url
    finally:
        liveness.kill_tree(child.pid)
        child.wait()


@pytest.mark.parametrize("engine_server", ["stuck"], indirect=True)
def test_a_server_whose_engine_is_stuck_is_killed_though_health_answers(engine_server):
    from forgerl_plugins.generators.vllm.server import EngineProbe

    child, url = engine_server
    probe = EngineProbe(url, "key")
    why = liveness.watch(child, lambda t: probe(min(t, 0.5)), interval=0.1, timeout=1.0, what="its engine")
    assert why is not None and "did not answer its engine" in why and "killed as hung" in why, why
    assert child.returncode == -signal.SIGKILL
    assert healthy(url, 0.5) is False  # gone now; it answered /health until the kill (the fixture checked)


@pytest.mark.parametrize("engine_server", ["busy"], indirect=True)
def test_an_engine_that_makes_tokens_is_alive_though_no_probe_gets_through(engine_server):
    from forgerl_plugins.generators.vllm.server import EngineProbe

    child, url = engine_server
    probe = EngineProbe(url, "key")
    answers: list[bool] = []

    def counted(timeout: float) -> bool:
        answers.append(probe(0.3))  # a completion would never answer: its progress must count
        if len(answers) == 8:
            child.terminate()
        return answers[-1]

    assert liveness.watch(child, counted, interval=0.05, timeout=0.5) is None
    assert answers[0] is False  # nothing to compare with yet: the one-token probe timed out
    assert all(answers[1:8]), answers  # far past the timeout, alive on progress alone
    assert child.returncode == -signal.SIGTERM


def test_a_paused_engine_is_excused_while_the_generators_notice_is_fresh(server, tmp_path):
    """The generator paused the engine for a weight load: no probe answers, and the watch
    waits as long as the notice is renewed, then kills after a whole timeout of silence."""
    import asyncio
    import threading
    import time

    from forgerl_plugins.generators.common.update_notice import NoticeReader, UpdateNotice

    child, _engine, _url = server
    endpoint = tmp_path / "vllm-0.json"
    reader = NoticeReader(endpoint, "instance-a")
    stranger = NoticeReader(endpoint, "instance-b")  # a server started since: not its update
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    # Renewed every lease / 3 by a thread of its own: a lease far longer than the looks
    # (20 x 0.05 s), so that a loaded machine starving that thread for a moment cannot make
    # the notice lapse mid-load. Its end is the notice's removal, seen at once.
    notice = UpdateNotice(endpoint, "instance-a", lease=3.0)
    asyncio.run_coroutine_threadsafe(notice.start(), loop).result(10)
    excused: list[bool] = []
    ended: list[float] = []
    last_seen: list[float] = []

    def probe(timeout: float) -> bool:
        return False  # a paused (or stuck) engine answers nothing

    def updating() -> bool:
        if len(excused) == 20 and not ended:  # 20 looks, several timeouts long: the load ends
            asyncio.run_coroutine_threadsafe(notice.stop(), loop).result(10)
            ended.append(time.monotonic())
        excused.append(reader.updating())
        if excused[-1]:
            last_seen[:] = [time.monotonic()]
        assert not stranger.updating(), "a notice excused another instance's server"
        return excused[-1]

    try:
        why = liveness.watch(child, probe, interval=0.05, timeout=0.5, excused=updating)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(10)
    assert why is not None and "killed as hung" in why, why
    assert ended, "killed while the notice was fresh"
    assert all(excused[:20]), excused
    assert time.monotonic() - last_seen[0] >= 0.5, "killed before a whole timeout had passed after the update"
    assert not notice.path.exists()


def test_a_notice_that_is_not_renewed_lapses(tmp_path):
    """A generator that died mid-update excuses its server for one lease, not for ever."""
    import json
    import time

    from forgerl_plugins.generators.common.update_notice import NoticeReader, notice_file

    endpoint = tmp_path / "vllm-0.json"
    notice_file(endpoint).write_text(json.dumps({"instance": "a", "beat": 1, "lease": 0.3, "pid": 1}))
    reader = NoticeReader(endpoint, "a")
    assert reader.updating()
    wait_until(lambda: not reader.updating(), 10, "the unrenewed notice to lapse")
    start = time.monotonic()
    assert not reader.updating() and time.monotonic() - start < 1


def test_the_engine_probe_sends_a_completion_at_most_once_per_spacing(monkeypatch):
    """A one-token completion at every health check kept a CPU engine's threads busy on
    every core and starved a second replica starting beside it for minutes: between
    completions the engine counts as alive as of the last one that answered."""
    from forgerl_plugins.generators.vllm import server

    sent: list[float] = []
    monkeypatch.setattr(server, "tokens_processed", lambda url, key, timeout: None)  # stats off
    monkeypatch.setattr(server, "one_token", lambda url, key, timeout: sent.append(timeout) or True)
    spaced = server.EngineProbe("http://x", "key", spacing=3600.0)
    passed = []
    for _ in range(5):
        assert spaced(1.0)
        passed.append(spaced.answered)
    assert len(sent) == 1, sent
    # Only the completion is an answer of the engine: the launcher counts that one for the
    # clients, not the passes in between (forgerl_plugins.serving.service).
    assert passed == [True, False, False, False, False]
    sent.clear()
    every_time = server.EngineProbe("http://x", "key")
    assert all(every_time(1.0) for _ in range(5)) and len(sent) == 5, sent
