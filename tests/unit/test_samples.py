"""Sample records (forgerl.samples): the schema round-trips, the writer stays within its
bounds and rotates, secrets are redacted, a step's episodes become records, and
`forge samples` shows and filters them; bad input is one line, exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forgerl.samples import SampleRecord, SampleWriter, read_samples, select
from forgerl.samples.capture import Capture
from forgerl.samples.redact import REDACTED, Redactor, reward_secrets
from forgerl.samples.writer import SAMPLES_DIR, segments
from forgerl.types import Completion, Episode, Problem, RewardResult

from .test_cli import assert_one_line_error, forge

SCHEMA_KEYS = {
    "kind", "step", "policy_version", "problem_id", "group", "index", "source", "prompt", "messages",
    "completion", "reward", "components", "advantage", "correct", "finish_reason", "error", "prompt_tokens",
    "completion_tokens",
}


def record(step: int = 1, reward: float = 0.5, **kw) -> SampleRecord:
    return SampleRecord(kind=kw.pop("kind", "train"), step=step, reward=reward, prompt="What is 2+2?",
                        completion=kw.pop("completion", "4"), **kw)


def write_run(run_dir: Path, records: list[SampleRecord]) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    SampleWriter.for_run(run_dir).write(records)
    return run_dir


# ------------------------------------------------------------------ schema


def test_record_round_trips_with_the_schema_keys():
    r = record(components={"format": 1.0}, advantage=-0.25, correct=False, messages=[{"role": "user", "content": "hi"}],
               finish_reason="stop", prompt_tokens=5, completion_tokens=1, problem_id="p1", group=0, index=2)
    data = json.loads(r.to_json())
    assert set(data) == SCHEMA_KEYS
    assert SampleRecord.from_json(r.to_json()) == r


def test_record_reading_skips_unknown_keys_and_refuses_non_records():
    line = json.dumps({"kind": "eval", "step": 0, "future_key": 1, "completion": "x"})
    assert SampleRecord.from_json(line).completion == "x"
    for bad in ["[1]", "{", json.dumps({"kind": "other", "step": 1}), json.dumps({"kind": "train", "step": -1}),
                json.dumps({"kind": "train", "step": 1, "components": []})]:
        with pytest.raises(ValueError):
            SampleRecord.from_json(bad)


def test_non_finite_reward_is_written_as_null():
    assert json.loads(record(reward=float("nan")).to_json())["reward"] is None


# ------------------------------------------------------------------ writer


def test_writer_rotates_and_keeps_the_newest_files_within_bounds(tmp_path):
    writer = SampleWriter(tmp_path / SAMPLES_DIR, max_file_bytes=4096, keep_files=3)
    line_bytes = len(record(completion="y" * 300).to_json()) + 1
    for step in range(1, 41):
        writer.write([record(step=step, completion="y" * 300) for _ in range(3)])
    files = segments(tmp_path / SAMPLES_DIR)
    assert len(files) == 3, files
    assert all(f.stat().st_size <= 4096 for f in files), [f.stat().st_size for f in files]
    assert sum(f.stat().st_size for f in files) <= 3 * 4096
    steps = [r.step for r in read_samples(tmp_path)]
    assert steps[-1] == 40 and steps == sorted(steps)
    assert len(steps) == sum(f.stat().st_size for f in files) // line_bytes


def test_writer_never_fails_the_run_on_a_disk_error(tmp_path, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the folder should be
    writer = SampleWriter(blocked / SAMPLES_DIR)
    assert writer.write([record()]) == 0
    assert writer.write([record()]) == 0
    assert sum("samples are not recorded" in r.message for r in caplog.records) == 1


def test_a_resumed_run_s_records_of_a_step_replace_the_earlier_ones(tmp_path):
    writer = SampleWriter.for_run(tmp_path)
    writer.write([record(step=1), record(step=2, completion="old"), record(step=3, completion="old")])
    writer.write([record(step=2, completion="new"), record(step=3, completion="new")])  # resumed after step 1
    assert [(r.step, r.completion) for r in read_samples(tmp_path)] == [(1, "4"), (2, "new"), (3, "new")]


def test_a_torn_line_is_skipped(tmp_path):
    write_run(tmp_path, [record(step=1)])
    (seg,) = segments(tmp_path / SAMPLES_DIR)
    with open(seg, "ab") as f:
        f.write(b'{"kind": "train", "st')
    assert len(read_samples(tmp_path)) == 1


# ------------------------------------------------------------------ redaction


def test_redactor_removes_keys_from_the_environment_and_sources(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "wandb-secret-123456")
    monkeypatch.setenv("MY_SERVICE_TOKEN", "tok-abcdefgh")
    monkeypatch.setenv("SHORT_KEY", "abc")  # too short to be told apart from ordinary text
    keys: list[str] = []
    red = Redactor(["fixed-secret-xyz"], sources=[lambda: keys])
    keys.append("endpoint-key-987654")  # an agent endpoint's key appears once it started
    red.refresh()
    text = "a wandb-secret-123456 b tok-abcdefgh c fixed-secret-xyz d endpoint-key-987654 abc"
    assert red.text(text) == f"a {REDACTED} b {REDACTED} c {REDACTED} d {REDACTED} abc"
    assert red.value({"k": ["tok-abcdefgh"]}) == {"k": [REDACTED]}


def test_reward_secrets_reads_the_variable_auth_env_names(monkeypatch):
    class Choice:
        def __init__(self, options):
            self.options = options

    class Config:
        rewards = [Choice({"auth_env": "GRADER"}), Choice({})]

    monkeypatch.setenv("GRADER", "grader-token-42")
    assert reward_secrets(Config()) == ["grader-token-42"]


# ------------------------------------------------------------------ capture


class Words:
    """A tokenizer's decode: token ids as words."""

    def __call__(self, ids):
        return " ".join(f"t{i}" for i in ids)


