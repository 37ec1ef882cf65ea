"""The Reward kit: what a run relies on from a reward, checked against one backend by name.

What it checks (each a test of :class:`RewardContract`):

- the backend builds through the registry into a :class:`~forgerl.interfaces.Reward` that
  implements ``score`` or ``ascore``;
- every sample of a battery of completions (typical, empty, whitespace, a huge one, text
  with control characters, lone surrogates as decoded bytes leave them, NUL bytes, every
  finish reason) scores a finite number or a :class:`~forgerl.types.RewardResult` that did
  not fail, with finite components: the run would otherwise score those samples
  ``loop.failed_reward`` and count them in ``reward/failed``;
- scoring is deterministic: the same sample scores the same, twice on one instance and
  once on a second instance built from the same options;
- ``ascore`` agrees with ``score`` (the run uses ``ascore`` for rewards that override it);
- a blocking reward scores the same in a reward worker process (a fresh interpreter that
  builds its own copy from the backend's name and options, as :mod:`forgerl.rewards.reward_workers`
  does in a run), which also proves that the samples and the options travel as plain data;
- the subclass's ``known_scores``, when given: each sample scores the expected value.

A subclass names the backend (``backend``), its options as a config holds them
(``options``), the plugins to load when it is not installed (``plugins``), and may give the
problems the reward is meant for (``problems()``: a reward that reads metadata of its own
task's problems needs them) and ``completions`` that score well.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from forgerl.testing.registry import backend_under_test, registry_for
from forgerl.testing.timing import scaled

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.interfaces import Reward
    from forgerl.types import Problem, RewardInput

#: How long the kit waits for one sample in a reward worker process (scaled); a worker's
#: start-up (importing the plugin) does not count.
WORKER_TIMEOUT_S = 60.0

#: Completions no reward may fail on: the generator can produce every one of them.
HARD_TEXTS: dict[str, str] = {
    "empty": "",
    "whitespace": " \n\t\r\n  ",
    "huge": ("step 12 of the proof, so x = 7 and y = -3.5; " * 6000) + "<answer>7</answer>",
    "control characters": "\x00\x01\x1b[31m answer \x7f\x85\u2028\u2029 \x00",
    "lone surrogates": b"r\xe9sum\xe9 \xff\xfe answer".decode("utf-8", errors="surrogateescape"),
    "replacement characters": "\ufffd\ufffd 4 \ufffd",
    "unicode": "答案是 ４２ — \u202eright-to-left\u202c 🙂 ∑ x² ≠ ∞",
    "unbalanced markup": "<answer><answer>4</answer \\frac{ $$ \\boxed{ <think>",
    "one long word": "9" * 50_000,
}


class RewardContract:
    """Base class of a plugin's reward conformance tests (see the module's docstring)."""

    #: The reward's backend name, as a config names it.
    backend: ClassVar[str] = ""
    #: Its options, as a config's ``rewards[i].options`` holds them (plain data).
    options: ClassVar[Mapping[str, Any]] = {}
    #: Plugin modules to load besides the installed ones (import paths).
    plugins: ClassVar[Sequence[str]] = ()
    #: Completions this reward is meant to score (added to :data:`HARD_TEXTS`).
    completions: ClassVar[Sequence[str]] = ("The answer is 4.", "<answer>4</answer>")
    #: (sample, expected value) pairs the reward must score exactly (approximately).
    known_scores: ClassVar[Sequence[tuple[RewardInput, float]]] = ()

    # ------------------------------------------------------------- overridable

    def problems(self) -> list[Problem]:
        """The problems the samples are made of: a plain question with an integer answer,
        and a chat prompt. Override for a reward that needs its own task's problems."""
        from forgerl.types import Problem

        return [
            Problem(id="kit/plain", prompt="What is 2 + 2?", answer="4"),
            Problem(
                id="kit/chat",
                prompt=[{"role": "user", "content": "What is 2 + 2?"}],
                answer="4",
                metadata={"answer_type": "integer"},
            ),
        ]

    # ----------------------------------------------------------------- helpers

    def build(self) -> Reward:
        """A new instance, built as a run builds it."""
        return backend_under_test("reward", self.backend, self.plugins).build(dict(self.options))

    def samples(self) -> dict[str, RewardInput]:
        """Every sample of the battery, by a label that says what it is."""
        from forgerl.types import RewardInput

        texts = {**{f"completion {i}": t for i, t in enumerate(self.completions)}, **HARD_TEXTS}
        out = {}
        for problem in self.problems():
            for label, text in texts.items():
                for reason in ("stop", "length", "abort"):
                    out[f"{problem.id}, {label}, {reason}"] = RewardInput(problem, text, reason)
        return out

    # ------------------------------------------------------------------- tests

    def test_builds_a_reward_through_the_registry(self) -> None:
        from forgerl.interfaces import Reward

        reward = self.build()
        assert isinstance(reward, Reward), (
            f"reward {self.backend!r} built a {type(reward).__name__}, not a forgerl.interfaces.Reward"
        )
        assert type(reward).implements_scoring(), f"{type(reward).__name__} implements neither score nor ascore"

    def test_every_sample_scores_a_finite_number(self) -> None:
        reward = self.build()
        failures = []
        for label, sample in self.samples().items():
            value, components, error = score_in_process(reward, sample)
            if value is None:
                failures.append(f"{label}: {error}")
            bad = {k: v for k, v in components.items() if not math.isfinite(v)}
            if bad:
                failures.append(f"{label}: components that are not finite numbers {bad}")
        assert not failures, (
            f"reward {self.backend!r} failed {len(failures)} sample(s) a run would score as failed:\n  "
            + "\n  ".join(failures[:20])
        )

    def test_scoring_is_deterministic(self) -> None:
        first, second = self.build(), self.build()
        differ = []
        for label, sample in self.samples().items():
            a, b, c = (score_in_process(r, sample) for r in (first, first, second))
            if not (a == b == c):
                differ.append(f"{label}: {a[:2]}, again {b[:2]}, on a new instance {c[:2]}")
        assert not differ, f"reward {self.backend!r} scores the same sample differently:\n  " + "\n  ".join(
            differ[:20]
        )

    def test_ascore_agrees_with_score(self) -> None:
        from forgerl.interfaces import Reward

        reward = self.build()
        if type(reward).score is Reward.score:
            return  # async only: there is no score to agree with
        differ = []
        for label, sample in self.samples().items():
            blocking = score_in_process(reward, sample)
            awaited = asyncio.run(_ascore(reward, sample))
            if blocking != awaited:
                differ.append(f"{label}: score {blocking[:2]}, ascore {awaited[:2]}")
        assert not differ, f"reward {self.backend!r}: ascore and score disagree:\n  " + "\n  ".join(differ[:20])

    def test_scores_the_same_in_a_reward_worker_process(self) -> None:
        from forgerl.interfaces import Reward
        from forgerl.rewards.reward_workers import RewardRecipe, RewardWorkerPool

        reward = self.build()
        if type(reward).ascore is not Reward.ascore:
            return  # an async reward runs on the run's event loop, never in a worker
        samples = self.samples()
        pool = RewardWorkerPool(
            [RewardRecipe(self.backend, dict(self.options))],
            size=1,
            timeout=scaled(WORKER_TIMEOUT_S),
            plugins=registry_for(self.plugins).plugin_refs,  # as a run hands them to its workers
            start_timeout=scaled(120.0),
        )
        try:
            futures = {label: pool.submit(0, sample) for label, sample in samples.items()}
            remote = {label: f.result() for label, f in futures.items()}
        finally:
            pool.close()
        assert pool.broken is None, f"reward {self.backend!r} cannot be built in a worker process: {pool.broken}"
        differ = [
            f"{label}: here {score_in_process(reward, samples[label])[:2]}, in a worker {outcome}"
            for label, outcome in remote.items()
            if outcome != score_in_process(reward, samples[label])
        ]
        assert not differ, (
            f"reward {self.backend!r} scores differently in a worker process (built there from its "
            "name and options):\n  " + "\n  ".join(differ[:20])
        )

    def test_known_scores(self) -> None:
        reward = self.build()
        wrong = []
        for sample, want in self.known_scores:
            value, _, error = score_in_process(reward, sample)
            if value is None or not math.isclose(value, want, rel_tol=1e-9, abs_tol=1e-12):
                wrong.append(f"{sample.completion_text[:60]!r}: {error or value}, expected {want}")
        assert not wrong, f"reward {self.backend!r} scored known samples wrongly:\n  " + "\n  ".join(wrong)


def score_in_process(reward: Any, sample: RewardInput) -> tuple[float | None, dict[str, float], str | None]:
    """(value, components, error) as the run would record it: value None when the reward
    raised or returned something that is not a finite number (error says what)."""
    from forgerl.interfaces import Reward
    from forgerl.rewards.reward_workers import score_one

    if type(reward).score is Reward.score:  # async only
        return asyncio.run(_ascore(reward, sample))
    return score_one(reward, sample)


async def _ascore(reward: Any, sample: RewardInput) -> tuple[float | None, dict[str, float], str | None]:
    from forgerl.rewards.reward_workers import outcome_of

    try:
        return outcome_of(await reward.ascore(sample))
    except Exception as exc:  # noqa: BLE001 - reported as the run would record it
        return None, {}, f"{type(exc).__name__}: {exc}"
