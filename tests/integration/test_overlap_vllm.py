"""``loop.overlap: continuous`` against a real vLLM server (CPU, the session's shared one,
the tiny model) under ``update_policy: keep``.

The real loop (producer thread, buffer, checkpoint, metrics) trains three steps with the
vllm generator; the trainer's side sends new weights for each version (the model folder's
plus noise seeded by the version) without optimising anything. The first update is made
to happen with the producer's requests in flight: the fourth request waits to be sent
until that update has begun (the versioned loop would wait for it before updating, and
never update). Checked: the run ends, nothing is lost or trained twice, every update
found requests in flight where forced, and every trained token's sampling logprob is the
one its labelled version's weights give it, whichever side of an update it was sampled on.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.timing import scaled

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]

ATOL = 1e-4  # served vs trainer logprobs, fp32 on both sides (as in test_vllm)
STEPS, PROMPTS, GROUP = 3, 2, 2


class NoiseTrainer:
    """The trainer's side of the run: version ``v``'s weights are the site's noise seeded
    by ``v``; nothing is optimised (what is checked is the sampling side)."""

    def __init__(self, site: Any) -> None:
        self.site = site
        self.weights: dict[int, Any] = {0: None}  # None: the model folder's

    def train_step(self, batch: Any) -> dict[str, float]:
        return {}

    def export_weights(self, version: int) -> Any:
        from forgerl.types import WeightSet

        self.weights[version] = self.site.new_weights(version)
        return WeightSet(version, dict(self.weights[version]))

    def save(self, path: Path) -> None:
        (path / "trainer.txt").write_text("noise")

    def load(self, path: Path) -> None:
        raise AssertionError("nothing to resume")


def _generator(inner: Any) -> Any:
    """``inner`` with the requests in flight counted at each update; the fourth request
    is held (in flight, not yet sent) until the first update begins, and the first update
    begins only once the fourth request has arrived (the producer admits the first four
    groups at version 0 at once, but nothing else stops batch 0 from finishing and being
    trained before the producer's thread gets round to the fourth: then the first update
    might find no request in flight)."""
    from forgerl.interfaces import Generator

    class FirstUpdateInFlight(Generator):
        def __init__(self) -> None:
            self.lock = threading.Lock()
            self.calls = 0
            self.active = 0
            self.in_flight_at_update: dict[int, int] = {}
            self.first_update = threading.Event()
            self.fourth_arrived = threading.Event()

        async def generate(self, requests):
            with self.lock:
                self.calls += 1
                call = self.calls
                self.active += 1
            try:
                if call == 4:
                    self.fourth_arrived.set()
                    began = await asyncio.to_thread(self.first_update.wait, scaled(300))
                    assert began, "the first update never began: the loop held it back"
                return await inner.generate(requests)
            finally:
                with self.lock:
                    self.active -= 1

        def update_weights(self, version: int) -> None:
            if version == 1:
                arrived = self.fourth_arrived.wait(scaled(300))
                assert arrived, "the fourth request never came: the producer stopped admitting"
            with self.lock:
                self.in_flight_at_update[version] = self.active
            self.first_update.set()
            inner.update_weights(version)

        @property
        def policy_version(self) -> int:
            return int(inner.policy_version)

    return FirstUpdateInFlight()


def test_continuous_overlap_trains_on_exactly_labelled_tokens_across_updates(shared_vllm, tmp_path):
    import torch

    from forgerl.configuration.config import RunConfig
    from forgerl.interfaces import RunContext
    from forgerl.registry.plugins import build_registry
    from forgerl.runloop.loop import Loop
    from forgerl.runloop.spmd import TrainerDriver
    from forgerl.testing.generator_support import teacher_forced

    from ..unit.test_loop_fixed_weights import FakeRewards, FakeTask

    site = shared_vllm.site()
    config = RunConfig.model_validate(
        {
            "generator": {"name": "vllm", "options": {"update_policy": "keep"}},
            "loop": {
                "steps": STEPS,
                "prompts_per_step": PROMPTS,
                "group_size": GROUP,
                "max_staleness": 1,
                "overlap": "continuous",
                "stale_samples": "mask",
                "eval_at_start": False,
                "eval_size": 1,
                "sampling": {"max_tokens": 48, "temperature": 1.0},
            },
            "transport": {"timeout": scaled(60)},
            "logging": {"tensorboard": False, "progress": False},
        }
    )
    trainer = NoiseTrainer(site)
    with site.open() as opened:
        opened.generator.updater.policy = "keep"  # the site's servers are the vllm kit's (wait)
        gen = _generator(opened.generator)
        loop = Loop(config, build_registry(), RunContext.for_run(config, tmp_path, model_path=site.model_dir),
                    TrainerDriver(trainer, 1), gen, FakeTask(), FakeRewards(), opened.sender,
                    site.tokenizer)  # fmt: skip
        taken: list[Any] = []
        make = loop.rollouts

        def rollouts(source, pending):
            buffer, producer = make(source, pending)
            get = buffer.get

            def recorded(index: int, timeout: float | None = None) -> Any:
                batch = get(index, scaled(300))
                taken.append(batch)
                return batch

            buffer.get = recorded
            return buffer, producer

        loop.rollouts = rollouts
        summary = loop.run()
        served = opened.generator.policy_version
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert served == STEPS
    assert gen.in_flight_at_update[1] >= 1, "the first update found no request in flight"
    problems = sorted(e.problem.id for b in taken for e in b.episodes[::GROUP])
    assert problems == sorted(f"p{i}" for i in range(STEPS * PROMPTS)), "each prompt trained once"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(0.0 <= r["time/generator_idle_frac"] <= 1.0 for r in rows), rows

    crossed = 0
    for batch in taken:
        for e in batch.episodes:
            c = e.completion
            versions = c.versions or [c.policy_version] * len(c.token_ids)
            crossed += len(set(versions)) > 1
            served_lp = torch.tensor(c.logprobs)
            for version in sorted(set(versions)):
                model = site.reference(trainer.weights[version])
                want = teacher_forced(model, list(e.prompt_token_ids), c.token_ids, 1.0)
                where = torch.tensor([v == version for v in versions])
                gap = float((served_lp[where] - torch.as_tensor(want)[where]).abs().max())
                assert gap < ATOL, f"batch {batch.index}, {e.problem.id}: version {version}'s tokens: gap {gap:.2e}"
    site.reference()  # back to the folder's weights for the next test
    print(f"completions that ran across an update: {crossed}; idle fractions: "
          f"{[round(r['time/generator_idle_frac'], 3) for r in rows]}")  # fmt: skip