def episode(group: int, reward: float, *, failed: bool = False, text: str = "answer 4") -> Episode:
    return Episode(
        problem=Problem(id=f"p{group}", prompt="What is 2+2?", metadata={"source": "arith"}),
        group_id=group,
        prompt_token_ids=[1, 2, 3],
        completion=Completion([7, 8], [-0.1, -0.2], "stop", 3, text=text),
        reward=reward,
        reward_components={"math_answer": reward},
        reward_failed=failed,
        error="grader timed out" if failed else None,
    )


def test_a_step_s_episodes_become_records(monkeypatch):
    monkeypatch.setenv("REWARD_TOKEN", "sk-leaked-0123456789")
    eps = [episode(10, 1.0), episode(10, 0.0, text="I was told sk-leaked-0123456789"),
           episode(11, 0.0, failed=True)]
    eps[0].advantage, eps[1].advantage = 0.7, -0.7
    cap = Capture(decode=Words(), redactor=Redactor(), primary_reward="math_answer")
    recs = cap.train(eps, step=4, trained={id(eps[0]), id(eps[1])})
    assert [(r.group, r.index) for r in recs] == [(0, 0), (0, 1), (1, 0)]
    first = recs[0]
    assert (first.kind, first.step, first.policy_version, first.problem_id, first.source) == ("train", 4, 3, "p10",
                                                                                             "arith")
    assert (first.prompt, first.completion, first.prompt_tokens, first.completion_tokens) == ("t1 t2 t3", "answer 4",
                                                                                            3, 2)
    assert (first.reward, first.advantage, first.correct, first.finish_reason) == (1.0, 0.7, True, "stop")
    assert recs[1].completion == f"I was told {REDACTED}" and recs[1].correct is False
    assert recs[2].advantage is None and recs[2].error == "grader timed out"


def test_share_and_per_step_bound_the_records():
    eps = [episode(g, 0.5) for g in range(8) for _ in range(4)]
    cap = Capture(decode=Words(), redactor=Redactor(environ=False), per_step=10)
    recs = cap.train(eps, step=1, trained=set())
    assert len(recs) == 10 and [r.group for r in recs] == [0] * 4 + [1] * 4 + [2] * 2
    cap.share = 0.25
    some = [len(cap.train(eps, step=s, trained=set())) for s in range(1, 21)]
    assert all(n <= 10 for n in some) and 0 < sum(some) < 20 * 10
    assert some == [len(cap.train(eps, step=s, trained=set())) for s in range(1, 21)]  # seeded: the same again


def test_long_texts_are_cut_in_the_middle():
    cap = Capture(decode=Words(), redactor=Redactor(environ=False), max_chars=100)
    (r,) = cap.train([episode(0, 1.0, text="a" * 500 + "END")], step=1, trained=set())
    assert r.completion.endswith("END") and r.completion.startswith("a") and "characters cut" in r.completion
    assert len(r.completion) < 200


def test_evaluation_records():
    cap = Capture(decode=Words(), redactor=Redactor(environ=False))
    comp = Completion([5], [-0.3], "length", 0, text="5")
    recs = cap.evaluation(step=0, policy_version=0, problems=[Problem(id="e1", prompt="q")], prompt_ids=[[9]],
                          completions=[comp], scores=[RewardResult(0.0, {"x": 0.0})], correct=[0.0])
    (r,) = recs
    assert (r.kind, r.step, r.problem_id, r.prompt, r.completion, r.correct, r.finish_reason, r.advantage) == (
        "eval", 0, "e1", "t9", "5", False, "length", None)


# ------------------------------------------------------------------ select and `forge samples`


def sample_run(tmp_path: Path) -> Path:
    return write_run(tmp_path / "run", [
        record(step=0, kind="eval", reward=0.0, completion="eval answer", index=0),
        record(step=1, reward=0.2, completion="low", group=0, index=0),
        record(step=1, reward=0.9, completion="high", group=0, index=1, advantage=0.5, correct=True),
        record(step=2, reward=-1.0, completion="broken", error="reward crashed: boom"),
        record(step=2, reward=0.4, completion="needle here", messages=[{"role": "user", "content": "hi"},
                                                                       {"role": "assistant", "content": "needle"}]),
    ])


