"""The request body and the parsing of a server's answer, without a server; and a
registration module that stays light."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from forgerl.errors import GeneratorError
from forgerl.types import GenerationRequest, SamplingParams
from forgerl_openai_compat.completions import parse_completions, request_body


def req(n=2, **sampling):
    return GenerationRequest("r1", [5, 6, 7], n, SamplingParams(**sampling))


def choice(index, ids, logprobs, finish="stop", text="hi"):
    return {
        "index": index,
        "text": text,
        "finish_reason": finish,
        "logprobs": {"tokens": [f"token_id:{i}" for i in ids], "token_logprobs": logprobs},
    }


def test_the_body_asks_for_token_ids_and_the_sampled_tokens_logprobs():
    body = request_body(
        req(3, max_tokens=9, temperature=0.7, top_k=5, seed=11), "m", send_seed=True, extra={"x": 1}
    )
    assert body["prompt"] == [5, 6, 7] and body["model"] == "m" and body["n"] == 3
    assert body["logprobs"] == 0 and body["return_tokens_as_token_ids"] is True
    assert (body["max_tokens"], body["temperature"], body["top_k"], body["seed"], body["x"]) == (
        9,
        0.7,
        5,
        11,
        1,
    )
    assert "seed" not in request_body(req(seed=11), "m", send_seed=False, extra={})
    assert "top_k" not in request_body(req(), "m", send_seed=True, extra={})


def test_greedy_asks_for_one_completion_and_repeats_it_n_times():
    assert request_body(req(4, temperature=0.0), "m", send_seed=True, extra={})["n"] == 1
    out = parse_completions(req(4, temperature=0.0), {"choices": [choice(0, [1, 2], [-0.1, -0.2])]}, 0)
    assert [c.token_ids for c in out] == [[1, 2]] * 4


def test_choices_become_completions_in_index_order_with_ids_from_the_server():
    data = {"choices": [choice(1, [9], [-1.5], "length", "b"), choice(0, [3, 4], [-0.5, -0.25], "stop", "a")]}
    out = parse_completions(req(2), data, 0)
    assert [(c.token_ids, c.logprobs, c.finish_reason, c.text, c.policy_version) for c in out] == [
        ([3, 4], [-0.5, -0.25], "stop", "a", 0),
        ([9], [-1.5], "length", "b", 0),
    ]


def test_a_token_ids_list_is_taken_when_tokens_are_text():
    c = choice(0, [], [-0.5])
    c["logprobs"]["tokens"] = [" hi"]
    c["token_ids"] = [42]
    assert parse_completions(req(1), {"choices": [c]}, 0)[0].token_ids == [42]


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: c["logprobs"].update(tokens=[" a", " b"]), "as text, not token ids"),
        (lambda c: c["logprobs"].update(token_logprobs=[-0.5]), "2 token ids but 1 logprobs"),
        (lambda c: c.update(logprobs=None), "no token logprobs"),
        (lambda c: c["logprobs"].update(token_logprobs=[None, -0.5]), "not numbers"),
        (lambda c: c.update(finish_reason="content_filter"), "finished a completion with 'content_filter'"),
    ],
)
def test_answers_the_loss_cannot_use_are_refused_in_one_line(change, message):
    c = choice(0, [1, 2], [-0.5, -0.5])
    change(c)
    with pytest.raises(GeneratorError, match=message):
        parse_completions(req(1), {"choices": [c]}, 0)


def test_too_few_choices_and_an_empty_prompt_are_errors():
    with pytest.raises(GeneratorError, match="asked for 2 completions, the server returned 1"):
        parse_completions(req(2), {"choices": [choice(0, [1], [-0.5])]}, 0)
    with pytest.raises(GeneratorError, match="empty prompt"):
        request_body(GenerationRequest("e", [], 1, SamplingParams()), "m", send_seed=True, extra={})


def test_the_registration_module_imports_neither_pydantic_nor_httpx_nor_torch():
    """plugin.py names the class; the class's module, which the registry imports when it is
    built, imports pydantic but neither httpx nor torch."""
    src = Path(__file__).resolve().parents[1] / "src"
    script = (
        "import sys\n"
        "import forgerl_openai_compat.plugin as p\n"
        "[ref] = p.forge_generators()\n"
        "heavy = {'pydantic', 'httpx', 'torch', 'forgerl_openai_compat.generator'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
        "from forgerl.registry.backend_classes import record_for_class\n"
        "from forgerl.backends import GeneratorBackend\n"
        "b = record_for_class(GeneratorBackend, ref, 'forge_generators')\n"
        "assert b.name == 'openai', b.name\n"
        "heavy = {'httpx', 'torch'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
