"""Where a supervised run's demonstrations come from, in a resumable order.

- Files (``sft.data``): every row is read, checked (:mod:`forgerl.sft.rows`) and rendered
  (:mod:`forgerl.sft.render`) when the run starts, so a bad row stops it before its first
  step; the run then takes ``sft.batch_size`` examples a step, epoch after epoch, each
  epoch in a fresh order drawn from ``(seed, epoch)`` (:class:`forgerl.epochs.EpochCursor`):
  the position is two integers and a resumed run takes exactly the examples it would have.
- A task (``sft.task_demonstrations``): problems drawn from the task's training stream,
  each with the task's worked answer (:meth:`forgerl.interfaces.Task.demonstration`); the
  position is the task's own state.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from forgerl.epochs import EpochCursor
from forgerl.sft.files import check_file, read_rows
from forgerl.sft.render import Example, Renderer
from forgerl.sft.rows import DataError, Demonstration, parse_row

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.configuration.sft import SFTConfig
    from forgerl.interfaces import Task

log = logging.getLogger("forgerl.sft")

#: The pre-flight check reads files up to this size whole; of larger ones the first rows.
PREFLIGHT_READ_WHOLE_BYTES = 64 * 2**20
PREFLIGHT_ROWS = 1000
#: Problems a task may fail to demonstrate in a row before the run says it gives none.
MAX_SKIPPED = 1000


class Demonstrations(Protocol):
    """A resumable stream of rendered examples."""

    #: How many demonstrations were kept, truncated or left out so far (by outcome).
    outcomes: Counter[str]

    def take(self, n: int) -> list[Example]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...

    def progress(self) -> dict[str, float]:
        """Metrics of where the stream is (``sft/epoch``)."""
        ...


# --------------------------------------------------------------------------- files


def file_demonstrations(config: SFTConfig) -> Iterable[Demonstration]:
    """Every row of ``config.data``'s files, checked, in file order."""
    for name in config.data:
        for where, row in read_rows(Path(name)):
            yield parse_row(row, where, config.format)


def check_files(config: SFTConfig) -> None:
    """What ``forge run`` checks before anything is created: the files exist and are
    readable, and their rows are demonstrations (every row of files up to 64 MiB together,
    else each file's first rows; the rest is checked when the run starts)."""
    paths = [Path(name) for name in config.data]
    whole = sum(check_file(p) for p in paths) <= PREFLIGHT_READ_WHOLE_BYTES
    for path in paths:
        for where, row in read_rows(path, limit=None if whole else PREFLIGHT_ROWS):
            parse_row(row, where, config.format)


class FileExamples:
    """The rendered examples of the data files, in epochs."""

    def __init__(
        self, examples: list[Example], *, seed: int, shuffle: bool, outcomes: Counter[str] | None = None
    ) -> None:
        if not examples:
            raise DataError("sft.data: no demonstration is left to train on (every one was left out; see the log)")
        self.examples = examples
        self.seed = seed
        self.outcomes = outcomes if outcomes is not None else Counter({"kept": len(examples)})
        self.cursor = EpochCursor(len(examples), seed, "sft") if shuffle else _InOrder(len(examples))

    def take(self, n: int) -> list[Example]:
        return [self.examples[i] for i in self.cursor.take(n)]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.cursor.epoch, "position": self.cursor.position, "size": len(self.examples),
                "seed": self.seed}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if int(state.get("size", -1)) != len(self.examples) or int(state.get("seed", -1)) != self.seed:
            # Another set of rows (a file changed) makes the saved position meaningless.
            raise DataError(
                f"sft.data: the checkpoint was made with {state.get('size')} examples (seed {state.get('seed')}), the "
                f"files now give {len(self.examples)} (seed {self.seed}): the data changed since the checkpoint"
            )
        self.cursor.restore(int(state["epoch"]), int(state["position"]))

    def progress(self) -> dict[str, float]:
        return {"sft/epoch": self.cursor.epoch + self.cursor.position / len(self.examples)}


class _InOrder:
    """:class:`EpochCursor`'s interface, in file order every epoch (``sft.shuffle: false``)."""

    def __init__(self, size: int) -> None:
        self.size, self.epoch, self.position = size, 0, 0

    def take(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            if self.position >= self.size:
                self.epoch, self.position = self.epoch + 1, 0
            out.append(self.position)
            self.position += 1
        return out

    def restore(self, epoch: int, position: int) -> None:
        self.epoch, self.position = epoch, position


def render_all(demos: Iterable[Demonstration], renderer: Renderer) -> tuple[list[Example], Counter[str]]:
    """The examples of ``demos`` and how many of them were kept, truncated or left out."""
    examples: list[Example] = []
    outcomes: Counter[str] = Counter()
    for demo in demos:
        rendered = renderer.render(demo)
        outcomes[rendered.outcome] += 1
        if rendered.example is not None:
            examples.append(rendered.example)
        elif outcomes[rendered.outcome] <= 3:
            log.warning("%s: left out (%s)", demo.where, rendered.outcome.replace("_", " "))
    return examples, outcomes


# --------------------------------------------------------------------------- a task


class TaskExamples:
    """Worked answers of ``task`` to the problems of its training stream."""

    def __init__(self, task: Task, renderer: Renderer, name: str) -> None:
        self.task = task
        self.renderer = renderer
        self.name = name
        self.outcomes: Counter[str] = Counter()

    def take(self, n: int) -> list[Example]:
        out: list[Example] = []
        skipped = 0
        while len(out) < n:
            for problem in self.task.next_problems(n - len(out)):
                answer = self.task.demonstration(problem)
                example = None
                if answer is not None:
                    row = {"prompt": problem.prompt, "completion": answer}
                    rendered = self.renderer.render(parse_row(row, f"task {self.name} problem {problem.id}"))
                    self.outcomes[rendered.outcome] += 1
                    example = rendered.example
                if example is None:
                    skipped += 1
                    if skipped > MAX_SKIPPED:
                        raise DataError(
                            f"task {self.name}: no demonstration for {MAX_SKIPPED} problems in a row (its "
                            "demonstration() returns None, or every one is longer than sft.max_length)"
                        )
                    continue
                skipped = 0
                out.append(example)
        return out

    def state_dict(self) -> dict[str, Any]:
        return dict(self.task.state_dict())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.task.load_state_dict(state)

    def progress(self) -> dict[str, float]:
        return {}