def test_select_filters(tmp_path):
    recs = read_samples(sample_run(tmp_path))
    assert [r.completion for r in select(recs, step=1, order="best")] == ["high", "low"]
    assert [r.completion for r in select(recs, order="worst", limit=2)] == ["broken", "eval answer"]
    assert [r.completion for r in select(recs, failed=True)] == ["broken"]
    assert [r.completion for r in select(recs, grep="NEEDLE")] == ["needle here"]
    assert [r.completion for r in select(recs, kind="eval")] == ["eval answer"]


def test_forge_samples_shows_and_filters(tmp_path):
    run = sample_run(tmp_path)
    proc = forge("samples", str(run))
    assert proc.returncode == 0, proc.stderr
    for text in ("eval answer", "low", "high", "broken", "needle here", "FAILED: reward crashed: boom",
                 "advantage +0.500", "correct", "[assistant]"):
        assert text in proc.stdout, text
    worst = forge("samples", str(run), "--worst", "-n", "1")
    assert "broken" in worst.stdout and "high" not in worst.stdout
    assert "1 of 5 matching samples shown" in worst.stderr
    best = forge("samples", str(run), "--step", "1", "--best", "--json")
    assert [json.loads(line)["completion"] for line in best.stdout.splitlines()] == ["high", "low"]
    failed = forge("samples", str(run), "--failed", "--json")
    assert [json.loads(line)["completion"] for line in failed.stdout.splitlines()] == ["broken"]
    grep = forge("samples", str(run), "--grep", "needle", "--json")
    assert [json.loads(line)["completion"] for line in grep.stdout.splitlines()] == ["needle here"]
    none = forge("samples", str(run), "--grep", "absent")
    assert none.returncode == 0 and none.stdout == "" and "no samples match" in none.stderr


def test_forge_samples_bad_input_is_one_line(tmp_path):
    run = sample_run(tmp_path)
    assert_one_line_error(forge("samples", str(tmp_path / "missing")), "not a directory")
    assert_one_line_error(forge("samples", str(tmp_path)), "holds no samples")
    assert_one_line_error(forge("samples", str(run), "--step", "9"), "no samples of step 9", "steps 0 to 2")
    assert_one_line_error(forge("samples", str(run), "--step", "x"), "--step")
    assert_one_line_error(forge("samples", str(run), "--limit", "0"), "--limit")


def test_run_keys_are_read_from_the_run_directory(tmp_path):
    from forgerl.samples.redact import run_keys

    (tmp_path / "transport.secret").write_text("a" * 64 + "\n")
    (tmp_path / "generators").mkdir()
    (tmp_path / "generators" / "vllm-0.json").write_text(json.dumps({"url": "http://x", "api_key": "server-key-1234"}))
    (tmp_path / "generators" / "broken.json").write_text("{")
    assert run_keys(tmp_path) == ["a" * 64, "server-key-1234"]
    assert run_keys(tmp_path / "missing") == []


def test_a_recorder_that_fails_does_not_fail_the_run(tmp_path, caplog):
    from forgerl.samples.capture import Recorder

    class Broken:
        def decode(self, ids, skip_special_tokens=False):
            raise RuntimeError("no vocabulary")

    class Options:
        enabled, share, per_step, max_chars, max_file_bytes, keep_files = True, 1.0, 64, 8000, 1 << 20, 2

    rec = Recorder.for_run(Options(), run_dir=tmp_path, tokenizer=Broken())
    assert rec.train([episode(0, 1.0)], step=1, trained=set()) == 0
    assert rec.train([episode(0, 1.0)], step=2, trained=set()) == 0
    assert sum("samples are not recorded" in r.message for r in caplog.records) == 1
    assert rec.take() == []


def test_forge_samples_imports_nothing_heavy(tmp_path):
    import subprocess
    import sys

    from tests.helpers.timing import scaled

    run = sample_run(tmp_path)
    code = (
        "import sys\n"
        "from forgerl.cli import main\n"
        "try:\n"
        f"    main(['samples', {str(run)!r}])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('HEAVY', [m for m in ('torch', 'transformers', 'numpy', 'pydantic') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(60))
    assert "HEAVY []" in out.stdout, out.stdout[-500:] + out.stderr[-2000:]


def test_an_agents_tool_calls_are_shown_and_searched(tmp_path):
    """A black-box agent's record holds its calls in OpenAI's shape (content null): shown and
    found by --grep, in the terminal, the report and the trackers alike (message_text)."""
    from forgerl.commands.samples import render
    from forgerl.samples.records import message_text

    call = {"id": "call_1_0", "type": "function", "function": {"name": "calculate", "arguments": "{\"x\": 1}"}}
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "4", "tool_call_id": "call_1_0"}, {"role": "assistant", "content": "4"}]
    r = record(messages=messages)
    assert message_text(messages[1]) == json.dumps(call)
    shown = render(r, full=True)
    assert "calculate" in shown and "None" not in shown, shown
    assert select([r], grep="CALCULATE") == [r]
