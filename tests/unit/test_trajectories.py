"""Multi-turn trajectories as tokens (forgerl.rollouts.trajectory, forgerl.rollouts.chat_tokens): the tokens
trained on are the tokens sampled, in the context they were sampled in; environment tokens
are masked out of the loss; tools reach the model through the template or the system
prompt; limits end trajectories; a pending trajectory survives a checkpoint. Against the
tiny model's real tokenizer and a scripted generator (no model)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from forgerl.environment import Environment, Step, tool
from forgerl.interfaces import Generator
from forgerl.rollouts.chat_tokens import ChatTokens
from forgerl.rollouts.trajectory import Limits, RequestBatcher, Trajectory, TrajectoryRunner
from forgerl.types import Completion, GenerationRequest, Problem, SamplingParams

pytest.importorskip("transformers")

QWEN_LIKE_TOOLS = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if not (tools and loop.first and m['role'] == 'system') %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Like Qwen3's: reasoning of earlier assistant turns is dropped when the chat is rendered.
DROPS_OLD_THINKING = (
    "{%- for m in messages %}"
    "{%- set content = m['content'] %}"
    "{%- if m['role'] == 'assistant' and not loop.last and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip() %}{%- endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + content + '<|im_end|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


class Scripted(Generator):
    """Answers turn ``t`` of every trajectory with ``turns[t]`` (+ eos), logprob -0.25 per
    token, and records every request."""

    def __init__(self, tokenizer, turns: Sequence[str], version: int = 3, eos: bool = True):
        self.tokenizer = tokenizer
        self.turns = list(turns)
        self.version = version
        self.eos = eos
        self.requests: list[GenerationRequest] = []
        self.batches: list[int] = []

    async def generate(self, requests):
        self.batches.append(len(requests))
        out = []
        for r in requests:
            self.requests.append(r)
            turn = int(r.request_id.rsplit("-t", 1)[1])
            text = self.turns[min(turn, len(self.turns) - 1)]
            ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            ids = ids[: r.sampling.max_tokens - 1] + ([self.tokenizer.eos_token_id] if self.eos else [])
            finish = "stop" if self.eos else "length"
            out.append([Completion(ids, [-0.25] * len(ids), finish, self.version, text)])
        return out

    def update_weights(self, version):
        raise AssertionError("not used")

    @property
    def policy_version(self):
        return self.version


class Calc(Environment):
    scores = True

    def reset(self, problem):
        return [{"role": "system", "content": "Be exact."}, {"role": "user", "content": str(problem.prompt)}]

    @tool
    def calculate(self, expression: str) -> str:
        """Compute.

        Args:
            expression: arithmetic
        """
        from forgerl_plugins.environments.safe_arithmetic import evaluate, format_value

        return format_value(evaluate(expression))

    def answer(self, text):
        return Step.finish(float("<answer>4</answer>" in text), correct=1.0)


CALL = '<tool_call>{"name": "calculate", "arguments": {"expression": "2 + 2"}}</tool_call>'


def run(runner: TrajectoryRunner, generator: Generator, n: int = 1, problem: str = "What is 2 + 2?") -> list[Trajectory]:
    jobs = [(Problem(f"p{i}", problem, "4"), f"r{i}", 7 + i) for i in range(n)]
    trajectories, _ = asyncio.run(runner.run_many(generator, jobs))
    return trajectories


def runner_for(env_class, tokenizer, **limits) -> TrajectoryRunner:
    # The tiny tokenizer's vocabulary is small: a tool call is 73 tokens.
    limits = {"max_turn_tokens": 200, "max_total_tokens": 2000, **limits}
    return TrajectoryRunner(env_class, env_class, tokenizer, Limits(**limits), SamplingParams(max_tokens=64))


def test_a_tool_turn_is_token_exact_and_masked(tokenizer):
    gen = Scripted(tokenizer, [f"Let me compute. {CALL}", "<answer>4</answer>"])
    runner = runner_for(Calc, tokenizer)
    (traj,) = run(runner, gen)
    assert traj.failure is None and traj.reward == 1.0 and traj.turns == 2 and traj.observations == 1
    c = traj.completion
    first, second = gen.requests
    turn0 = [*list(tokenizer(f"Let me compute. {CALL}", add_special_tokens=False)["input_ids"]), tokenizer.eos_token_id]
    turn1 = [*list(tokenizer("<answer>4</answer>", add_special_tokens=False)["input_ids"]), tokenizer.eos_token_id]
    # The generator saw exactly the trajectory's tokens: the prompt, then turn 0 as sampled
    # and the tool's answer; the trajectory is that context plus turn 1.
    assert list(first.prompt_token_ids) == traj.prompt_ids
    observation = list(second.prompt_token_ids)[len(traj.prompt_ids) + len(turn0):]
    assert list(second.prompt_token_ids) == traj.prompt_ids + turn0 + observation
    assert c.token_ids == turn0 + observation + turn1
    assert c.mask == [1] * len(turn0) + [0] * len(observation) + [1] * len(turn1)
    assert c.logprobs == [-0.25] * len(turn0) + [0.0] * len(observation) + [-0.25] * len(turn1)
    assert c.versions == [3] * len(c.token_ids) and c.policy_version == 3
    # The observation is the template's rendering of the tool message and the next header.
    assert tokenizer.decode(observation) == "\n<|im_start|>tool\n4<|im_end|>\n<|im_start|>assistant\n"
    # The whole sequence is the template's rendering of the whole conversation (this
    # template rewrites nothing), tools described in the system prompt.
    chat = ChatTokens(tokenizer, runner.chat.tools)
    conversation = chat.with_tools_in_system([
        {"role": "system", "content": "Be exact."}, {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": f"Let me compute. {CALL}"}, {"role": "tool", "content": "4"},
        {"role": "assistant", "content": "<answer>4</answer>"},
    ])
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert tokenizer.decode(traj.prompt_ids + c.token_ids) + "\n" == rendered
    # The conversation as messages, for sample records (forgerl.samples).
    assert [(m["role"], m["content"]) for m in traj.messages] == [
        ("system", "Be exact."), ("user", "What is 2 + 2?"), ("assistant", f"Let me compute. {CALL}"),
        ("tool", "4"), ("assistant", "<answer>4</answer>")]


def test_the_batch_trains_only_on_sampled_tokens(tokenizer):
    from forgerl.runloop.batching import collate
    from forgerl.types import Episode

    gen = Scripted(tokenizer, [CALL, "<answer>4</answer>"])
    (traj,) = run(runner_for(Calc, tokenizer, max_total_tokens=2000), gen)
    single = Completion([5, 6], [-1.0, -2.0], "stop", 3)
    episodes = [Episode(Problem("a", "x"), 0, traj.prompt_ids, traj.completion, 1.0),
                Episode(Problem("b", "x"), 0, [1, 2, 3], single, 0.0)]
    batch = collate(episodes, pad_id=0)
    p = len(traj.prompt_ids)
    mask = batch.loss_mask[0, p : p + len(traj.completion.token_ids)].tolist()
    assert mask == [float(m) for m in traj.completion.mask]
    assert batch.loss_mask[0, :p].sum() == 0 and batch.loss_mask[0].sum() == sum(traj.completion.mask)
    env_positions = [p + i for i, m in enumerate(traj.completion.mask) if m == 0]
    assert env_positions and (batch.behaviour_logprobs[0, env_positions] == 0).all()
    assert batch.loss_mask[1].tolist()[:5] == [0, 0, 0, 1, 1], "a single-turn row is unchanged"


def test_tools_go_through_a_template_that_takes_them(tokenizer):
    schemas = [{"type": "function", "function": {"name": "calculate", "description": "Compute.",
                                                 "parameters": {"type": "object", "properties": {}, "required": []}}}]
    plain = ChatTokens(tokenizer, schemas)
    assert plain.tools_via == "system", "the tiny ChatML template ignores tools="
    text = tokenizer.decode(plain.prompt_ids([{"role": "user", "content": "hi"}]))
    assert text.startswith("<|im_start|>system\nYou can call tools.") and json.dumps(schemas[0]["function"]) in text

    original = tokenizer.chat_template
    tokenizer.chat_template = QWEN_LIKE_TOOLS
    try:
        templated = ChatTokens(tokenizer, schemas)
        assert templated.tools_via == "template"
        text = tokenizer.decode(templated.prompt_ids([{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]))
    finally:
        tokenizer.chat_template = original
    assert "# Tools" in text and json.dumps(schemas[0]) in text
    assert "You can call tools." not in text, "a template that takes tools must not get them twice"
    assert text.count("<|im_start|>system") == 1 and text.count("S\n\n# Tools") == 1


def test_a_template_that_rewrites_earlier_turns_does_not_rewrite_the_trajectory(tokenizer):
    original = tokenizer.chat_template
    tokenizer.chat_template = DROPS_OLD_THINKING
    try:
        turn0_text = f"<think>the secret plan</think> {CALL}"
        gen = Scripted(tokenizer, [turn0_text, "<answer>4</answer>"])
        (traj,) = run(runner_for(Calc, tokenizer, max_total_tokens=2000), gen)
        rerendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": turn0_text},
             {"role": "tool", "content": "4"}, {"role": "assistant", "content": "x"}], tokenize=False)
    finally:
        tokenizer.chat_template = original
    assert "secret plan" not in rerendered, "the template drops old reasoning (else this test shows nothing)"
    turn0 = [*list(tokenizer(turn0_text, add_special_tokens=False)["input_ids"]), tokenizer.eos_token_id]
    assert traj.completion.token_ids[: len(turn0)] == turn0, "turn 0 must stay as sampled, reasoning included"
    second = gen.requests[1]
    assert list(second.prompt_token_ids) == traj.prompt_ids + traj.completion.token_ids[: len(second.prompt_token_ids) - len(traj.prompt_ids)]
    assert "secret plan" in tokenizer.decode(second.prompt_token_ids), "turn 1 was sampled seeing turn 0's reasoning"


def test_a_turn_cut_by_its_limit_is_closed_by_environment_tokens(tokenizer):
    gen = Scripted(tokenizer, [CALL, "<answer>4</answer>"], eos=False)
    (traj,) = run(runner_for(Calc, tokenizer, max_total_tokens=2000, max_turn_tokens=200), gen)
    c = traj.completion
    n0 = c.mask.index(0)
    observation = c.token_ids[n0 : n0 + c.mask[n0:].index(1)]
    assert tokenizer.decode(observation).startswith("<|im_end|>\n<|im_start|>tool\n"), tokenizer.decode(observation)


def test_limits_end_trajectories(tokenizer):
    # Turns: the model keeps calling the tool.
    gen = Scripted(tokenizer, [CALL])
    (traj,) = run(runner_for(Calc, tokenizer, max_turns=3, max_total_tokens=2000), gen)
    assert (traj.turns, traj.limit, traj.completion.finish_reason) == (3, "turns", "length")
    assert traj.reward == 0.0 and traj.components == {"limit": 1.0}, "a scoring environment cut short scores 0"
    # Tokens per turn: each request asks for at most max_turn_tokens.
    assert {r.sampling.max_tokens for r in gen.requests} == {200}
    # Total tokens: the observation that would fill the budget ends the trajectory, and no
    # request ever asks for more than what is left.
    gen = Scripted(tokenizer, [CALL])
    # 74 tokens per call, 18 per answer: the second answer would pass 170.
    (traj,) = run(runner_for(Calc, tokenizer, max_turns=50, max_total_tokens=170), gen)
    assert traj.limit == "total_tokens" and traj.turns == 2 and len(traj.completion.token_ids) < 170
    for r in gen.requests:
        used = len(r.prompt_token_ids) - len(traj.prompt_ids)
        assert r.sampling.max_tokens <= 170 - used


def test_concurrent_trajectories_share_generator_batches_within_the_bound(tokenizer, monkeypatch):
    import threading

    active, peak, lock = [0], [0], threading.Lock()

    class Counting(Calc):
        def reset(self, problem):
            with lock:
                active[0] += 1
                peak[0] = max(peak[0], active[0])
            return super().reset(problem)

        def close(self):
            with lock:
                active[0] -= 1

    # The first batch is held until the three trajectories in flight have each asked for a
    # turn, so the batching is checked without racing the environments' threads.
    batchers: list[RequestBatcher] = []
    made = RequestBatcher.__init__
    monkeypatch.setattr(RequestBatcher, "__init__", lambda self, g: (made(self, g), batchers.append(self))[0])

    class Held(Scripted):
        async def generate(self, requests):
            deadline = time.monotonic() + 60
            while not self.batches and batchers[0].requests + len(batchers[0]._pending) < 3:
                assert time.monotonic() < deadline, "three trajectories never asked for a turn"
                await asyncio.sleep(0.01)
            return await super().generate(requests)

    gen = Held(tokenizer, [CALL, "<answer>4</answer>"])
    trajectories = run(runner_for(Counting, tokenizer, concurrency=3, max_total_tokens=2000), gen, n=8)
    assert all(t.reward == 1.0 for t in trajectories)
    assert peak[0] <= 3, f"{peak[0]} trajectories in flight with concurrency 3"
    assert max(gen.batches) > 1, f"turns of concurrent trajectories were never batched: {gen.batches}"


def test_request_batcher_hands_each_trajectory_its_own_completion(tokenizer):
    class Echo(Scripted):
        async def generate(self, requests):
            self.batches.append(len(requests))
            return [[Completion([len(r.prompt_token_ids)], [0.0], "stop", 0)] for r in requests]

    async def go():
        batcher = RequestBatcher(Echo(tokenizer, ["x"]))
        reqs = [GenerationRequest(f"r{i}-t0", [1] * (i + 1), 1, SamplingParams()) for i in range(5)]
        return await asyncio.gather(*(batcher.generate(r) for r in reqs)), batcher

    results, batcher = asyncio.run(go())
    assert [c.token_ids for c in results] == [[1], [2], [3], [4], [5]]
    assert batcher.requests == 5


def test_a_pending_trajectory_survives_a_checkpoint(tmp_path, tokenizer):
    from forgerl.checkpoints import checkpoint as ckpt
    from forgerl.checkpoints.checkpoint_format import Snapshot, capture_rng
    from forgerl.rollouts.rollout import RolloutBatch
    from forgerl.types import Episode

    gen = Scripted(tokenizer, [CALL, "<answer>4</answer>"])
    (traj,) = run(runner_for(Calc, tokenizer, max_total_tokens=2000), gen)
    episode = Episode(Problem("p", "What is 2 + 2?", "4"), 0, traj.prompt_ids, traj.completion, 1.0, {"correct": 1.0})
    rng, arrays = capture_rng()
    state = {"step": 1, "policy_version": 1, "task_state": {}, "next_rollout_index": 2, "time_totals": {},
             "eval_start": None, "eval_last": None, "rng": rng}
    batch = RolloutBatch(index=1, episodes=[episode], policy_version=3, task_state={})
    path = ckpt.save(tmp_path, 1, Snapshot(state=state, rollouts=[batch], arrays=arrays),
                     lambda folder: (folder / "w").write_text("w"), keep=2)
    (loaded,) = ckpt.load(path).rollouts
    assert loaded.episodes[0].completion == traj.completion, "mask, versions, tokens and logprobs all round-trip"
    assert loaded.episodes[0].completion.mask == traj.completion.mask


def test_the_last_turn_gets_no_observation(tokenizer):
    gen = Scripted(tokenizer, [CALL])
    (traj,) = run(runner_for(Calc, tokenizer, max_turns=2), gen)
    assert (traj.turns, traj.observations, traj.limit) == (2, 1, "turns")
    assert traj.completion.mask[-1] == 1, "the trajectory ends with the last sampled token"
