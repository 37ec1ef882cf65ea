"""The Environment kit: what a run relies on from an environment, checked against one
backend by name (docs/plugins-environment.md states every check and its message).

Every instance is built as a run builds it (``build_registry().require("environment",
name).build(options)``: ``Cls(options)``, one per trajectory) and every call (init,
``reset``, ``step``, ``close``) runs as the run runs it: on a worker thread under the
deadline ``turn_timeout_s``, its answer checked with the run's own checks
(:func:`forgerl.rollouts.trajectory.check_messages`, :func:`~forgerl.rollouts.trajectory.check_step`). What
it checks (each a test of :class:`EnvironmentContract`):

- registration: the name finds a record whose factory is an
  :class:`~forgerl.environment.Environment` subclass (of that ``name``, when the class
  names itself; the run reads ``scores`` and the tools from the class), with a bool
  ``scores``, and it builds;
- options: the subclass's ``options`` validate and survive the run's round trip (dumped
  to JSON when the config is resolved, validated again); an unknown key is refused with a
  pydantic ``ValidationError`` naming it;
- ``reset`` returns, for every problem of ``problems()``, a non-empty list of messages
  with a role in system/user/assistant/tool and a string content of at most 100,000
  characters;
- ``step`` returns a :class:`~forgerl.environment.Step` (observations or done, a finite
  reward and components) for each of the plugin's ``turns`` and a plain call of each tool,
  played as trajectories of up to ``max_turns`` turns;
- tools: their JSON schemas derive from the signatures (:func:`forgerl.environment.tool_schemas`),
  are JSON, and each has a description;
- a scoring environment (``scores = True``) ends a trajectory with a finite reward, and
  at least one of those trajectories ends within ``max_turns``; ``known_rewards`` hold;
- a fresh instance per trajectory: with every trajectory in flight at once (each call on
  a worker thread, as a run's), no mutable object is reachable from two instances (their
  object graphs walked to any depth: :mod:`forgerl.testing.environment_state`; the
  options, the problems and the kit's ``shared`` paths left out); playing trajectories
  changes no class attribute of the class, nor of the objects its instances hold, nor the
  shared options, nor the problems; and (when ``deterministic``) a trajectory plays the
  same on a fresh instance after other trajectories, and with all the others in flight;
- the process-global random generators (``random``; numpy's, when imported) are neither
  reseeded nor drawn from;
- ``close`` returns on an instance never reset, after reset and after a whole trajectory,
  and leaves no thread nor child process that the instances started;
- hostile model text (the Reward kit's battery of texts, and garbage tool calls: not
  JSON, unterminated, unknown tools, methods that are not tools, wrong or hostile
  arguments, over-long calls, 20 calls in a turn) is answered with a valid Step, and the
  trajectory goes on: a plugin turn after it is answered too;
- the trajectories run in the run's own trajectory runner (a scripted generator writes
  the turns; the chat template renders the messages and tool schemas, the kit's ChatML by
  default, or the tokenizer of the ``tokenizer`` folder): none fails.

The kit never imports torch; its tokenizer needs ``tokenizers`` and ``transformers``.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import pytest

from forgerl.testing.environment_support import (
    UNKNOWN,
    Played,
    ScriptedGenerator,
    Trajectory,
    hostile_turns,
    kit_tokenizer,
    play,
    step_turns,
)
from forgerl.testing.registry import backend_under_test
from forgerl.testing.timing import scaled

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.backends import Backend
    from forgerl.environment import Environment
    from forgerl.types import Problem

__all__ = ["EnvironmentContract"]

class EnvironmentContract:
    """Base class of a plugin's environment conformance tests (see the module's docstring)."""

    #: The environment's backend name, as ``environment.name`` in a config.
    backend: ClassVar[str] = ""
    #: Its options, as ``environment.options`` holds them (plain data).
    options: ClassVar[Mapping[str, Any]] = {}
    #: Plugin modules to load besides the installed ones (import paths).
    plugins: ClassVar[Sequence[str]] = ()
    #: Assistant turns the environment is meant to receive (a right answer, a tool call).
    turns: ClassVar[Sequence[str]] = ("<answer>42</answer>", "The answer is 4.", "I do not know.")
    #: (problem, assistant turns, reward) triples: played from reset, the trajectory must
    #: end within the turns given, with that reward.
    known_rewards: ClassVar[Sequence[tuple[Problem, Sequence[str], float]]] = ()
    #: Whether a problem and the same turns play the same on every instance. False skips
    #: that comparison (the other checks for state shared between instances still run).
    deterministic: ClassVar[bool] = True
    #: Assistant turns per trajectory (the run's ``environment.max_turns``).
    max_turns: ClassVar[int] = 4
    #: Seconds (scaled) each call may take (the run's ``environment.turn_timeout``).
    turn_timeout_s: ClassVar[float] = 10.0
    #: Seconds (scaled) the threads and processes an instance started get to end after close.
    cleanup_wait_s: ClassVar[float] = 10.0
    #: Attributes of an instance (dotted paths: ``"sandbox"``, ``"engine.pool"``) that hold
    #: what every instance shares by design (a process-wide pool or cache): the state-leak
    #: check does not look inside them. Making them safe for trajectories in flight is yours.
    shared: ClassVar[Sequence[str]] = ()
    #: A Hugging Face model folder whose tokenizer's chat template renders the
    #: trajectories in the runner check (your model's); None: the kit's ChatML.
    tokenizer: ClassVar[str | None] = None

    # ------------------------------------------------------------- overridable

    def problems(self) -> list[Problem]:
        """The problems reset is given: one of the built-in ``arithmetic`` task's shape (a
        chat prompt, operands in the metadata) and a plain-text one. Override for an
        environment meant for its own task's problems."""
        from forgerl.types import Problem

        return [
            Problem(
                id="kit/arithmetic",
                prompt=[{"role": "user", "content": "What is 17 + 25? Give the final answer inside <answer></answer>."}],
                answer="42",
                metadata={"a": 17, "b": 25, "op": "+", "answer_type": "integer"},
            ),
            Problem(id="kit/plain", prompt="What is 2 + 2?", answer="4"),
        ]

    # ----------------------------------------------------------------- helpers

    def record(self) -> Backend:
        return backend_under_test("environment", self.backend, self.plugins)

    def env_class(self) -> type[Environment]:
        return self.record().load_factory()  # type: ignore[return-value]  # checked by the first test

    def make_env(self, options: Any = None) -> Any:
        """A factory of new instances, built as the run builds them: every instance from
        the same validated ``options`` (by default the subclass's ``options``, validated)."""
        record = self.record()
        if options is None:
            options = record.validate_options(dict(self.options))
        return lambda: record.build(options)

    def timeout(self) -> float:
        return scaled(self.turn_timeout_s)

    def schemas(self) -> list[dict[str, Any]]:
        from forgerl.environment import tool_schemas

        return tool_schemas(self.env_class())

    def play_all(self, scripts: Mapping[str, Sequence[str]], make_env: Any = None) -> list[Played]:
        """Every script on every problem, each on a new instance."""
        make = make_env or self.make_env()

        async def run() -> list[Played]:
            return [
                await play(make, p, label, texts, max_turns=self.max_turns, timeout=self.timeout())
                for p in self.problems()
                for label, texts in scripts.items()
            ]

        return asyncio.run(run())

    def scripts(self) -> dict[str, list[str]]:
        return step_turns(list(self.turns), self.schemas())

    # ------------------------------------------------------------------- tests

    def test_builds_an_environment_through_the_registry(self) -> None:
        from forgerl.environment import Environment

        cls = self.record().load_factory()
        assert isinstance(cls, type) and issubclass(cls, Environment), (
            f"environment {self.backend!r} is registered with the factory {cls!r}, not an Environment "
            "subclass: the run reads `scores` and the tools from the class (register the class)"
        )
        own = cls.__dict__.get("name", self.backend)  # a record written by hand names it instead
        assert own == self.backend, f"{cls.__qualname__}.name is {own!r}, but it is selected as {self.backend!r}"
        assert isinstance(cls.scores, bool), f"{cls.__qualname__}.scores must be a bool, got {cls.scores!r}"

        async def build() -> Any:
            t = Trajectory(self.make_env(), self.problems()[0], "build", self.timeout())
            t.env = await t.call(t.make_env, what="environment init")
            await t.close()
            return t.env

        env = asyncio.run(build())
        assert isinstance(env, cls), f"building {self.backend!r} gave a {type(env).__name__}, not a {cls.__name__}"

    def test_options_refuse_unknown_keys(self) -> None:
        from pydantic import ValidationError

        from forgerl.configuration.config import format_validation_error

        record = self.record()
        try:
            options = record.validate_options(dict(self.options))
        except ValidationError as exc:
            raise AssertionError(
                f"the kit's options {dict(self.options)!r} do not validate: "
                f"{format_validation_error(exc, 'environment.options')}"
            ) from None
        dumped = options.model_dump(mode="json")
        again = record.validate_options(json.loads(json.dumps(dumped)))
        assert again == options, (
            f"the options do not survive the run's round trip (dumped to JSON when the config is resolved, "
            f"validated again): {options!r} became {again!r}"
        )
        try:
            record.validate_options({**dict(self.options), UNKNOWN: 1})
        except ValidationError as exc:
            message = format_validation_error(exc, "environment.options")
            assert f"environment.options.{UNKNOWN}" in message, (
                f"refusing the unknown key {UNKNOWN!r}, the error does not name it: {message}"
            )
            return
        except Exception as exc:  # noqa: BLE001 - the run turns only ValidationError into one line
            raise AssertionError(
                f"an unknown key {UNKNOWN!r} raised {type(exc).__name__}: {exc}, not a pydantic ValidationError "
                "naming it (a run would end with a traceback instead of one line)"
            ) from None
        raise AssertionError(
            f"the options model {record.options_model.__name__} accepted the unknown key {UNKNOWN!r}: it must "
            "refuse unknown keys (subclass forgerl.options.OptionsModel, or set extra='forbid'), or a typo in a "
            "config is silently ignored"
        )

    def test_reset_returns_valid_messages(self) -> None:
        make = self.make_env()

        async def resets() -> list[Played]:
            out = []
            for p in self.problems():
                t = Trajectory(make, p, "reset", self.timeout())
                await t.start()
                await t.close()
                out.append(t.played)
            return out

        played = asyncio.run(resets())
        bad = [f"{p.where()}: {p.failure}" for p in played if p.failure]
        assert not bad, "reset did not return valid messages; the run would fail these trajectories:\n  " + "\n  ".join(bad)

    def test_step_returns_a_step(self) -> None:
        played = self.play_all(self.scripts())
        bad = [f"{p.where()}: {p.failure}" for p in played if p.failure]
        assert not bad, "step did not return a valid Step; the run would fail these trajectories:\n  " + "\n  ".join(
            bad[:20]
        )

    def test_tools_have_schemas_a_model_can_read(self) -> None:
        cls = self.env_class()
        try:
            schemas = self.schemas()
        except TypeError as exc:
            raise AssertionError(f"the tool schemas of {cls.__qualname__} cannot be derived: {exc}") from None
        for schema in schemas:
            name = schema["function"]["name"]
            try:
                json.dumps(schema)
            except (TypeError, ValueError) as exc:
                raise AssertionError(f"tool {name!r}: its schema is not JSON ({exc}): {schema!r:.300}") from None
            assert schema["function"]["description"], (
                f"tool {name!r} has no description: give it a docstring whose first paragraph says what it does "
                "(the model reads it)"
            )

    def test_scoring_environment_ends_with_a_finite_reward(self) -> None:
        cls = self.env_class()
        if not cls.scores:
            pytest.skip(f"{cls.__qualname__}.scores is False: the run's Reward plugins score its trajectories")
        played = [p for p in self.play_all(self.scripts()) if p.failure is None]
        ended = [p for p in played if p.ended is not None]
        unscored = [f"{p.where()}" for p in ended if p.ended is not None and p.ended.reward is None]
        assert not unscored, (
            f"{cls.__qualname__} sets scores = True but ended these trajectories with reward None (a scoring "
            "environment gives the reward when it ends a trajectory):\n  " + "\n  ".join(unscored[:20])
        )
        assert ended, (
            f"no trajectory ended within {self.max_turns} turns, so no reward was given: add `turns` that end "
            "one (a right answer), or check that step returns Step.finish(reward) at the end"
        )

    def test_known_rewards(self) -> None:
        wrong = []
        for problem, texts, want in self.known_rewards:
            p = asyncio.run(play(self.make_env(), problem, f"turns {list(texts)!r:.80}", list(texts),
                                 max_turns=len(texts), timeout=self.timeout()))
            got = p.ended.reward if p.ended is not None else None
            if p.failure or got is None or not math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12):
                what = p.failure or ("did not end" if p.ended is None else f"ended with reward {got}")
                wrong.append(f"{p.where()}: {what}, expected {want}")
        assert not wrong, f"environment {self.backend!r} gave other rewards than known:\n  " + "\n  ".join(wrong)

    def test_no_state_leaks_between_instances(self) -> None:
        from forgerl.testing.environment_state import fingerprint, shared_between

        cls = self.env_class()
        options = self.record().validate_options(dict(self.options))
        make = self.make_env(options)
        problems, scripts = self.problems(), self.scripts()
        options_before, problems_before = _dump(options), [_dump(p) for p in problems]
        attributes_before = _class_attributes(cls)
        # Every trajectory at once, as a run has `environment.concurrency` of them in flight:
        # the live instances' object graphs are walked before they are closed.
        together, reaches = asyncio.run(self._all_at_once(make, options, problems, scripts))
        class_level = {k: v for reach in reaches for k, v in reach.class_level.items()}
        class_level_before = {k: fingerprint(obj) for k, (_, obj) in class_level.items()}
        first = self.play_all(scripts, make)  # each on a fresh instance, one after another
        changed = [k for k, v in _class_attributes(cls).items() if attributes_before.get(k) != v]
        changed += [class_level[k][0] for k, v in class_level_before.items() if fingerprint(class_level[k][1]) != v]
        assert not changed, (
            f"playing trajectories changed class attributes of {cls.__qualname__} or of the objects its instances "
            f"hold: {', '.join(changed)}; class attributes are shared by every instance (one per trajectory): keep "
            "trajectory state on self (a library class with such a mutable default: give each instance its own copy)"
        )
        assert _dump(options) == options_before, (
            f"playing trajectories changed the options every instance shares: {options_before} became {_dump(options)}"
        )
        changed_problems = [p.id for p, before in zip(problems, problems_before) if _dump(p) != before]
        assert not changed_problems, (
            f"playing trajectories changed the problems given to reset: {changed_problems}; a run gives the same "
            "problem to every trajectory of its group: copy what you change"
        )
        shared = shared_between(reaches)
        assert not shared, (
            f"instances of {cls.__qualname__} share mutable objects: what one trajectory puts there, the others "
            "see (make them in __init__ or reset; name a part shared by design in the kit's `shared`):\n  "
            + "\n  ".join(shared[:20])
        )
        if not self.deterministic:
            return
        again = self.play_all(scripts, make)
        differ = [f"{x.where()}" for x, y in zip(first, again) if x.record() != y.record()]
        assert not differ, (
            "the same problem and turns played differently on a fresh instance after other trajectories "
            "(state leaks between instances; or set deterministic = False):\n  " + "\n  ".join(differ[:10])
        )
        alone = {(p.problem_id, p.label): p for p in first}
        differ = [x.where() for x in together if x.record() != alone[(x.problem_id, x.label)].record()]
        assert not differ, (
            f"{len(together)} trajectories played at the same time (as a run plays them, each call on a worker "
            "thread) differ from each played alone:\n  " + "\n  ".join(differ[:10])
        )

    def test_leaves_the_global_random_state_alone(self) -> None:
        from forgerl.testing.environment_state import global_random_state

        before = global_random_state()
        self.play_all(self.scripts())
        after = global_random_state()
        changed = [name for name in before if before[name] != after.get(name)]
        assert not changed, (
            f"playing trajectories changed the state of the process-global random generator ({', '.join(changed)}): "
            "the environment, or a library it calls, seeds it or draws from it; one generator serves every "
            "trajectory in flight, so each trajectory's draws depend on the others (and a reseed on reset replays "
            "another's). Give each instance its own random.Random(seed) (numpy: numpy.random.default_rng(seed))"
        )

    async def _all_at_once(
        self, make: Any, options: Any, problems: Sequence[Problem], scripts: Mapping[str, Sequence[str]]
    ) -> tuple[list[Played], list[Any]]:
        """Every script on every problem, on instances alive at once: all reset together,
        then each turn of all together (each call on its own worker thread, as a run's),
        then their object graphs walked (:func:`forgerl.testing.environment_state.walk`),
        then all closed."""
        from forgerl.testing.environment_state import walk

        ts = [Trajectory(make, p, label, self.timeout()) for p in problems for label in scripts]
        try:
            started = await asyncio.gather(*(t.start() for t in ts))
            live = [t for t, ok in zip(ts, started) if ok]
            for turn in range(self.max_turns):
                texts = [scripts[t.played.label] for t in live]
                steps = await asyncio.gather(*(t.step(x[min(turn, len(x) - 1)]) for t, x in zip(live, texts)))
                live = [t for t, step in zip(live, steps) if step is not None and not step.done]
            skip = [options, *problems]
            reaches = [walk(t.env, skip=skip, skip_paths=self.shared) for t in ts if t.env is not None]
        finally:
            await asyncio.gather(*(t.close() for t in ts))
        return [t.played for t in ts], reaches

    def test_close_releases_what_the_instance_holds(self) -> None:
        from forgerl.testing.generator_support import child_processes, command_line, processes_left
        from forgerl.testing.transport_support import threads_left

        threads_before, children_before = set(threading.enumerate()), child_processes()
        make, problem = self.make_env(), self.problems()[0]

        async def cases() -> list[Played]:
            never = Trajectory(make, problem, "an instance never reset", self.timeout())
            try:
                never.env = await never.call(make, what="environment init")
            finally:
                await never.close()
            after_reset = Trajectory(make, problem, "an instance after reset", self.timeout())
            try:
                await after_reset.start()
            finally:
                await after_reset.close()
            whole = [
                await play(make, problem, f"after a whole trajectory ({label})", texts,
                           max_turns=self.max_turns, timeout=self.timeout())
                for label, texts in self.scripts().items()
            ]
            return [never.played, after_reset.played, *whole]

        played = asyncio.run(cases())
        bad = [f"{p.label}: {p.close_error}" for p in played if p.close_error]
        assert not bad, "close() failed (the run calls it on every instance it built):\n  " + "\n  ".join(bad)
        stacks = threads_left(threads_before, self.cleanup_wait_s)
        assert not stacks, f"threads the environment started still run after close():\n{stacks}"
        left = processes_left(children_before, self.cleanup_wait_s)
        assert not left, "processes the environment started still run after close(): " + "; ".join(
            f"{pid}: {command_line(pid)}" for pid in sorted(left)
        )

    def test_hostile_model_text_is_answered(self) -> None:
        hostile = hostile_turns(self.schemas())
        follow = self.turns[0] if self.turns else "ok"
        scripts = {f"{label}, then {follow[:30]!r}": [text, follow] for label, text in hostile.items()}
        played = self.play_all(scripts)
        bad = [f"{p.where()}: {p.failure}" for p in played if p.failure]
        assert not bad, (
            "hostile model text was not answered with a valid Step; the run would fail these trajectories "
            "(a model being trained writes all of this):\n  " + "\n  ".join(bad[:20])
        )

    def test_trajectories_run_in_the_runs_trajectory_runner(self) -> None:
        from forgerl.rollouts.trajectory import Limits, TrajectoryRunner
        from forgerl.types import SamplingParams

        cls, make = self.env_class(), self.make_env()
        tokenizer = kit_tokenizer(self.tokenizer)
        scripts = self.scripts()
        jobs, labels = [], {}
        for i, problem in enumerate(self.problems()):
            for j, (label, texts) in enumerate(scripts.items()):
                job = f"kit{i}x{j}"
                jobs.append((problem, job, 0))
                labels[job] = (problem.id, label, texts)
        generator = ScriptedGenerator(tokenizer, {job: texts for job, (_, _, texts) in labels.items()})
        limits = Limits(max_turns=self.max_turns, max_total_tokens=1_000_000, max_turn_tokens=100_000,
                        turn_timeout=self.timeout(), concurrency=8)
        runner = TrajectoryRunner(make, cls, tokenizer, limits, SamplingParams(max_tokens=100_000))
        trajectories, _ = asyncio.run(runner.run_many(generator, jobs))
        bad = [
            f"problem {labels[job][0]!r}, {labels[job][1]}: {t.failure} (env/failed_{t.failure_kind})"
            for (_, job, _), t in zip(jobs, trajectories)
            if t.failure is not None
        ]
        assert not bad, "in the run's trajectory runner these trajectories failed:\n  " + "\n  ".join(bad[:20])
        if cls.scores:
            unscored = [labels[job][1] for (_, job, _), t in zip(jobs, trajectories) if t.reward is None]
            assert not unscored, f"scores = True, yet the runner got no reward for: {unscored[:10]}"


def _dump(options: Any) -> str:
    dump = getattr(options, "model_dump", None)
    return json.dumps(dump(mode="json") if dump else repr(options), sort_keys=True, default=repr)


def _class_attributes(cls: type) -> dict[str, str]:
    """repr of the data attributes of ``cls`` and its bases up to Environment: what a
    trajectory must not change (methods, nested classes and descriptors are left out)."""
    from forgerl.environment import Environment

    out = {}
    for klass in cls.__mro__:
        if klass in (Environment, object):
            break
        for name, value in vars(klass).items():
            if name.startswith("__") or callable(value) or isinstance(value, (classmethod, staticmethod, property)):
                continue
            out[f"{klass.__qualname__}.{name}"] = repr(value)[:100_000]
    return out
