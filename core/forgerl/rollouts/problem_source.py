"""Where the rollout producers take prompts from: the task, after any problems a checkpoint
handed back.

Under ``loop.overlap: continuous`` a checkpoint falls between batches with prompt groups
drawn from the task but not yet in a finished batch (generating, being scored, waiting
for the rest of their batch). They are not sampled again from the task after a resume,
nor skipped: the checkpoint's task state carries them under :data:`REQUEUED` (as JSON,
like a pending batch's problems), and the resumed run draws them first, in their order,
before it asks the task for more. A task never sees that key: :func:`split` takes it out
before :meth:`Task.load_state_dict`. A run that never had such problems saves its task's
state exactly as before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from forgerl.interfaces import Task
from forgerl.types import Problem

#: The key of a task state under which a checkpoint keeps its drawn-but-unbatched problems.
REQUEUED = "forgerl/requeued_problems"


class ProblemSource:
    """``ProblemSource(task, requeued)``: :meth:`next_problems` gives ``requeued`` first,
    then the task's. Used by one producer thread at a time."""

    def __init__(self, task: Task, requeued: Sequence[Problem] = ()) -> None:
        self.task = task
        self.requeued = list(requeued)

    def next_problems(self, n: int) -> list[Problem]:
        out = self.requeued[:n]
        del self.requeued[:n]
        if len(out) < n:
            out += self.task.next_problems(n - len(out))
        return out

    def state_dict(self, unbatched: Sequence[Problem] = ()) -> dict[str, Any]:
        """The task's state, with ``unbatched`` (drawn problems not yet in a batch) and the
        requeued problems not drawn yet under :data:`REQUEUED`, where there are any."""
        return with_requeued(self.task.state_dict(), [*unbatched, *self.requeued])


def with_requeued(task_state: Mapping[str, Any], problems: Sequence[Problem]) -> dict[str, Any]:
    """``task_state`` with ``problems`` to draw first after a resume (none: unchanged)."""
    state = {k: v for k, v in task_state.items() if k != REQUEUED}
    if problems:
        state[REQUEUED] = [_encode(p) for p in problems]
    return state


def split(state: Mapping[str, Any]) -> tuple[dict[str, Any], list[Problem]]:
    """A saved task state → (the task's own state, the problems to draw first). Raises
    ValueError, naming the entry, where the problems are not in the layout saved."""
    task_state = {k: v for k, v in state.items() if k != REQUEUED}
    raw = state.get(REQUEUED, [])
    if not isinstance(raw, list):
        raise ValueError(f"task_state[{REQUEUED!r}] must be a list, got {type(raw).__name__}")
    return task_state, [_decode(p, i) for i, p in enumerate(raw)]


def _encode(p: Problem) -> dict[str, Any]:
    return {"id": p.id, "prompt": p.prompt, "answer": p.answer, "metadata": dict(p.metadata)}


def _decode(raw: Any, index: int) -> Problem:
    from pydantic import ValidationError

    from forgerl.rundirs.checkpoint_layout import ProblemState, first_problem

    try:
        p = ProblemState.model_validate(raw)
    except ValidationError as exc:
        raise ValueError(f"task_state[{REQUEUED!r}][{index}]: {first_problem(exc)}") from None
    return Problem(id=p.id, prompt=p.prompt, answer=p.answer, metadata=p.metadata)
