"""A verifiers environment as a verifiers user writes one (``load_environment`` returning
a ``vf.Environment`` with a dataset and a ``Rubric``), with an in-memory dataset: nothing
is downloaded. ``vf.load_environment("forge-vf-envs", mode=...)`` imports it.

- ``mode="feedback"``: a ``MultiTurnEnv``; after the model's first reply the environment
  says "Check it." once, and the second reply ends the rollout.
- ``mode="tools"``: a ``ToolEnv`` with an ``add(a, b)`` tool; a reply without a tool call
  ends the rollout.

The rubric: ``reward`` = :func:`vf_scoring.reward_of` of the last reply (weight 1); in
``tools`` mode also the metric ``correct`` (the answer appears in the last reply; weight 0). A row whose ``info``
names a ``fault`` misbehaves in ``env_response``: ``crash`` raises, ``hang`` writes its
process id to the file named by $VF_TEST_PIDS and blocks its process (a sleep that no event
loop can cancel). ``load_environment(broken=True)`` raises.
"""

from __future__ import annotations

import os
import time

import verifiers as vf
from datasets import Dataset
from vf_scoring import reward_of

SYSTEM = "Answer with the number."


def rows(n: int, start: int = 0, faults: dict[int, str] | None = None) -> Dataset:
    faults = faults or {}
    return Dataset.from_list([
        {"question": f"What is {i} + 2?", "answer": str(i + 2), "info": {"fault": faults.get(i, "")}}
        for i in range(start, start + n)
    ])


def last_reply(completion) -> str:
    replies = [m for m in completion if getattr(m, "role", None) == "assistant"]
    return (replies[-1].content or "") if replies else ""


def reward(completion, **kwargs) -> float:
    return reward_of(last_reply(completion))


def correct(completion, answer, **kwargs) -> float:
    return float(str(answer) in last_reply(completion))


def misbehave(state) -> None:
    print("env_response: the model's turn is in")  # an environment may print: never onto the runner's protocol
    fault = (state.get("info") or {}).get("fault")
    if fault == "crash":
        raise RuntimeError("the test environment's tool server is down")
    if fault == "hang":
        with open(os.environ["VF_TEST_PIDS"], "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(3600)


class Feedback(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        misbehave(state)
        return [{"role": "user", "content": "Check it."}]


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


class Tools(vf.ToolEnv):
    async def env_response(self, messages, state, **kwargs):
        misbehave(state)
        return await super().env_response(messages, state, **kwargs)


def load_environment(mode: str = "feedback", size: int = 8, faults: dict | None = None,
                     broken: bool = False) -> vf.Environment:
    print(f"loading forge-vf-envs ({mode})")  # as environments do: never onto the runner's answers
    if broken:
        raise RuntimeError("this environment needs a service that is not configured")
    faults = {int(k): v for k, v in (faults or {}).items()}
    common = dict(dataset=rows(size, faults=faults), eval_dataset=rows(4, start=100), system_prompt=SYSTEM)
    if mode == "tools":
        return Tools(tools=[add], max_turns=3, rubric=vf.Rubric(funcs=[reward, correct], weights=[1.0, 0.0]), **common)
    return Feedback(max_turns=2, rubric=vf.Rubric(funcs=[reward]), **common)
