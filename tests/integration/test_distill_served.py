"""Distillation with a teacher served by vLLM (CPU build, tiny models).

- A server at a URL (the session's shared vLLM server, tests/helpers/shared_vllm.py):
  its prompt logprobs of the student's tokens equal a transformers forward pass of the
  same model, and a sequence the server refuses fails alone.
- The run's own teacher server (``server: vllm``, a role of the run started by the local
  scheduler): every path needs the run's key; killed between two steps, the step that
  finds it dead fails its samples (the run goes on), the scheduler restarts it, and the
  next step is scored again.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.helpers.hold_at_step import hold_env, marker, release
from tests.helpers.timing import scaled, wait_until

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (pip install 'forgerl[vllm]')"),
]

FORGE = [sys.executable, "-m", "forgerl.cli"]
#: Served vs in-process logprobs, both fp32: the kernels differ, the tokens do not.
ATOL = 1e-4
SERVER_WAIT = 420.0  # a vLLM server's start on a busy two-core machine


def sequences(model_dir: Path) -> list[tuple[tuple[int, ...], int]]:
    """Prompts (chat-templated) with continuations, as the loop sends them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for i, (question, answer) in enumerate([("What is 3 + 4?", "The answer is <answer>7</answer>."),
                                            ("What is 12 * 3?", "think first: 12 times 3 is 36"),
                                            ("Say hi.", "hi")]):
        prompt = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)
        ids = tok(prompt + answer, add_special_tokens=False)["input_ids"]
        out.append((tuple(ids), len(tok(prompt, add_special_tokens=False)["input_ids"]) - i % 2))
    return out


def test_a_teacher_at_a_url_scores_like_a_forward_pass(shared_vllm, monkeypatch):
    from forgerl.distill import TeacherRequest
    from forgerl.distill.scoring import TeacherScorer
    from forgerl_plugins.teachers.local import LocalTeacher
    from forgerl_plugins.teachers.model import ModelTeacher

    endpoint = shared_vllm.openai_endpoint()
    monkeypatch.setenv("DISTILL_TEST_KEY", endpoint.api_key)
    options = ModelTeacher.Options(model=str(endpoint.model_dir), url=endpoint.base_url, auth_env="DISTILL_TEST_KEY",
                                   batch_size=2, request_timeout=scaled(60))
    requests = [TeacherRequest(ids, start) for ids, start in sequences(endpoint.model_dir)]
    served = TeacherScorer(ModelTeacher(options, context=None), timeout=scaled(120))  # type: ignore[arg-type]
    try:
        through_server = served.score(requests)
        # Longer than the server's context (1024 positions): refused; the others still scored.
        too_long = TeacherRequest(tuple([5] * 1100), 10)
        mixed = served.score([requests[0], too_long, requests[1]])
    finally:
        served.close()
    local = LocalTeacher(endpoint.model_dir, device="cpu", dtype="float32").score(requests)
    assert through_server.failed == 0, through_server.errors
    for got, want in zip(through_server.scores, local):
        assert got is not None
        assert got.logprobs == pytest.approx(want.logprobs, abs=ATOL)
        assert got.top1 == want.top1
    assert len({round(v, 2) for s in local for v in s.logprobs}) > 5, "the tokens score differently"
    assert mixed.scores[1] is None and mixed.scores[0] is not None and mixed.scores[2] is not None, mixed.errors
    assert mixed.retried


def test_a_teacher_at_a_url_without_the_key_fails_its_samples(shared_vllm, monkeypatch):
    from forgerl.distill import TeacherRequest
    from forgerl.distill.scoring import TeacherScorer
    from forgerl_plugins.teachers.model import ModelTeacher

    endpoint = shared_vllm.openai_endpoint()
    monkeypatch.setenv("DISTILL_TEST_KEY", "not-the-key")
    options = ModelTeacher.Options(model=str(endpoint.model_dir), url=endpoint.base_url, auth_env="DISTILL_TEST_KEY")
    scorer = TeacherScorer(ModelTeacher(options, context=None), timeout=scaled(60))  # type: ignore[arg-type]
    try:
        result = scorer.score([TeacherRequest((1, 2, 3), 1)])
    finally:
        scorer.close()
    assert result.scores == [None] and "401" in (result.errors[0] or ""), result.errors


