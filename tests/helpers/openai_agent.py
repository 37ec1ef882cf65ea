"""An agent program as a user would have it: it knows nothing of forgerl. ``OpenAI()``
reads OPENAI_BASE_URL and OPENAI_API_KEY, which the ``agent`` environment sets per
episode; the problem comes as JSON on stdin; the reward goes out as the last line of
stdout.

    python tests/helpers/openai_agent.py MODE

MODE ``chat``: two calls (the second extends the first), then the reward:
:func:`reward_of` its last reply (a function of the text, so that rewards differ within a
group and a test can recompute them). Each call's ``usage`` and text go to the file named
by $AGENT_LOG, one JSON line per episode.
Faulty modes for the fault tests: ``hang`` (its pid in $AGENT_PIDS at once, then one
call, then sleeps), ``crash`` (exit status 3, a message on stderr), ``garbage`` (a last line
that is not JSON), ``silent`` (one call, prints nothing: the run's Reward plugins score).
"""

from __future__ import annotations

import json
import os
import sys
import time


def reward_of(text: str) -> float:
    """The reward of a last reply: any fixed function of the text serves."""
    return (sum(map(ord, text)) % 7) / 6


def main() -> int:
    from openai import OpenAI

    mode = sys.argv[1]
    if mode == "hang":
        # First thing: on a loaded machine the deadline may pass before the imports and the
        # call below, and the test must still find the process it expects killed.
        with open(os.environ["AGENT_PIDS"], "a") as f:
            f.write(f"{os.getpid()}\n")
    problem = json.loads(sys.stdin.readline())
    client = OpenAI(max_retries=0)
    prompt = problem["prompt"]  # a text, or a chat (a list of messages)
    messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    first = client.chat.completions.create(model="any", messages=messages)
    if mode == "hang":
        time.sleep(3600)
    if mode == "crash":
        print("agent: the tool server is down", file=sys.stderr)
        return 3
    if mode == "garbage":
        print("solved it, I think")
        return 0
    if mode == "silent":
        return 0
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Check it."}]
    second = client.chat.completions.create(model="any", messages=messages)
    record = {
        "problem": problem["id"],
        "calls": [{"usage": r.usage.model_dump(), "text": r.choices[0].message.content} for r in (first, second)],
    }
    if os.environ.get("AGENT_LOG"):
        with open(os.environ["AGENT_LOG"], "a") as f:
            f.write(json.dumps(record) + "\n")
    print("agent: done", file=sys.stderr)
    text = second.choices[0].message.content or ""
    print(json.dumps({"reward": reward_of(text), "components": {"correct": float(str(problem["answer"]) in text)}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
