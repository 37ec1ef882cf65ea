"""Environments written for the ``verifiers`` library run unchanged and train through the
run's endpoint (the ``verifiers`` environment and task). The verifiers environments are
defined in tests/helpers/vf_envs (in-memory datasets, nothing downloaded) and run in
verifiers' own Python, .venv-verifiers (scripts/setup.sh builds it; without it these tests
skip, or fail under FORGE_REQUIRE_VERIFIERS=1, as in CI).

1. A `forge run` (the rank-0 worker, in this process: the tiny model, the in-process `hf`
   generator, the fsdp trainer), its problems the verifiers environment's own dataset
   (the `verifiers` task): every token trained on is a token the generator sampled for
   that episode's calls, with its sampling logprob and version; the rewards are the
   environment's rubric's; the trainer's logprobs of the sampled tokens equal the
   generator's.
2. The rollout layer with a scripted model: a verifiers ToolEnv's tool calls come back
   parsed and its tool results extend the trajectory token-exactly (a hostile call too);
   a problem of another task runs with the environment's own system prompt; an
   environment that raises fails only its trajectory, with the reason; one that blocks its
   process is killed at the deadline, the others in its batch finish normally and the next
   batch runs; a rollout cut by the run's limit is scored, not failed.
3. Before a run: a missing environment, a Python without verifiers, an environment that
   does not load: each a one-line error saying what to do.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from forgerl.configuration.config import validate_config  # noqa: E402
from forgerl.errors import ConfigError  # noqa: E402
from forgerl.rollouts.agent_runner import AgentRunner  # noqa: E402
from forgerl.rollouts.env_rollouts import FAILURES_FILE, EnvironmentRollouts  # noqa: E402
from forgerl.rollouts.trajectory import Limits  # noqa: E402
from forgerl.rundirs import runs  # noqa: E402
from forgerl.types import Problem, SamplingParams  # noqa: E402
from forgerl_plugins.environments.verifiers_env import VerifiersEnvironment  # noqa: E402
from forgerl_plugins.environments.verifiers_worker import close_workers  # noqa: E402
from tests.helpers.agents import Scripted  # noqa: E402
from tests.helpers.requires import require_verifiers  # noqa: E402
from tests.helpers.timing import scaled, wait_until  # noqa: E402
from tests.helpers.vf_envs.vf_scoring import reward_of  # noqa: E402

pytestmark = pytest.mark.integration

VF_ENVS = str(Path(__file__).resolve().parents[1] / "helpers" / "vf_envs")
ENV_ID = "forge-vf-envs"
FAILED_REWARD = -0.5


@pytest.fixture(scope="module")
def vf_python() -> str:
    python = require_verifiers()
    yield python
    close_workers()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_a_verifiers_environment_trains_token_exactly_on_its_own_dataset(vf_python, tokenizer, tmp_path, monkeypatch):
    import forgerl.runloop.loop
    from forgerl.algorithms import group_advantages
    from forgerl.runloop.spmd import TrainerDriver
    from forgerl.worker import run_worker
    from forgerl_plugins.generators.hf.generator import HFGenerator

    source = {"environment": ENV_ID, "args": {"mode": "feedback"}, "python": vf_python, "pythonpath": [VF_ENVS]}
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = validate_config({
        "model": {"name": "tiny"},
        "task": {"name": "verifiers", "options": source},
        "generator": {"name": "hf"},
        "trainer": {"name": "fsdp", "options": {"autocast_bf16": False, "lr": 1e-3}},
        "environment": {"name": "verifiers", "options": {**source, "timeout": scaled(120.0)},
                        "max_turns": 3, "max_total_tokens": 96},
        "loop": {"steps": 2, "prompts_per_step": 2, "group_size": 2, "eval_size": 2, "eval_at_start": False,
                 "sampling": {"max_tokens": 10}},
        "checkpoint": {"every": 0},
        "logging": {"tensorboard": False, "progress": False},
    })
    runs.write_config(run_dir, config)

    sampled: list[tuple[list[int], object]] = []  # (prompt ids, completion) of every call
    batches = []
    generate, train_step = HFGenerator.generate, TrainerDriver.train_step

    async def recording_generate(self, requests):
        results = await generate(self, requests)
        sampled.extend((list(r.prompt_token_ids), c[0]) for r, c in zip(requests, results))
        return results

    def recording_train_step(self, batch):
        batches.append(batch)
        return train_step(self, batch)

    monkeypatch.setattr(HFGenerator, "generate", recording_generate)
    monkeypatch.setattr(TrainerDriver, "train_step", recording_train_step)
    monkeypatch.setattr(forgerl.runloop.loop, "install_stop_handlers", lambda loop: None)  # pytest keeps its own
    assert run_worker(run_dir) == 0

    assert not (run_dir / FAILURES_FILE).exists(), (run_dir / FAILURES_FILE).read_text()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        # The environment's two model turns (its "Check it." between them), its rubric's metrics.
        assert row["env/failed"] == 0 and row["env/turns_mean"] == 2 and row["env/observations_mean"] == 1, row
        assert row["logprob_gap/max"] < 1e-4, f"the trainer and the generator disagree on sampled tokens: {row}"
        assert row["reward/num_turns"] == 2
    # 2 steps x 4 episodes + 2 held-out episodes, two calls each; the held-out problems are the
    # environment's eval_dataset (questions from 100 on), the others its dataset.
    assert len(sampled) == 20
    questions = {tokenizer.decode(p).split("What is ")[1].split(" ")[0] for p, _ in sampled}
    assert {"100", "101"} <= questions and all(int(q) < 8 for q in questions - {"100", "101"}), questions

    assert len(batches) == 2
    for step, (batch, row) in enumerate(zip(batches, rows)):
        assert batch.policy_versions.tolist() == [step] * batch.size, "on-policy: sampled by the weights of the step"
        rewards, firsts = [], []
        for r in range(batch.size):
            length = int(batch.attention_mask[r].sum())
            tokens = batch.input_ids[r, :length].tolist()
            trained = {t for t in range(length) if batch.loss_mask[r, t]}
            calls = [(p, c) for p, c in sampled
                     if tokens[: len(p)] == p and tokens[len(p): len(p) + len(c.token_ids)] == c.token_ids]
            assert len({len(p) for p, _ in calls}) == 2, f"row {r}: not two calls of one episode"
            covered = {len(p) + i for p, c in calls for i in range(len(c.token_ids))}
            assert trained == covered, f"row {r}: trained positions are not exactly the sampled tokens"
            for p, c in calls:
                assert c.policy_version == step
                got = batch.behaviour_logprobs[r, len(p): len(p) + len(c.token_ids)].tolist()
                assert got == pytest.approx(c.logprobs, abs=1e-6), f"row {r}: behaviour logprobs are not the sampler's"
            first_prompt = min(calls, key=lambda pc: len(pc[0]))[0]
            text = tokenizer.decode(first_prompt)
            assert "Answer with the number." in text and "What is " in text, "the dataset row's prompt, as verifiers laid it out"
            rewards.append(reward_of(max(calls, key=lambda pc: len(pc[0]))[1].text))
            firsts.append(tuple(first_prompt))
        # The rubric's reward reached the loss: the advantages are its rewards' group-relative ones.
        groups = torch.tensor([sorted(set(firsts)).index(f) for f in firsts])
        expected = group_advantages(torch.tensor(rewards, dtype=torch.float64), groups)
        assert batch.advantages.tolist() == pytest.approx(expected.tolist(), abs=1e-5), (rewards, firsts)
        assert row["reward/mean"] == pytest.approx(sum(rewards) / len(rewards))
        # A rubric without a `correct` metric: verifiers' pass threshold (0.5) decides it.
        assert row["reward/correct"] == pytest.approx(sum(r >= 0.5 for r in rewards) / len(rewards))
    assert any(a != 0 for b in batches for a in b.advantages.tolist()), "every reward equal: nothing was learned from"


# ------------------------------------------------------------------ the rollout layer

ADD = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 2}}</tool_call>'
HOSTILE = '<tool_call>{"name": "rm", "arguments": {"path": "/"}}</tool_call>'


def rollouts(tokenizer, vf_python: str, run_dir: Path, *, timeout: float, pids: Path,
             max_turns: int = 4) -> EnvironmentRollouts:
    options = VerifiersEnvironment.Options(
        environment=ENV_ID, args={"mode": "tools", "faults": {"1": "crash", "2": "hang"}}, python=vf_python,
        pythonpath=[VF_ENVS], env={"VF_TEST_PIDS": str(pids)}, timeout=timeout,
    )
    limits = Limits(max_turns=max_turns, max_total_tokens=2000, max_turn_tokens=200, turn_timeout=10.0,
                    concurrency=8)
    runner = AgentRunner(lambda: VerifiersEnvironment(options), tokenizer, limits, SamplingParams(max_tokens=200),
                         options, model="tiny", context_length=1024)
    return EnvironmentRollouts(runner, failed_reward=FAILED_REWARD, run_dir=run_dir)


def row(index: int) -> Problem:
    """Row ``index`` of the environment's dataset, as the `verifiers` task gives it."""
    return Problem(f"row{index}", "(the row's)", "", {"verifiers": {"environment": ENV_ID, "split": "train",
                                                                   "index": index}})


