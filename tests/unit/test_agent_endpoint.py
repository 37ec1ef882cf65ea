"""The agent endpoint (forgerl.rollouts.agent_endpoint, agent_episode, agent_chat): agents written
against the official ``openai`` client call the run's endpoint; every call is sampled by
the run's generator from token ids, the calls of one episode are one trajectory whose
sampled tokens are exactly the generator's (mask 1, logprobs, versions) and whose other
tokens are the template's rendering of what the agent added (mask 0). Against the tiny
model's tokenizer and a scripted generator; real HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from forgerl.rollouts.agent_chat import ApiError, assistant_message, parse_request
from forgerl.rollouts.agent_runner import AgentRunner
from forgerl.rollouts.chat_tokens import ChatTokens
from forgerl.rollouts.env_rollouts import EnvironmentRollouts
from forgerl.rollouts.trajectory import Limits, RequestBatcher
from forgerl.types import Problem, RewardInput, RewardResult, SamplingParams
from forgerl_plugins.environments.agent import AgentProgram
from tests.helpers import agents
from tests.helpers.agents import BAD_CALL, CALCULATE, CALL, SEEN, STRICT_CALCULATE, Scripted

pytest.importorskip("transformers")
pytest.importorskip("openai")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def make_rollouts(tokenizer, tmp_path):
    made = []

    def make(entry: str, *, timeout: float = 30.0, **limits) -> EnvironmentRollouts:
        options = AgentProgram.Options(entry=f"tests.helpers.agents:{entry}", timeout=timeout, max_request_bytes=2 << 20)
        limits = {"max_turns": 4, "max_total_tokens": 2000, "max_turn_tokens": 200, "turn_timeout": 10.0,
                  "concurrency": 8, **limits}
        runner = AgentRunner(lambda: AgentProgram(options), tokenizer, Limits(**limits), SamplingParams(max_tokens=64),
                             options, model="tiny", context_length=1024)
        rollouts = EnvironmentRollouts(runner, failed_reward=-0.5, run_dir=tmp_path)
        made.append(rollouts)
        return rollouts

    yield make
    for r in made:
        r.close()


async def scored_as_half(samples: list[RewardInput]) -> list[RewardResult]:
    return [RewardResult(0.25, {"scored": 1.0}) for _ in samples]


def run(rollouts: EnvironmentRollouts, generator, n: int = 1, score=scored_as_half):
    SEEN.clear()
    jobs = [(Problem(f"p{i}", f"What is {i} + 2?", str(i + 2)), f"r{i}", 7 + i) for i in range(n)]
    return asyncio.run(rollouts.scored(generator, jobs, score))


def ids(tokenizer, text: str) -> list[int]:
    return [*list(tokenizer(text, add_special_tokens=False)["input_ids"]), tokenizer.eos_token_id]


def test_an_openai_client_agents_calls_are_one_token_exact_trajectory(make_rollouts, tokenizer):
    gen = Scripted(tokenizer, ["It is 2.", "Yes, 2."])
    [s], metrics = run(make_rollouts("chat_twice"), gen)
    t = s.trajectory
    assert t.failure is None, t.failure
    # The agent's reward and components are the episode's.
    assert s.result == RewardResult(0.5, {"correct": 1.0}) and t.reward == 0.5
    first, second = gen.requests
    turn0, turn1 = ids(tokenizer, "It is 2."), ids(tokenizer, "Yes, 2.")
    # The first prompt is the template's rendering of the agent's messages.
    chat = ChatTokens(tokenizer)
    assert t.prompt_ids == chat.prompt_ids([{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "What is 0 + 2?"}])
    assert list(first.prompt_token_ids) == t.prompt_ids
    # The second call was sampled from the first turn's tokens as sampled, then only the new message.
    observation = list(second.prompt_token_ids)[len(t.prompt_ids) + len(turn0):]
    assert list(second.prompt_token_ids) == t.prompt_ids + turn0 + observation
    assert tokenizer.decode(observation) == "\n<|im_start|>user\nAre you sure?<|im_end|>\n<|im_start|>assistant\n"
    c = t.completion
    assert c.token_ids == turn0 + observation + turn1
    assert c.mask == [1] * len(turn0) + [0] * len(observation) + [1] * len(turn1)
    assert c.logprobs == [-0.25] * len(turn0) + [0.0] * len(observation) + [-0.25] * len(turn1)
    assert c.versions == [3] * len(c.token_ids) and c.policy_version == 3
    assert (t.turns, t.observations, t.rewrites, t.dropped_tokens) == (2, 1, 0, 0)
    # What the agent got back: the sampled text, OpenAI-shaped.
    replies = SEEN["p0"]["replies"]
    assert [r.choices[0].message.content for r in replies] == ["It is 2.", "Yes, 2."]
    assert [r.choices[0].finish_reason for r in replies] == ["stop", "stop"]
    assert replies[1].usage.prompt_tokens == len(second.prompt_token_ids)
    assert replies[1].usage.completion_tokens == len(turn1) and replies[0].model == "tiny"
    assert SEEN["p0"]["models"] == ["tiny"]
    # max_tokens=100000 was clamped to the environment's bound per turn.
    assert second.sampling.max_tokens == 200 and first.sampling.max_tokens == 200
    assert metrics["env/failed"] == 0 and metrics["env/agent_rewrites_mean"] == 0
    # The conversation the endpoint saw, for the sample records: the last call's messages, then its answer.
    assert t.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 0 + 2?"},
                          {"role": "assistant", "content": "It is 2."}, {"role": "user", "content": "Are you sure?"},
                          {"role": "assistant", "content": "Yes, 2."}]


def test_tool_calls_come_back_parsed_and_the_answer_extends_the_trajectory(make_rollouts, tokenizer):
    gen = Scripted(tokenizer, [f"Let me compute. {CALL}", "<answer>4</answer>"])
    [s], _ = run(make_rollouts("uses_tools"), gen)
    t = s.trajectory
    assert t.failure is None and t.rewrites == 0 and t.turns == 2, t
    # No reward from the agent: the run's Reward plugins scored the last turn.
    assert s.result == RewardResult(0.25, {"scored": 1.0}) and t.last_text == "<answer>4</answer>"
    first, second = SEEN["p0"]["replies"]
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and message.content == "Let me compute."
    [call] = message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("calculate", {"expression": "2 + 2"})
    assert second.choices[0].message.content == "<answer>4</answer>" and not second.choices[0].message.tool_calls
    # The tools reached the model as the environments offer them (this template: the system prompt).
    prompt = tokenizer.decode(t.prompt_ids)
    assert "You can call tools." in prompt and '"name": "calculate"' in prompt
    turn0 = ids(tokenizer, f"Let me compute. {CALL}")
    c = t.completion
    observation = c.token_ids[len(turn0): c.mask.index(1, len(turn0))]
    assert c.token_ids[: len(turn0)] == turn0, "the tool-calling turn is trained as sampled, not as re-rendered"
    assert tokenizer.decode(observation) == "\n<|im_start|>tool\n4<|im_end|>\n<|im_start|>assistant\n"
    # The records' messages: the calls as the agent got them back, the tool's answer, the final turn;
    # as SFT data (forge samples --export) they are the same conversation.
    from forgerl.sft.rows import Chat, parse_row

    made, answer, final = t.messages[-4:-1], t.messages[-2], t.messages[-1]
    assert [m["role"] for m in t.messages[-3:]] == ["assistant", "tool", "assistant"], t.messages
    assert made[1]["content"] == "Let me compute." and made[1]["tool_calls"][0]["function"]["name"] == "calculate"
    assert answer == {"role": "tool", "content": "4", "tool_call_id": made[1]["tool_calls"][0]["id"]}
    assert final == {"role": "assistant", "content": "<answer>4</answer>"}
    chat = parse_row({"messages": t.messages}, "record")
    assert isinstance(chat, Chat) and chat.messages[-1]["content"] == "<answer>4</answer>"
    assert next(m["content"] for m in chat.messages if m["role"] == "assistant") == f"Let me compute.\n{CALL}"


def test_a_strict_tools_call_that_breaks_its_schema_is_not_returned_as_a_tool_call(make_rollouts, tokenizer):
    """OpenAI's ``strict: true`` promises that a tool call's arguments validate against the
    tool's schema. The endpoint cannot constrain what the model samples (the tokens trained
    on are its own samples), so it keeps that promise the other way: a call that breaks the
    schema is left in the content, as a malformed call is, with finish_reason "stop"; the
    agent never gets arguments its tool cannot take. A call that validates is a tool call."""
    gen = Scripted(tokenizer, [f"Let me compute. {BAD_CALL}", "<answer>4</answer>"])
    [s], _ = run(make_rollouts("uses_strict_tools"), gen)
    assert s.trajectory.failure is None, s.trajectory.failure
    [reply] = SEEN["p0"]["replies"]  # no tool call came back: the agent's loop ended
    assert reply.choices[0].finish_reason == "stop" and not reply.choices[0].message.tool_calls
    assert reply.choices[0].message.content == f"Let me compute. {BAD_CALL}"
    assert s.trajectory.last_text == f"Let me compute. {BAD_CALL}", "what the Reward plugins score"

    gen = Scripted(tokenizer, [f"Let me compute. {CALL}", "<answer>4</answer>"])
    [s], _ = run(make_rollouts("uses_strict_tools"), gen)
    first, second = SEEN["p0"]["replies"]
    assert first.choices[0].finish_reason == "tool_calls" and first.choices[0].message.content == "Let me compute."
    assert second.choices[0].finish_reason == "stop" and second.choices[0].message.content == "<answer>4</answer>"
    [call] = first.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"expression": "2 + 2"}
    assert s.trajectory.failure is None and s.trajectory.turns == 2


def test_strict_is_per_tool_and_a_non_strict_tool_gets_its_calls_as_written():
    strict = parse(request_with([STRICT_CALCULATE, {**CALCULATE, "function": {**CALCULATE["function"], "name": "loose"}}]))
    assert set(strict.strict) == {"calculate"}
    assert all("strict" not in t["function"] for t in strict.tools), "the template renders the tools without it"
    loose_call = BAD_CALL.replace('"calculate"', '"loose"')
    message = assistant_message(f"{BAD_CALL} {loose_call} {CALL}", tools_offered=True, call_prefix="c",
                                strict=strict.strict)  # fmt: skip
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("loose", {"value": "2 + 2"}), ("calculate", {"expression": "2 + 2"})]
    assert message["content"] == BAD_CALL


def test_a_strict_tool_whose_schema_is_not_a_json_schema_is_a_400():
    bad = {**STRICT_CALCULATE, "function": {**STRICT_CALCULATE["function"], "parameters": {"type": "objekt"}}}
    with pytest.raises(ApiError) as info:
        parse(request_with([bad]))
    assert info.value.status == 400 and info.value.param == "tools[0].function.parameters", info.value.message
    assert "is not a valid JSON schema" in info.value.message


def request_with(tools: list) -> dict:
    return {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "tools": tools}


def test_a_rewritten_history_starts_a_new_segment_and_only_the_last_is_trained(make_rollouts, tokenizer):
    gen = Scripted(tokenizer, ["It is 2.", "Still 2."])
    [s], metrics = run(make_rollouts("rewrites_history"), gen)
    t = s.trajectory
    assert t.failure is None and s.result.value == 1.0
    second = gen.requests[1]
    assert t.prompt_ids == list(second.prompt_token_ids), "the rewrite is rendered whole as a new prompt"
    assert "Earlier you said: It is 2.. Go on." in tokenizer.decode(t.prompt_ids)
    assert t.completion.token_ids == ids(tokenizer, "Still 2.") and set(t.completion.mask) == {1}
    assert (t.rewrites, t.dropped_tokens) == (1, len(ids(tokenizer, "It is 2.")))
    assert metrics["env/agent_rewrites_mean"] == 1 and metrics["env/agent_dropped_tokens_mean"] == t.dropped_tokens
    assert t.messages == [{"role": "user", "content": "Earlier you said: It is 2.. Go on."},
                          {"role": "assistant", "content": "Still 2."}], "the records show the trained segment"


def test_limits_refuse_calls_and_cut_the_trajectory_without_failing_it(make_rollouts, tokenizer):
    import openai

    gen = Scripted(tokenizer, ["More of it."])
    [s], metrics = run(make_rollouts("until_refused", max_turns=3), gen)
    t = s.trajectory
    error = SEEN["p0"]["error"]
    assert isinstance(error, openai.BadRequestError) and error.code == "episode_call_limit", error
    assert "environment.max_turns" in error.message
    assert len(SEEN["p0"]["replies"]) == 3 and len(gen.requests) == 3
    assert t.failure is None and t.limit == "turns" and t.completion.finish_reason == "length"
    assert s.result == RewardResult(0.25, {"scored": 1.0}), "a trajectory cut by a limit is scored, not failed"
    assert metrics["env/limit_frac"] == 1 and metrics["env/failed"] == 0
    # Total tokens: each call asks for at most what is left, and the call that would not fit is refused.
    gen = Scripted(tokenizer, ["More of it."])
    [s], _ = run(make_rollouts("until_refused", max_turns=50, max_total_tokens=60), gen)
    t = s.trajectory
    assert SEEN["p0"]["error"].code == "context_length_exceeded" and t.limit == "total_tokens"
    assert len(t.completion.token_ids) <= 60 and t.completion.mask[-1] == 1
    for r in gen.requests:
        used = len(r.prompt_token_ids) - len(t.prompt_ids)
        assert r.sampling.max_tokens <= 60 - used


def test_hostile_requests_get_openai_style_errors_that_clients_do_not_retry(make_rollouts, tokenizer):
    gen = Scripted(tokenizer, ["Fine."])
    [s], _ = run(make_rollouts("attacks"), gen)
    seen = SEEN["p0"]
    expected = {
        "bad json": (400, "invalid_json"), "not an object": (400, None), "stream": (400, "unsupported_parameter"),
        "n": (400, "unsupported_parameter"), "no messages": (400, None), "bad role": (400, None),
        "image": (400, None), "bad max_tokens": (400, None), "no key": (401, "invalid_api_key"),
        "wrong key": (401, "invalid_api_key"), "unknown episode": (404, "unknown_episode"),
        "unknown path": (404, "unknown_url"), "GET completions": (405, None), "too big": (413, None),
        "huge prompt": (400, "context_length_exceeded"),
    }
    for name, (status, code) in expected.items():
        got, headers, body = seen[name]
        assert got == status, f"{name}: {got} {body}"
        assert set(body) == {"error"} and isinstance(body["error"]["message"], str), f"{name}: {body}"
        assert body["error"].get("code") == code or code is None, f"{name}: {body}"
        assert headers.get("x-should-retry") == "false", f"{name}: {headers}"
    assert (seen["chunked"], seen["header flood"], seen["two lengths"], seen["not http"]) == (501, 431, 400, 400)
    assert seen["model"][0] == 200 and seen["model"][2]["id"] == "tiny"
    status, _, body = seen["good"]
    assert status == 200 and body["choices"][0]["message"]["content"] == "Fine."
    # Only the good call reached the generator, and it is the trajectory.
    assert len(gen.requests) == 1 and s.trajectory.failure is None and s.trajectory.turns == 1


def test_calls_of_concurrent_episodes_are_batched(make_rollouts, tokenizer, monkeypatch):
    # While one batch is generated, the calls that arrive wait and go together in the next.
    # The first batch is held until all four first calls have reached the batcher, so the
    # check does not depend on how fast the agents' threads happen to run.
    batchers: list[RequestBatcher] = []
    made = RequestBatcher.__init__
    monkeypatch.setattr(RequestBatcher, "__init__", lambda self, g: (made(self, g), batchers.append(self))[0])
    gen = Scripted(tokenizer, ["It is 2.", "Yes."],
                   hold_first=lambda: batchers[0].requests + len(batchers[0]._pending) >= 4)
    scored, _ = run(make_rollouts("chat_twice", concurrency=4), gen, n=8)
    assert all(s.trajectory.failure is None and s.result.value == 0.5 for s in scored)
    assert len(gen.requests) == 16 and max(gen.batches) > 1, gen.batches
    # Each episode's trajectory holds its own calls: its prompt asks its own question.
    for i, s in enumerate(scored):
        assert f"What is {i} + 2?" in tokenizer.decode(s.trajectory.prompt_ids)


def test_a_failing_generator_fails_the_run_not_the_episode(make_rollouts, tokenizer, tmp_path):
    with pytest.raises(RuntimeError, match="engine died"):
        run(make_rollouts("chat_twice"), Scripted(tokenizer, ["x"], fail=True))
    assert not (tmp_path / "environment_failures.jsonl").exists()


def test_the_endpoint_refuses_episodes_after_it_is_closed(make_rollouts, tokenizer):
    rollouts = make_rollouts("chat_twice")
    run(rollouts, Scripted(tokenizer, ["a", "b"]))
    url = SEEN["p0"]["base_url"]
    rollouts.close()
    import urllib.error

    with pytest.raises(urllib.error.URLError):
        agents.raw(f"{url}/models", None, key="x", method="GET")


# ------------------------------------------------------------------ the wire format


def parse(body: dict) -> object:
    return parse_request(json.dumps(body).encode())


def test_requests_are_read_in_a_normal_form():
    call = parse({
        "model": "gpt-4o",
        "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "refusal": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "2"},
        ],
        "max_tokens": 9, "max_completion_tokens": 7, "stop": "END", "temperature": 0.1, "seed": 3,
    })
    assert call.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "content": "2", "tool_call_id": "c1"},
    ]
    assert call.max_tokens == 7 and call.stop == ("END",) and call.tools == []


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 5}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": True}, "max_tokens"),
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"function": {}}]}]}, "messages[0].tool_calls[0]"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 7}]}, "messages[0].tool_call_id"),
    ({"messages": "hi"}, "messages"),
])
def test_bad_fields_are_named_in_the_error(body, param):
    with pytest.raises(ApiError) as err:
        parse(body)
    assert err.value.status == 400 and err.value.param == param, err.value.body()


def test_deeply_nested_json_is_a_400_not_a_crash():
    with pytest.raises(ApiError, match="not valid JSON"):
        parse_request(b"[" * 20_000 + b"]" * 20_000)


# ------------------------------------------------------------------ options and start


def test_the_agent_is_named_by_exactly_one_of_entry_and_command():
    from pydantic import ValidationError

    for bad in ({}, {"entry": "a:b", "command": ["x"]}):
        with pytest.raises(ValidationError, match="exactly one of entry"):
            AgentProgram.Options(**bad)
    with pytest.raises(ValidationError):
        AgentProgram.Options(entry="not a reference")


@pytest.mark.parametrize("options,message", [
    ({"entry": "tests.helpers.no_such_module:f"}, "cannot be imported: ModuleNotFoundError"),
    ({"entry": "tests.helpers.agents:SEEN"}, "is a dict, not a function"),
    ({"command": ["forge-no-such-agent-program"]}, "'forge-no-such-agent-program' (options.command) is not found"),
    ({"command": ["python"], "cwd": "/no/such/dir"}, "is not a directory"),
])
def test_an_agent_that_cannot_start_is_a_one_line_error_before_the_run(options, message):
    from forgerl.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        AgentProgram.local_preflight(AgentProgram.Options(**options))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_port_in_use_is_a_one_line_error(make_rollouts, tokenizer):
    import socket

    from forgerl.errors import ConfigError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        rollouts = make_rollouts("chat_twice")
        rollouts.runner.options = rollouts.runner.options.model_copy(update={"port": taken.getsockname()[1]})
        with pytest.raises(ConfigError, match="cannot listen on 127.0.0.1:"):
            run(rollouts, Scripted(tokenizer, ["x"]))


def test_assistant_tool_calls_are_rendered_in_the_format_the_model_was_taught():
    from forgerl.rollouts.agent_chat import for_template

    calls = [{"id": "c1", "type": "function", "function": {"name": "calculate", "arguments": '{"expression": "2 + 2"}'}}]
    message = {"role": "assistant", "content": "Let me see.", "tool_calls": calls}
    [in_text] = for_template([message], tools_in_template=False)
    assert in_text == {"role": "assistant", "content": f"Let me see.\n{CALL}"}
    [structured] = for_template([message], tools_in_template=True)
    assert structured["tool_calls"] == [
        {"type": "function", "id": "c1", "function": {"name": "calculate", "arguments": {"expression": "2 + 2"}}}]


# Renders every assistant turn but the last one differently: observations cannot be
# rendered on their own, so every call is rendered whole (a new segment).
SUMMARISES_OLD_TURNS = (
    "{%- for m in messages %}"
    "{%- set content = '(earlier turn)' if m['role'] == 'assistant' and not loop.last else m['content'] %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + content + '<|im_end|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_a_template_that_rewrites_earlier_turns_makes_each_call_a_segment(make_rollouts, tokenizer):
    original = tokenizer.chat_template
    tokenizer.chat_template = SUMMARISES_OLD_TURNS
    try:
        gen = Scripted(tokenizer, ["It is 2.", "Yes, 2."])
        [s], _ = run(make_rollouts("chat_twice"), gen)
    finally:
        tokenizer.chat_template = original
    t = s.trajectory
    assert t.failure is None and (t.rewrites, t.turns) == (1, 1)
    assert t.prompt_ids == list(gen.requests[1].prompt_token_ids)
    assert "(earlier turn)" in tokenizer.decode(t.prompt_ids), "the model saw the template's rewrite: it is trained so"
