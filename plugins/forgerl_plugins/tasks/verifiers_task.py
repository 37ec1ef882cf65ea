"""The ``verifiers`` task: the problems of a verifiers environment's own dataset.

The rows come from the environment's ``dataset`` (training) and ``eval_dataset`` (held
out; without one, ``eval_fraction`` of the dataset is held out, as the ``file`` task
does), read once at the start from the verifiers runner in verifiers' own Python (the
server the ``verifiers`` environment's episodes go to, when both name the same source). A
problem carries its row's place (``metadata["verifiers"]``: environment, split, index):
the ``verifiers`` environment runs that row as verifiers would (its prompt, answer, info),
so give both the same ``environment``. The prompt and answer here are the row's, as text,
for the run's logs. Training rows are visited in a fresh order every epoch, shuffled from
``(seed, epoch)``: the position in the data is two integers, and a resumed run continues
with exactly the rows it would have seen.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import Field

from forgerl.epochs import EpochCursor
from forgerl.errors import ConfigError
from forgerl.interfaces import Task
from forgerl.types import Problem
from forgerl_plugins.environments.verifiers_worker import VerifiersSource, check, where_searched, worker_for

#: Seeds the choice of held-out rows; fixed, so every run seed holds out the same rows.
EVAL_SEED = 20250101


class VerifiersTask(Task):
    name = "verifiers"
    description = "the dataset of a verifiers environment (run it with the verifiers environment)"

    class Options(VerifiersSource):
        eval_fraction: float = Field(
            0.1, ge=0, lt=1, description="Share of the dataset held out when the environment has no eval_dataset.",
        )

    @staticmethod
    def local_preflight(options: VerifiersTask.Options) -> None:
        check(options, "task verifiers", "task.options")

    def __init__(self, options: Options, *, seed: int = 0):
        self.options = options
        self.seed = int(seed)
        try:
            rows = worker_for(options).rows()  # the server the environment's episodes use: one load
        except RuntimeError as exc:
            hint = f" ({where_searched(options, 'task.options')})" if "does not load" in str(exc) else ""
            raise ConfigError(f"task verifiers: {exc}{hint}") from None
        train = self._problems(rows.get("train") or [], "train")
        if "eval" in rows:
            self._train, self._eval = train, self._problems(rows["eval"], "eval")
        else:
            self._train, self._eval = self._hold_out(train)
        if not self._train:
            raise ConfigError(f"task verifiers: {options.environment!r} has no dataset rows to train on")
        self.cursor = EpochCursor(len(self._train), self.seed, "verifiers")

    def _problems(self, rows: Sequence[Mapping[str, Any]], split: str) -> list[Problem]:
        env = self.options.environment
        return [
            Problem(
                id=f"{env}:{split}:{i}", prompt=list(row.get("prompt") or []), answer=str(row.get("answer", "")),
                metadata={"verifiers": {"environment": env, "split": split, "index": i}},
            )
            for i, row in enumerate(rows)
        ]

    def _hold_out(self, problems: list[Problem]) -> tuple[list[Problem], list[Problem]]:
        """``eval_fraction`` of the rows held out (at least one), the same ones for every seed."""
        if self.options.eval_fraction <= 0 or not problems:
            return problems, []
        k = max(1, int(len(problems) * self.options.eval_fraction))
        if k >= len(problems):
            raise ConfigError(
                f"task verifiers: {self.options.environment!r} has {len(problems)} row(s) and no eval_dataset, too few "
                f"to hold out eval_fraction={self.options.eval_fraction}; set eval_fraction: 0"
            )
        order = list(range(len(problems)))
        random.Random(f"verifiers:eval:{EVAL_SEED}").shuffle(order)
        held = set(order[:k])
        return ([p for i, p in enumerate(problems) if i not in held],
                [p for i, p in enumerate(problems) if i in held])

    def next_problems(self, n: int) -> list[Problem]:
        return [self._train[i] for i in self.cursor.take(n)]

    def eval_problems(self) -> list[Problem]:
        return list(self._eval)

    def state_dict(self) -> dict[str, Any]:
        c = self.cursor
        return {"epoch": c.epoch, "position": c.position, "seed": self.seed, "size": len(self._train)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "size" in state and int(state["size"]) != len(self._train):
            raise ConfigError(
                f"task verifiers: the saved state is for {state['size']} training rows, {self.options.environment!r} "
                f"now gives {len(self._train)}; its dataset changed since the checkpoint"
            )
        self.cursor.restore(state["epoch"], state["position"])