async def never_called(samples):
    raise AssertionError(f"the rubric scores every episode; the Reward plugins got {samples}")


def ids(tokenizer, text: str) -> list[int]:
    return [*tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]


def test_tool_calls_faults_and_foreign_problems(vf_python, tokenizer, tmp_path, caplog):
    # What docs/environments.md says a user sees at `logging.level: debug`.
    caplog.set_level(logging.DEBUG, logger="forgerl.environment.verifiers")
    pids = tmp_path / "pids"
    gen = Scripted(tokenizer, [f"Let me add. {ADD}", HOSTILE, "It is 4."])
    # The server starts (imports verifiers, loads the environment) under a generous deadline ...
    warm = rollouts(tokenizer, vf_python, tmp_path, timeout=scaled(300.0), pids=pids)
    [first], _ = asyncio.run(warm.scored(gen, [(row(0), "w0", 1)], never_called))
    warm.close()
    assert first.trajectory.failure is None, first.trajectory.failure
    # ... and the faulty batch runs on it under a short one.
    fast = rollouts(tokenizer, vf_python, tmp_path, timeout=scaled(10.0), pids=pids)
    foreign = Problem("q", "What is 5 + 2?", "7", {})  # from another task: the prompt and answer are its own
    jobs = [(row(0), "r0", 1), (row(1), "r1", 2), (row(2), "r2", 3), (foreign, "r3", 4)]
    gen.requests.clear()
    scored, metrics = asyncio.run(fast.scored(gen, jobs, never_called))

    good, crashed, hung, other = scored
    for s, answer in ((good, "2"), (other, "7")):
        t = s.trajectory
        assert t.failure is None and (t.turns, t.observations, t.rewrites) == (3, 2, 0), t
        # The rubric's reward and metrics (ToolEnv's own monitors among them).
        assert s.result.value == reward_of("It is 4.") and t.reward == s.result.value
        assert s.result.components["correct"] == float(answer in "It is 4.")
        assert s.result.components["add_calls"] == 1 and s.result.components["total_tool_calls"] == 2
        # Token-exact: each call was sampled from the trajectory's tokens so far; the sampled
        # turns are the generator's tokens (mask 1), the tool results the template's (mask 0).
        calls = [r for r in gen.requests if list(r.prompt_token_ids[: len(t.prompt_ids)]) == t.prompt_ids]
        assert len(calls) == 3
        c = t.completion
        whole = t.prompt_ids + c.token_ids
        turns = [ids(tokenizer, f"Let me add. {ADD}"), ids(tokenizer, HOSTILE), ids(tokenizer, "It is 4.")]
        at = len(t.prompt_ids)
        for k, (call, turn) in enumerate(zip(calls, turns)):
            start = len(call.prompt_token_ids)
            assert list(call.prompt_token_ids) == whole[:start], f"call {k} was not sampled from the trajectory"
            assert whole[start: start + len(turn)] == turn and c.mask[start - at: start - at + len(turn)] == [1] * len(turn)
            assert c.logprobs[start - at: start - at + len(turn)] == [-0.25] * len(turn)
        observations = tokenizer.decode([tok for tok, m in zip(c.token_ids, c.mask) if m == 0])
        assert "<|im_start|>tool\n4<|im_end|>" in observations, observations  # add(2, 2)
        assert "'rm'" in observations, observations  # the hostile call: verifiers' error, as the tool's answer
        assert sum(c.mask) == sum(map(len, turns))
    # The environment's own system prompt, for the row and for the foreign problem alike.
    assert "Answer with the number." in tokenizer.decode(other.trajectory.prompt_ids)
    assert "What is 5 + 2?" in tokenizer.decode(other.trajectory.prompt_ids)

    # The environment that raised: its trajectory failed, with the environment's reason.
    assert crashed.result.failed and crashed.result.value == FAILED_REWARD
    assert "the test environment's tool server is down" in crashed.trajectory.failure
    assert "forge_vf_envs.py" in crashed.trajectory.failure, "where it was raised"
    # Its output (the traceback) is in the run's log at debug level.
    wait_until(lambda: any("verifiers runner: " in r.getMessage() and "Traceback" in r.getMessage()
                           for r in caplog.records if r.levelno == logging.DEBUG), 10,
               "the failed episode's traceback in the debug log")  # fmt: skip
    # The one that blocked its process: failed at the deadline, its process killed.
    assert hung.result.failed and "did not end within" in hung.trajectory.failure
    [pid] = [int(p) for p in pids.read_text().split()]
    wait_until(lambda: not _alive(pid), 10, f"the hung episode's process {pid} to be killed")
    assert metrics["env/failed"] == 2 and metrics["env/failed_error"] == 1 and metrics["env/failed_timeout"] == 1
    recorded = [json.loads(line) for line in (tmp_path / FAILURES_FILE).read_text().splitlines()]
    assert sorted(r["kind"] for r in recorded) == ["error", "timeout"], recorded

    # The server lives on: the next batch runs on it.
    [again], _ = asyncio.run(fast.scored(gen, [(row(3), "n0", 5)], never_called))
    fast.close()
    assert again.trajectory.failure is None, again.trajectory.failure

    # The run's limit below the environment's (2 calls where its ToolEnv allows 3): the third
    # call is refused, verifiers ends the rollout on that error, and the trajectory is cut and
    # scored by the rubric, not failed.
    cut = rollouts(tokenizer, vf_python, tmp_path, timeout=scaled(10.0), pids=pids, max_turns=2)
    [short], metrics = asyncio.run(cut.scored(gen, [(row(4), "c0", 6)], never_called))
    cut.close()
    t = short.trajectory
    assert t.failure is None and t.turns == 2 and t.completion.finish_reason == "length", t
    # The last reply is the tool call alone: its message has no text.
    assert short.result.value == reward_of("") and metrics["env/limit_frac"] == 1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead: its parent (the server) reaps it when it reads its end
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


