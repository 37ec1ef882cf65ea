"""The supervised loop: the RL loop's frame (:class:`forgerl.runloop.loop.Loop`: checkpoints at
step boundaries, metrics rows, SIGTERM handling, summary, hooks), with demonstrations in
place of rollouts.

Per step: take ``sft.batch_size`` rendered examples (:mod:`forgerl.sft.data`), pad them
into one batch of the ``sft`` objective, train on every rank, write one row of metrics.
The position in the data is the loop's "task state", so a checkpoint holds it with the
RNG state and the trainer's (weights and optimizer), and a resumed run continues with
exactly the examples it would have taken.

With ``sft.evaluate`` the run also evaluates, through its generator, on its task's
held-out problems (or trajectories, with an environment), when an RL run would: the
trainer's weights are sent to the generator just before each evaluation (they need not
move otherwise), so the policy version is the step of the last evaluation.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from forgerl.checkpoints import checkpoint as ckpt
from forgerl.interfaces import Task
from forgerl.runloop.loop import Loop
from forgerl.sft.batch import collate
from forgerl.sft.data import Demonstrations
from forgerl.types import Problem

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.configuration.config import RunConfig
    from forgerl.interfaces import Generator, RunContext
    from forgerl.registry.plugins import Registry
    from forgerl.runloop.spmd import TrainerDriver


class DemonstrationTask(Task):
    """What the loop frame calls its task, for a supervised run: the position in the
    demonstrations (what a checkpoint holds as the task state) and the held-out problems
    of the run's task (none without one)."""

    def __init__(self, data: Demonstrations, evaluation: Task | None) -> None:
        self.data = data
        self.evaluation = evaluation

    def next_problems(self, n: int) -> list[Problem]:
        raise RuntimeError("a supervised run draws demonstrations, not problems")

    def eval_problems(self) -> list[Problem]:
        return self.evaluation.eval_problems() if self.evaluation is not None else []

    def state_dict(self) -> dict[str, Any]:
        return self.data.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.data.load_state_dict(state)


class _NoRollouts:
    """The rollout buffer and producer of a run that makes none."""

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


class SFTLoop(Loop):
    def __init__(
        self,
        config: RunConfig,
        registry: Registry,
        ctx: RunContext,
        driver: TrainerDriver,
        data: Demonstrations,
        tokenizer: Any,
        *,
        evaluation: Task | None = None,
        generator: Generator | None = None,
        rewards: Any = None,
        sender: Any = None,
    ):
        # Without sft.evaluate there is no generator: the frame never calls it then.
        super().__init__(config, registry, ctx, driver, generator, DemonstrationTask(data, evaluation),  # type: ignore[arg-type]
                         rewards, sender, tokenizer)  # fmt: skip
        self.data = data

    def evaluates(self) -> bool:
        return self.config.sft.evaluate

    def rollouts(self, source: Any, pending: Any) -> tuple[Any, Any]:
        none = _NoRollouts()
        return none, none

    def train_one(self, buffer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        t_step = time.perf_counter()
        examples = self.data.take(self.config.sft.batch_size)
        position = self.data.state_dict()  # where the next batch starts
        batch = collate(examples, pad_id=self.pad_id)
        t = time.perf_counter()
        train_metrics = self.driver.train_step(batch)
        train_s = time.perf_counter() - t
        self.step += 1
        self.time_totals["train"] += train_s
        tokens = float(batch.attention_mask.sum())
        row: dict[str, Any] = {
            "step": self.step,
            "time/wall": time.time(),
            "time/step": time.perf_counter() - t_step,
            "time/train": train_s,
            "throughput/train_tokens_per_s": tokens / max(train_s, 1e-9),
            "sft/tokens": tokens,
            "sft/padding_frac": 1.0 - tokens / float(batch.attention_mask.numel()),
        }
        row.update(self.data.progress())
        row.update(train_metrics)
        return row, position

    def evaluate(self) -> dict[str, float]:
        if self.policy_version != self.step:  # the generator serves the weights evaluated
            t = time.perf_counter()
            self.sync_weights(self.step)
            self.time_totals["sync"] += time.perf_counter() - t
        return super().evaluate()

    def save(self, buffer: Any, producer: Any) -> None:
        ckpt.save(self.run_dir, self.step, self.snapshot(self.last_batch_task_state, []), self.driver.save,
                  keep=self.config.checkpoint.keep)  # fmt: skip

    def summary(self, status: str) -> dict[str, Any]:
        out = super().summary(status)
        out["objective"] = "sft"
        out["demonstrations"] = dict(sorted(self.data.outcomes.items()))
        return out
