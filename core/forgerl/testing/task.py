"""The Task kit: what a run relies on from a task, checked against one backend by name.

What it checks (each a test of :class:`TaskContract`):

- the backend builds through the registry, as its class, ``Class(options, *, seed=...)``, into a
  :class:`~forgerl.interfaces.Task`;
- ``next_problems(n)`` returns exactly ``n`` well-formed problems, also for ``n`` beyond
  one pass over the data (a task cycles): an ``id`` string, a prompt that is a non-empty
  string or a chat (a non-empty list of ``{"role", "content"}`` string dicts), a string
  ``answer`` and a mapping ``metadata``; each survives pickling unchanged (problems travel
  to the reward worker processes inside every sample);
- ``eval_problems()`` is the same well-formed list every call and for every instance built
  from the same options (evaluations of a run, and of a resumed run, compare);
- the training stream is deterministic given the seed: two instances built alike yield
  the same problems;
- a resumed run continues exactly: ``state_dict()`` is JSON-serialisable (checkpoints store
  it as JSON), does not itself move the stream (the run calls it after every batch), and a
  new instance that loads it (after a JSON round trip) yields what the original yields next.
- a task that gives demonstrations (overrides ``demonstration``, for supervised
  fine-tuning) gives, for problems of its stream, rows a run can train on: a string reply
  or assistant messages that continue the prompt (checked as a data file's row is,
  :func:`forgerl.sft.rows.parse_row`), or None; and not None for every one.

A subclass names the backend (``backend``), its options as a config holds them
(``options``; an autouse fixture of the subclass may set it per test, e.g. to a file under
``tmp_path``), the seed, and the plugins to load when it is not installed (``plugins``).
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from forgerl.testing.registry import backend_under_test

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.interfaces import Task
    from forgerl.types import Problem


class TaskContract:
    """Base class of a plugin's task conformance tests (see the module's docstring)."""

    #: The task's backend name, as a config names it.
    backend: ClassVar[str] = ""
    #: Its options, as a config's ``task.options`` holds them (plain data).
    options: Mapping[str, Any] = {}
    #: Plugin modules to load besides the installed ones (import paths).
    plugins: ClassVar[Sequence[str]] = ()
    #: The run seed the task is built with (``loop.seed``).
    seed: ClassVar[int] = 1234
    #: How many problems the kit asks for at once at most: enough to cycle through a small
    #: data set more than once.
    many: ClassVar[int] = 200

    def build(self, seed: int | None = None) -> Task:
        """A new instance, built as a run builds it."""
        record = backend_under_test("task", self.backend, self.plugins)
        return record.build(dict(self.options), seed=self.seed if seed is None else seed)

    # ------------------------------------------------------------------- tests

    def test_builds_a_task_through_the_registry(self) -> None:
        from forgerl.interfaces import Task

        task = self.build()
        assert isinstance(task, Task), f"task {self.backend!r} built a {type(task).__name__}, not a forgerl Task"

    def test_next_problems_returns_n_well_formed_problems(self) -> None:
        task = self.build()
        for n in (1, 3, self.many):
            problems = task.next_problems(n)
            assert isinstance(problems, list), f"next_problems({n}) returned a {type(problems).__name__}, not a list"
            assert len(problems) == n, f"next_problems({n}) returned {len(problems)} problems"
            check_problems(problems, f"next_problems({n})")

    def test_eval_problems_are_the_same_every_call(self) -> None:
        task = self.build()
        first = task.eval_problems()
        assert isinstance(first, list), f"eval_problems() returned a {type(first).__name__}, not a list"
        check_problems(first, "eval_problems()")
        task.next_problems(5)
        assert task.eval_problems() == first, "eval_problems() changed after next_problems()"
        again = self.build().eval_problems()
        assert again == first, "eval_problems() differs between two instances built from the same options"

    def test_training_stream_is_deterministic_given_the_seed(self) -> None:
        a, b = self.build(), self.build()
        for n in (4, 7):
            got_a, got_b = a.next_problems(n), b.next_problems(n)
            assert got_a == got_b, (
                f"two instances built with seed {self.seed} yield different problems: "
                f"{_ids(got_a)} vs {_ids(got_b)}"
            )

    def test_resumes_exactly_from_its_state(self) -> None:
        for drawn in (0, 3, self.many + 1):
            task = self.build()
            if drawn:
                task.next_problems(drawn)
            state = task.state_dict()
            try:
                saved = json.loads(json.dumps(state))
            except (TypeError, ValueError) as exc:
                raise AssertionError(
                    f"state_dict() is not JSON-serialisable ({exc}): a checkpoint cannot store {state!r:.200}"
                ) from None
            assert task.state_dict() == state, "state_dict() changed without drawing problems"
            following = task.next_problems(5)
            resumed = self.build()
            resumed.load_state_dict(saved)
            got = resumed.next_problems(5)
            assert got == following, (
                f"after {drawn} problems, a new instance that loaded state_dict() {state!r:.200} yields "
                f"{_ids(got)}, the original {_ids(following)}"
            )

    def test_demonstrations_are_rows_a_run_can_train_on(self) -> None:
        from forgerl.errors import ConfigError
        from forgerl.sft.rows import parse_row

        task = self.build()
        if not type(task).gives_demonstrations():
            return  # the optional part of the interface: nothing to check
        given = 0
        for p in task.next_problems(20):
            answer = task.demonstration(p)
            if answer is None:
                continue
            assert isinstance(answer, (str, list)), (
                f"demonstration({p.id!r}) returned a {type(answer).__name__}: a string, a list of messages or None"
            )
            try:
                parse_row({"prompt": p.prompt, "completion": answer}, f"demonstration({p.id!r})")
            except ConfigError as exc:
                raise AssertionError(f"a run cannot train on it: {exc}") from None
            given += 1
        assert given, "demonstration() returned None for 20 problems of the stream: a run would find nothing to train on"


def check_problems(problems: Sequence[Any], where: str) -> None:
    """Fail naming the first problem of ``problems`` that a run could not use."""
    from forgerl.types import Problem

    for i, p in enumerate(problems):
        what = f"{where}[{i}]"
        assert isinstance(p, Problem), f"{what} is a {type(p).__name__}, not a forgerl.types.Problem"
        assert isinstance(p.id, str) and p.id, f"{what}.id must be a non-empty string, got {p.id!r}"
        check_prompt(p, what)
        assert isinstance(p.answer, str), f"{what}.answer must be a string, got {type(p.answer).__name__}"
        assert isinstance(p.metadata, Mapping), f"{what}.metadata must be a mapping, got {type(p.metadata).__name__}"
        try:
            copy = pickle.loads(pickle.dumps(p))
        except Exception as exc:  # noqa: BLE001 - any failure to pickle
            raise AssertionError(
                f"{what} cannot be pickled ({type(exc).__name__}: {exc}): samples carry problems to the "
                "reward worker processes"
            ) from None
        assert copy == p, f"{what} is not the same after pickling: {copy!r:.200} vs {p!r:.200}"


def check_prompt(p: Problem, what: str) -> None:
    if isinstance(p.prompt, str):
        assert p.prompt, f"{what}.prompt is an empty string"
        return
    assert isinstance(p.prompt, list) and p.prompt, (
        f"{what}.prompt must be a string or a non-empty list of chat messages, got {p.prompt!r:.100}"
    )
    for m in p.prompt:
        ok = (
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
        )
        assert ok, f"{what}.prompt has a message that is not a {{'role': str, 'content': str}} dict: {m!r:.100}"


def _ids(problems: Sequence[Any]) -> list[str]:
    return [getattr(p, "id", repr(p)) for p in problems][:8]
