"""The ``mixture`` task and per-source rewards: weighted draws, exact resume, held-out rows
of every source, rewards that score only their sources, per-source metrics, and the checks
before a run. Every dataset is built on disk by the test."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from forgerl.errors import ConfigError
from forgerl.interfaces import Reward
from forgerl.rewards.rewarding import NamedReward, RewardSet
from forgerl.runloop.reward_metrics import component_mean, per_source_metrics
from forgerl.types import SOURCE_KEY, Completion, Episode, Problem, RewardInput, source_of
from forgerl_plugins.tasks.mixture import MixtureTask


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def files(tmp_path):
    math = write_jsonl(tmp_path / "math.jsonl", [{"q": f"{i}+{i}=?", "a": str(2 * i)} for i in range(12)])
    code = write_jsonl(
        tmp_path / "code.csv.jsonl",
        [{"prompt": f"write f{i}", "tests": [f"assert f{i}() == {i}"], "answer": ""} for i in range(8)],
    )
    return math, code


def mixture(files, seed=0, math_weight=3.0, **extra):
    math, code = files
    options = {
        "sources": [
            {
                "name": "math",
                "weight": math_weight,
                "dataset": {
                    "path": math,
                    "columns": {"prompt": "q", "answer": "a"},
                    "eval_fraction": 0.25,
                    **extra,
                },
            },
            {"name": "code", "weight": 1.0, "dataset": {"path": code, **extra}},
        ]
    }
    return MixtureTask(MixtureTask.Options.model_validate(options), seed=seed)


def test_draws_follow_the_weights_and_tag_the_source(files):
    task = mixture(files)
    problems = task.next_problems(40)
    sources = [source_of(p) for p in problems]
    assert sources.count("math") == 30 and sources.count("code") == 10
    assert sources[:4].count("code") == 1, "interleaved, not one source after the other"
    assert all(p.id.startswith(f"{source_of(p)}/") for p in problems)
    maths = [p for p in problems if source_of(p) == "math"]
    assert all(p.answer == str(2 * int(p.prompt[0]["content"].split("+")[0])) for p in maths)
    code = next(p for p in problems if source_of(p) == "code")
    assert code.metadata["tests"] and code.metadata[SOURCE_KEY] == "code"
    assert [source_of(p) for p in task.eval_problems()] == ["math"] * 3


def test_a_row_cannot_claim_another_source(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [{"prompt": "p", "answer": "1", SOURCE_KEY: "math"}] * 2)
    options = {"sources": [{"name": "other", "dataset": {"path": path}}]}
    task = MixtureTask(MixtureTask.Options.model_validate(options))
    assert {source_of(p) for p in task.next_problems(4)} == {"other"}


@pytest.mark.parametrize("streaming", [False, True])
def test_resume_draws_what_an_unbroken_run_would(files, streaming):
    extra = {"streaming": True, "eval_fraction": 0} if streaming else {}
    if streaming:  # eval_fraction needs memory: the math source holds out nothing here
        straight = [p.id for p in _streamed(files).next_problems(60)]
    else:
        straight = [p.id for p in mixture(files, seed=5, **extra).next_problems(60)]
    for cut in (1, 7, 33):
        first = _streamed(files) if streaming else mixture(files, seed=5)
        head = [p.id for p in first.next_problems(cut)]
        resumed = _streamed(files) if streaming else mixture(files, seed=5)
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
        assert head + [p.id for p in resumed.next_problems(60 - cut)] == straight, cut


def _streamed(files):
    math, code = files
    options = {"sources": [
        {"name": "math", "weight": 2, "dataset": {"path": math, "columns": {"prompt": "q", "answer": "a"},
                                                   "streaming": True, "shuffle_buffer": 5}},
        {"name": "code", "dataset": {"path": code, "streaming": True}},
    ]}  # fmt: skip
    return MixtureTask(MixtureTask.Options.model_validate(options), seed=5)


def test_options_and_state_errors(files):
    with pytest.raises(ValidationError, match="two sources are named 'a'"):
        MixtureTask.Options.model_validate({"sources": [{"name": "a", "dataset": {"path": "x"}}] * 2})
    with pytest.raises(ValidationError, match="name"):
        MixtureTask.Options.model_validate({"sources": [{"name": "a/b", "dataset": {"path": "x"}}]})
    with pytest.raises(
        ConfigError, match="^source 'code': .*no column 'prompt' \\(columns.prompt\\); columns: q, a"
    ):
        math, _ = files
        MixtureTask(
            MixtureTask.Options.model_validate({"sources": [{"name": "code", "dataset": {"path": math}}]})
        )
    state = mixture(files).state_dict()
    del state["sources"]["code"]
    with pytest.raises(ConfigError, match="the checkpoint mixes math, this run code, math"):
        mixture(files).load_state_dict(state)


# ------------------------------------------------------------------ rewards by source


class Const(Reward):
    def __init__(self, value):
        self.value = value

    def score(self, sample):
        return self.value


def sample(source):
    metadata = {SOURCE_KEY: source} if source else {}
    return RewardInput(Problem(id="p", prompt="q", answer="1", metadata=metadata), "text")


def test_rewards_score_only_their_sources():
    rewards = RewardSet([
        NamedReward("math_answer", 1.0, Const(1.0), sources=frozenset({"math"})),
        NamedReward("code", 1.0, Const(0.5), sources=frozenset({"code"})),
        NamedReward("format", 0.1, Const(1.0)),
    ])  # fmt: skip
    math, code, plain = rewards.score_sync([sample("math"), sample("code"), sample(None)])
    assert math.components == {"math_answer": 1.0, "format": 1.0} and math.value == pytest.approx(1.1)
    assert code.components == {"code": 0.5, "format": 1.0} and code.value == pytest.approx(0.6)
    assert plain.components == {"math_answer": 1.0, "code": 0.5, "format": 1.0}, "no source: every reward"
    only = RewardSet([NamedReward("code", 1.0, Const(1.0), sources=frozenset({"code"}))], failed_reward=-1.0)
    (lost,) = only.score_sync([sample("math")])
    assert lost.failed and lost.value == -1.0 and "no reward scores" in lost.error


def episode(source, reward, components):
    metadata = {SOURCE_KEY: source} if source else {}
    completion = Completion(text="", token_ids=[1], logprobs=[0.0], finish_reason="stop", policy_version=0)
    return Episode(Problem(id="p", prompt="q", metadata=metadata), 0, [1], completion, reward, components)


def test_metrics_per_source_and_undiluted_component_means():
    eps = [
        episode("math", 1.0, {"math_answer": 1.0, "math_answer/correct": 1.0}),
        episode("math", 0.0, {"math_answer": 0.0}),
        episode("code", 0.5, {"code": 0.5}),
    ]
    assert component_mean(eps, "math_answer") == 0.5, "the code sample is not a 0 for math_answer"
    assert component_mean(eps, "math_answer/correct") == 0.5
    assert per_source_metrics(eps) == {
        "source/code/reward": 0.5, "source/code/code": 0.5, "source_samples/code": 1.0,
        "source/math/reward": 0.5, "source/math/math_answer": 0.5, "source_samples/math": 2.0,
    }  # fmt: skip
    plain = [episode(None, 1.0, {"a": 1.0}), episode(None, 0.0, {})]
    assert component_mean(plain, "a") == 0.5 and per_source_metrics(plain) == {}, "no mixture: as before"


# ------------------------------------------------------------------ before a run


def _config(files, *sets):
    from forgerl.configuration.config import build_config
    from forgerl.registry.plugins import build_registry
    from forgerl.registry.resolve import resolve

    math, code = files
    task = {"name": "mixture", "options": {"sources": [
        {"name": "math", "dataset": {"path": math, "columns": {"prompt": "q", "answer": "a"}}},
        {"name": "code", "dataset": {"path": code}},
    ]}}  # fmt: skip
    registry = build_registry()
    return resolve(build_config(base={"task": task}, sets=sets), registry), registry


def test_reward_sources_are_checked_against_the_task(files):
    from forgerl.runloop.preflight import check_reward_sources

    ok = [
        "rewards.0.name=math_answer",
        "rewards.0.sources=[math]",
        "rewards.1.name=code",
        "rewards.1.sources=[code]",
    ]
    check_reward_sources(*_config(files, *ok))
    check_reward_sources(*_config(files))  # no reward names sources: every reward scores every problem
    with pytest.raises(
        ConfigError, match="rewards.1.sources: task 'mixture' has no source 'cod'; its sources: math, code"
    ):
        check_reward_sources(*_config(files, *ok[:3], "rewards.1.sources=[cod]"))
    with pytest.raises(ConfigError, match="no reward scores source 'code' of task 'mixture'"):
        check_reward_sources(*_config(files, *ok[:2], "rewards.1.sources=[math]"))  # format: math only


def test_held_out_rows_are_judged_by_their_sources_first_reward(files):
    from forgerl.runloop.evaluation import _row, is_correct
    from forgerl.types import RewardResult

    config, _ = _config(files, "rewards.0.name=math_answer", "rewards.0.sources=[math]",
                        "rewards.1.name=code", "rewards.1.sources=[code]")  # fmt: skip
    code_right = RewardResult(1.0, {"code": 1.0})
    assert is_correct(code_right, config, "code") == 1.0
    assert is_correct(code_right, config, None) == 0.0, "no source: the first reward judges"
    row = _row([1.0, 0.0, 1.0], [1.0, 0.2, 0.5], [{}, {}, {}], ["math", "math", "code"])
    assert row["eval/source/math/accuracy"] == 0.5 and row["eval/source/code/accuracy"] == 1.0
    assert row["eval/source/math/reward"] == pytest.approx(0.6) and row["eval/accuracy"] == pytest.approx(
        2 / 3
    )
    assert not any(k.startswith("eval/source/") for k in _row([1.0], [1.0], [{}], [None])), (
        "no mixture: as before"
    )