# ------------------------------------------------------------------ before a run


def test_what_cannot_run_is_a_one_line_error_before_the_run(vf_python, tmp_path):
    def preflight(**options):
        opts = VerifiersEnvironment.Options(environment=ENV_ID, pythonpath=[VF_ENVS], **options)
        with pytest.raises(ConfigError) as info:
            VerifiersEnvironment.local_preflight(opts)
        message = str(info.value)
        assert "\n" not in message and "Traceback" not in message, message
        return message

    missing = preflight(python=str(tmp_path / "nowhere" / "python"))
    assert "does not exist" in missing and "scripts/setup.sh" in missing
    without = preflight(python=sys.executable)  # forgerl's own Python has no verifiers
    assert "no usable verifiers" in without and "scripts/setup.sh" in without
    broken = preflight(python=vf_python, args={"broken": True})
    assert "does not load" in broken and "needs a service that is not configured" in broken


def test_a_task_without_the_pythonpath_names_the_option_it_lacks(vf_python):
    """The task and the environment each read their own options: the environment's
    pythonpath does not reach the task, and the task's error says which option to set."""
    from forgerl_plugins.tasks.verifiers_task import VerifiersTask

    VerifiersEnvironment.local_preflight(VerifiersEnvironment.Options(environment=ENV_ID, python=vf_python,
                                                                      pythonpath=[VF_ENVS]))  # fmt: skip
    with pytest.raises(ConfigError) as info:
        VerifiersTask.local_preflight(VerifiersTask.Options(environment=ENV_ID, python=vf_python))
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"task verifiers: the verifiers environment '{ENV_ID}' does not "
                                                      "load: "), message  # fmt: skip
    assert "in task.options.pythonpath (none given); the verifiers task and environment each read" in message, message
