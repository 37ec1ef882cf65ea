"""The ``verifiers`` environment: environments written for the ``verifiers`` library (PyPI),
run unchanged, trained through the run's OpenAI-compatible endpoint.

A verifiers environment (``load_environment(**args)`` returning a ``vf.Environment``:
``SingleTurnEnv``, ``MultiTurnEnv``, ``ToolEnv``... with a dataset and a ``Rubric``) runs
in verifiers' own virtual environment (verifiers_worker.py says why and how). Each episode
is one verifiers rollout whose model client is the episode's base URL of the run's agent
endpoint, so every model call is sampled by the run's generator and recorded token by
token (forgerl.rollouts.agent_runner); the rubric's score is the reward, its metrics the
components. The problem is a row of the environment's own dataset (the ``verifiers``
task) or, from any other task, the task's prompt and answer.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from forgerl.configuration.limits import MAX_SECONDS
from forgerl.rollouts.agent_runner import AgentEnvironment, AgentEpisode
from forgerl_plugins.environments.verifiers_worker import VerifiersSource, check, worker_for


class VerifiersEnvironment(AgentEnvironment):
    """an environment written for the verifiers library, run in verifiers' own Python through the run's endpoint"""

    name = "verifiers"
    scores = True  # the rubric's score, for every rollout that does not fail

    class Options(AgentEnvironment.Options, VerifiersSource):
        timeout: float = Field(
            120.0, gt=0, le=MAX_SECONDS, description="Seconds an episode may take (its verifiers rollout and scoring; "
            "the first episodes also wait for the environment to load); then its process is killed and its "
            "trajectory fails.",
        )
        sampling_args: dict[str, Any] = Field(
            default_factory=dict, description="verifiers' sampling_args of each rollout (only max_tokens applies: "
            "the run samples with loop.sampling; environment.max_turn_tokens bounds max_tokens).",
        )

    @staticmethod
    def local_preflight(options: VerifiersEnvironment.Options) -> None:
        """verifiers is installed where the runner runs, and the environment loads."""
        check(options, "environment verifiers", "environment.options")

    def __init__(self, options: Options):
        self.options = options

    async def run_episode(self, episode: AgentEpisode) -> Any:
        return await worker_for(self.options).run(episode, self.options.sampling_args)

    def close(self) -> None:
        """Nothing per episode: the server is shared by the run's episodes (verifiers_worker)."""
