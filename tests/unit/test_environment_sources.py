"""A mixture whose environment takes some of its sources (``environment.sources``): those
problems run as trajectories, the others as single completions, in one batch whose groups
keep their positions, request ids and seeds; held-out samples likewise, in order. Against
the tiny model's real tokenizer and a scripted generator (no model)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from forgerl.interfaces import Generator
from forgerl.rollouts.env_rollouts import EnvironmentRollouts
from forgerl.rollouts.rollout import RolloutProducer, Tokenizing, sampling_seed
from forgerl.types import SOURCE_KEY, Completion, Problem, RewardResult, SamplingParams

from .test_trajectories import CALL, Calc, runner_for

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


class Answers(Generator):
    """A trajectory's turn ``t`` (request id ``...-t<t>``) gets ``turns[t]``; a single-turn
    request gets ``single``. Records every request."""

    def __init__(self, tokenizer, turns: list[str], single: str):
        self.tokenizer, self.turns, self.single = tokenizer, turns, single
        self.requests = []

    async def generate(self, requests):
        out = []
        for r in requests:
            self.requests.append(r)
            turn = r.request_id.rsplit("-t", 1)
            text = self.turns[min(int(turn[1]), len(self.turns) - 1)] if len(turn) == 2 else self.single
            ids = [*self.tokenizer(text, add_special_tokens=False)["input_ids"], self.tokenizer.eos_token_id]
            out.append([Completion(ids, [-0.5] * len(ids), "stop", 2, text) for _ in range(r.n)])
        return out

    def update_weights(self, version):
        raise AssertionError("not used")

    @property
    def policy_version(self):
        return 2


class Fixed:
    """A problem source that hands out the same problems each time."""

    def __init__(self, problems):
        self.problems = problems

    def next_problems(self, n):
        return self.problems[:n]

    def state_dict(self):
        return {}


def tagged(source: str, i: int) -> Problem:
    return Problem(f"{source}/{i}", "What is 2 + 2?", "4", metadata={SOURCE_KEY: source})


async def digits(inputs):
    """The run's rewards: 1 for a completion with a digit (what the words source is scored by)."""
    values = [float(any(c.isdigit() for c in i.completion_text)) for i in inputs]
    return [RewardResult(v, {"format": v}) for v in values]


PROBLEMS = [tagged("math", 0), tagged("words", 1), tagged("math", 2), tagged("words", 3)]


def test_only_the_environments_sources_become_trajectories(tokenizer):
    gen = Answers(tokenizer, [f"Let me see. {CALL}", "<answer>4</answer>"], single="Seven: 7")
    env = EnvironmentRollouts(runner_for(Calc, tokenizer), failed_reward=0.0, sources=["math"])
    producer = RolloutProducer(
        buffer=None, generator=gen, source=Fixed(PROBLEMS), score=digits, tokenizing=Tokenizing(tokenizer),
        prompts_per_step=4, group_size=2, sampling=SamplingParams(max_tokens=16), seed=5, start=0, last=0,
        environment=env,
    )  # fmt: skip
    batch = asyncio.run(producer.make_batch(3))
    assert [e.group_id for e in batch.episodes] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [e.problem.id for e in batch.episodes[::2]] == ["math/0", "words/1", "math/2", "words/3"]
    for e in batch.episodes:
        if e.problem.metadata[SOURCE_KEY] == "math":  # the environment's trajectory, its own verdict
            assert e.completion.mask is not None and 0 in e.completion.mask, "no tool observation in the tokens"
            assert e.messages and e.messages[-1]["content"] == "<answer>4</answer>"
            assert e.reward == 1.0 and e.reward_components == {"correct": 1.0}
        else:  # one completion, scored by the run's rewards
            assert e.completion.mask is None and e.messages is None
            assert e.completion.text == "Seven: 7" and e.reward == 1.0 and e.reward_components == {"format": 1.0}
    # Each group's requests and seeds are those its position gives, whichever way it ran.
    single = {r.request_id: r.sampling.seed for r in gen.requests if "-t" not in r.request_id}
    assert single == {f"b3-g{g}": sampling_seed(5, 3, g) for g in (1, 3)}
    first_turns = {r.request_id for r in gen.requests if r.request_id.endswith("-t0")}
    assert first_turns == {f"b3-g{g}-m{m}-t0" for g in (0, 2) for m in (0, 1)}
    assert batch.extra["env/turns_mean"] == 2.0, "the environment's metrics are over its trajectories"
    assert batch.gen_tokens == sum(sum(e.completion.mask or [1] * len(e.completion.token_ids)) for e in batch.episodes)