# ------------------------------------------------------------- the run's own teacher server


def _endpoint(run_dir: Path) -> dict | None:
    files = sorted((run_dir / "teachers").glob("teacher-*-0.json")) if (run_dir / "teachers").is_dir() else []
    if not files:
        return None
    try:
        data = json.loads(files[0].read_text())
    except (OSError, ValueError):
        return None
    return data if data.get("port") else None


def test_a_served_teacher_killed_mid_run_fails_one_step_and_is_restarted(tmp_path):
    out = tmp_path / "run"
    args = [
        "run", "--model", "tiny", "--generator", "hf", "--reward", "format", "--steps", "3", "--output", str(out),
        "--set", "loop.prompts_per_step=2", "--set", "loop.group_size=2", "--set", "loop.sampling.max_tokens=8",
        "--set", "loop.eval_size=2", "--set", "trainer.options.autocast_bf16=false",
        "--set", "objective=distill", "--set", f"distill.timeout={scaled(60)}",
        "--set", "distill.teacher.options.model=tiny",
        "--set", "distill.teacher.options.model_options.hidden_size=128",  # vLLM's CPU attention: heads >= 32 wide
        "--set", "distill.teacher.options.server=vllm", "--set", "distill.teacher.options.dtype=float32",
        "--set", "distill.teacher.options.kv_cache_gb=0.25",
        "--set", f"distill.teacher.options.startup_timeout={scaled(SERVER_WAIT)}",
    ]
    run = subprocess.Popen([*FORGE, *args], env=hold_env(1, 2), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True)
    try:
        wait_until(lambda: marker(out, 1).exists() or run.poll() is not None, scaled(SERVER_WAIT + 240),
                   "the run to finish step 1 with its teacher server", interval=0.5)
        assert run.poll() is None, run.stderr.read()[-3000:] if run.stderr else ""
        first = _endpoint(out)
        assert first is not None, "no endpoint file of the teacher's server"
        # Behind the run's key, like every server of the run.
        request = urllib.request.Request(f"http://{first['host']}:{first['port']}/v1/completions",
                                         data=b'{"prompt": [[1, 2]], "max_tokens": 1}',
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=scaled(30))
        assert refused.value.code == 401
        os.kill(int(first["pid"]), signal.SIGKILL)  # the vLLM server itself, not its launcher
        wait_until(lambda: (_endpoint(out) or {}).get("instance") != first["instance"], scaled(60),
                   "the launcher to see its server die")
        release(out, 1)
        wait_until(lambda: marker(out, 2).exists() or run.poll() is not None, scaled(300),
                   "the run to finish step 2", interval=0.5)
        assert run.poll() is None, run.stderr.read()[-3000:] if run.stderr else ""
        restarted = {}

        def back() -> bool:
            restarted.update(_endpoint(out) or {})
            return bool(restarted) and restarted.get("instance") != first["instance"]

        wait_until(back, scaled(SERVER_WAIT + 60), "the scheduler to restart the teacher's server", interval=1.0)
        release(out, 2)
        assert run.wait(scaled(300)) == 0, run.stderr.read()[-3000:] if run.stderr else ""
    finally:
        if run.poll() is None:
            run.send_signal(signal.SIGINT)
            try:
                run.wait(scaled(60))
            except subprocess.TimeoutExpired:
                run.kill()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    samples = 4
    assert rows[0]["distill/failed"] == 0 and rows[0]["distill/scored_tokens"] > 0, rows[0]
    if rows[1]["distill/failed"]:
        # Step 2 was scored while no server was up: every sample failed, none was trained on.
        assert rows[1]["distill/failed"] == samples and rows[1]["distill/scored_tokens"] == 0, rows[1]
    else:
        # A client that waits for a restarting server may have scored step 2 there (within
        # distill.timeout): then only after the restart.
        assert rows[1]["time/wall"] >= restarted["started"], (rows[1], restarted)
    assert rows[2]["distill/failed"] == 0 and rows[2]["distill/scored_tokens"] > 0, rows[2]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed", summary