def test_held_out_samples_keep_their_order_and_their_way(tokenizer):
    from forgerl.configuration.config import build_config
    from forgerl.runloop.evaluation import score_samples

    class Rewards:
        score = staticmethod(digits)

    cfg = build_config(sets=["rewards=[{name: format}]"])
    gen = Answers(tokenizer, [f"Let me see. {CALL}", "<answer>4</answer>"], single="no digits here")
    env = EnvironmentRollouts(runner_for(Calc, tokenizer), failed_reward=0.0, sources=["math"])
    pairs = [(1, 0), (0, 0), (3, 1), (2, 1)]
    samples = score_samples(cfg, PROBLEMS, pairs, gen, Rewards(), Tokenizing(tokenizer), env)
    assert [(s.group, s.index) for s in samples] == pairs
    by_group = {s.group: s for s in samples}
    assert by_group[0].messages and by_group[2].messages and by_group[0].correct == 1.0
    assert by_group[1].messages is None and by_group[1].completion == "no digits here"
    assert by_group[1].correct == 0.0 and by_group[3].result.value == 0.0


def test_environment_sources_are_checked_against_the_task(tmp_path):
    from forgerl.configuration.config import build_config
    from forgerl.errors import ConfigError
    from forgerl.registry.plugins import build_registry
    from forgerl.registry.resolve import resolve
    from forgerl.runloop.preflight import check_reward_sources

    math = tmp_path / "math.jsonl"
    math.write_text('{"q": "1+1", "a": "2"}\n' * 8)
    task = {"name": "mixture", "options": {"sources": [
        {"name": "math", "dataset": {"path": str(math), "columns": {"prompt": "q", "answer": "a"}}},
        {"name": "more", "dataset": {"path": str(math), "columns": {"prompt": "q", "answer": "a"}}},
    ]}}  # fmt: skip
    registry = build_registry()

    def check(*sets: str, base_task=task) -> None:
        check_reward_sources(resolve(build_config(base={"task": base_task}, sets=sets), registry), registry)

    check("environment.name=calculator", "environment.sources=[more]")
    with pytest.raises(ConfigError, match=r"^environment.sources: task 'mixture' has no source 'mat'; its sources: math, more$"):
        check("environment.name=calculator", "environment.sources=[mat]")
    with pytest.raises(ConfigError, match=r"^environment.sources names sources \(math\), but task 'arithmetic' mixes none"):
        check("environment.name=calculator", "environment.sources=[math]", base_task={"name": "arithmetic"})


def test_a_source_the_environment_scores_needs_no_reward(tmp_path):
    """A scoring environment (``scores = True``) gives its sources their reward: only the
    other sources need one. An environment whose trajectories the rewards score (the
    ``agent`` program) does not, and ``forge config show`` calls the rewards used."""
    from forgerl.configuration.config import build_config
    from forgerl.errors import ConfigError
    from forgerl.registry.plugins import build_registry
    from forgerl.registry.resolve import resolve, rewards_unused
    from forgerl.runloop.preflight import check_reward_sources

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"q": "1+1", "a": "2"}\n' * 8)
    task = {"name": "mixture", "options": {"sources": [
        {"name": "math", "dataset": {"path": str(rows), "columns": {"prompt": "q", "answer": "a"}}},
        {"name": "more", "dataset": {"path": str(rows), "columns": {"prompt": "q", "answer": "a"}}},
    ]}}  # fmt: skip
    registry = build_registry()
    only_more = ["rewards.0.name=math_answer", "rewards.0.sources=[more]", "rewards.1.name=format", "rewards.1.sources=[more]"]

    def config(*sets: str):
        return resolve(build_config(base={"task": task}, sets=[*only_more, *sets]), registry)

    scored = config("environment.name=calculator", "environment.sources=[math]")
    check_reward_sources(scored, registry)
    assert rewards_unused(scored, registry) is None, "the 'more' rows are scored by the rewards"
    with pytest.raises(ConfigError, match=r"^no reward scores source 'math' of task 'mixture'"):
        check_reward_sources(config("environment.name=agent", "environment.sources=[math]",
                                    "environment.options.entry=tests.helpers.agents:shows_images"), registry)  # fmt: skip
    with pytest.raises(ConfigError, match=r"^no reward scores source 'math' of task 'mixture'"):
        check_reward_sources(config(), registry)
