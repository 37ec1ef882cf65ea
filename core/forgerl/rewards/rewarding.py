"""The scoring engine: runs the configured rewards over finished samples.

Every (sample, reward) pair is scored concurrently under ``loop.reward_timeout``. A reward
that raises, times out, crashes its process or returns something that is not a finite
number scores ``loop.failed_reward`` for its component; the sample is marked failed with
the reason and the run goes on: :meth:`RewardSet.score` never raises because of a reward.

Where each reward runs:

- Blocking rewards built from the registry (:meth:`RewardSet.from_config`) run in a pool
  of worker processes (:mod:`forgerl.rewards.reward_workers`), which build their own copies by
  backend name and options. A sample that outlives the timeout gets its worker SIGKILLed
  and replaced, so a reward stuck in C with the GIL held cannot stall the trainer.
- Rewards that override :meth:`Reward.ascore` run on the event loop and must not block it.
- Blocking reward *instances* handed to :class:`RewardSet` directly (embedding, tests)
  cannot be rebuilt in another process: they run on daemon threads here, at most
  ``max_workers`` at a time. A thread cannot be stopped: one that times out is abandoned
  (it only costs its stack), and one that holds the GIL stalls this process. Register such
  a reward as a backend to get the process isolation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from forgerl.errors import ConfigError, RewardError
from forgerl.interfaces import Reward
from forgerl.rewards.reward_workers import (
    Outcome,
    RewardRecipe,
    RewardWorkerPool,
    default_pool_size,
    outcome_of,
)
from forgerl.types import RewardInput, RewardResult, reserved_component_error, source_of

log = logging.getLogger("forgerl.rewards")

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.configuration.config import RunConfig
    from forgerl.registry.plugins import Registry


@dataclass(frozen=True)
class NamedReward:
    """One configured reward: its component name, its weight in the total, the instance,
    and how a worker process builds its own copy (None: it runs in this process)."""

    name: str
    weight: float
    reward: Reward
    recipe: RewardRecipe | None = None
    #: The mixture sources whose problems it scores (None: every problem).
    sources: frozenset[str] | None = None

    def scores(self, source: str | None) -> bool:
        """Whether it scores a problem of ``source`` (a problem of no source: every reward)."""
        return self.sources is None or source is None or source in self.sources


class RewardSet:
    """The weighted sum of several rewards, scored concurrently and failure-proof.

    The result of each sample is a :class:`RewardResult` whose ``value`` is
    ``sum(weight * component)``; ``components`` holds each reward's value under its name
    (a second reward of the same name is ``name_2``) and the reward's own components
    under ``name/component`` (e.g. ``math_answer/correct``).
    """

    def __init__(
        self,
        rewards: Sequence[NamedReward | tuple[str, float, Reward]],
        *,
        timeout: float = 10.0,
        failed_reward: float = 0.0,
        max_workers: int | None = None,
        plugins: Sequence[str] = (),
    ):
        """``max_workers``: worker processes for rewards with a recipe (default: the usable
        cores, 2 to 8), and threads for blocking instances without one. ``plugins``: plugin
        import paths the worker processes load to find the recipes' backends."""
        if not rewards:
            raise ConfigError("no rewards configured: add at least one under `rewards:`")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        named = [r if isinstance(r, NamedReward) else NamedReward(*r) for r in rewards]
        for r in named:
            if (reserved := reserved_component_error(r.name)) is not None:
                raise ConfigError(f"reward {r.name!r}: {reserved}")
        self.rewards = _unique_names(named)
        self.timeout = float(timeout)
        self.failed_reward = float(failed_reward)
        self.max_workers = max_workers or min(32, (os.cpu_count() or 1) + 4)
        # Blocking rewards with a recipe run in the worker processes: position here ->
        # position in the pool's list of recipes.
        pooled = [(i, r.recipe) for i, r in enumerate(self.rewards) if r.recipe is not None and _blocking(r.reward)]
        self._pooled = {i: n for n, (i, _) in enumerate(pooled)}
        self.pool: RewardWorkerPool | None = None
        if pooled:
            recipes = [recipe for _, recipe in pooled]
            self.pool = RewardWorkerPool(
                recipes, size=max_workers or default_pool_size(), timeout=self.timeout, plugins=plugins
            )
        # One semaphore per event loop: asyncio primitives are bound to the loop that
        # first waits on them, and score_sync runs each call in a new loop.
        self._limits: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )
        self.abandoned_threads = 0  # threads still running a reward that timed out
        #: Failed samples per reward name (the reasons go to the log, see _note_failure).
        self.failures: dict[str, int] = {}

    @classmethod
    def from_config(
        cls, config: RunConfig, registry: Registry, *, max_workers: int | None = None
    ) -> RewardSet:
        """Build every reward of ``config.rewards`` through the registry."""
        from forgerl.configuration.sections import options_dict

        rewards = []
        for i, choice in enumerate(config.rewards):
            backend = registry.require("reward", choice.name)
            try:
                # Built here too: validates the options with the right error, and tells
                # whether the reward is async (those stay on this process's event loop).
                instance = backend.build(choice.options)
            except ValidationError as exc:
                from forgerl.configuration.config import format_validation_error

                raise ConfigError(format_validation_error(exc, prefix=f"rewards.{i}.options")) from None
            # A plugin object passed in by an embedding caller exists in this process only:
            # a worker could not find its backend.
            embedded = registry.owner("reward", choice.name).distribution == "<embedded>"
            recipe = None if embedded else RewardRecipe(choice.name, options_dict(choice.options))
            sources = frozenset(choice.sources) if choice.sources is not None else None
            rewards.append(NamedReward(choice.name, choice.weight, instance, recipe, sources))
        reward_set = cls(
            rewards,
            timeout=config.loop.reward_timeout,
            failed_reward=config.loop.failed_reward,
            max_workers=max_workers,
            plugins=registry.plugin_refs,
        )
        # Workers import their rewards while the caller loads models: ready by the first batch.
        reward_set.start_workers()
        return reward_set

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.rewards]

    def start_workers(self) -> None:
        """Start the worker processes in the background (otherwise they start on first use)."""
        if self.pool is not None:
            self.pool.start()

    def close(self) -> None:
        """Stop the worker processes; scoring afterwards fails every pooled reward. Idempotent."""
        if self.pool is not None:
            self.pool.close()

    def __enter__(self) -> RewardSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- scoring

    async def score(self, samples: Sequence[RewardInput]) -> list[RewardResult]:
        """One result per sample, in order. Never raises because of a reward. A sample of a
        mixture source is scored by the rewards of its source only (:attr:`NamedReward.sources`)."""
        chosen = [self._for(s) for s in samples]
        per_sample = [asyncio.gather(*(self._one(i, s) for i in idx)) for s, idx in zip(samples, chosen, strict=True)]
        outcomes = await asyncio.gather(*per_sample)
        return [self._combine(idx, parts) for idx, parts in zip(chosen, outcomes, strict=True)]

    def _for(self, sample: RewardInput) -> list[int]:
        source = source_of(sample.problem)
        return [i for i, r in enumerate(self.rewards) if r.scores(source)]

    def score_sync(self, samples: Sequence[RewardInput]) -> list[RewardResult]:
        """:meth:`score` for callers without an event loop (not from inside a running one)."""
        return asyncio.run(self.score(samples))

    async def _one(self, index: int, sample: RewardInput) -> Outcome:
        """(value, sub-components, error) of one reward on one sample; value None when failed."""
        named = self.rewards[index]
        if self.pool is not None and index in self._pooled:
            # The pool enforces the timeout (it must kill the worker) and always answers.
            return await asyncio.wrap_future(self.pool.submit(self._pooled[index], sample))
        try:
            # Waiting for a served reward's server to come back is not the sample's time.
            await named.reward.until_ready()
            if _blocking(named.reward):
                finished, raw = await self._in_thread(named.reward.score, sample)
            else:
                finished, raw = await self._within_timeout(asyncio.ensure_future(named.reward.ascore(sample)))
            if not finished:
                return None, {}, f"timed out after {self.timeout:g}s"
            return outcome_of(raw)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any reward failure is scored, not raised
            return None, {}, f"{type(exc).__name__}: {exc}"

    async def _within_timeout(self, future: asyncio.Future[Any]) -> tuple[bool, Any]:
        """(True, result) or (False, None) on timeout. asyncio.wait rather than wait_for, so
        that a TimeoutError the reward raises itself is reported as its own error."""
        try:
            done, _ = await asyncio.wait({future}, timeout=self.timeout)
        finally:
            if not future.done():
                future.cancel()
                # Retrieve a late exception so asyncio does not log it as never retrieved.
                future.add_done_callback(lambda f: f.cancelled() or f.exception())
        if not done:
            return False, None
        return True, future.result()

    async def _in_thread(self, fn: Callable[[RewardInput], Any], sample: RewardInput) -> tuple[bool, Any]:
        loop = asyncio.get_running_loop()
        limit = self._limits.get(loop)
        if limit is None:
            limit = self._limits[loop] = asyncio.Semaphore(self.max_workers)
        # The timeout starts when a thread takes the sample: waiting for a free thread is
        # not the reward's fault.
        async with limit:
            future: asyncio.Future[Any] = loop.create_future()
            thread = threading.Thread(
                target=_run_into_future, args=(fn, sample, loop, future), daemon=True, name="forge-reward"
            )
            thread.start()
            finished, raw = await self._within_timeout(future)
        if not finished:
            # The thread cannot be stopped; it finishes (or not) on its own, and its slot
            # is given back so that one stuck reward does not starve the rest.
            self.abandoned_threads += 1
            if self.abandoned_threads in (1, 10, 100, 1000):
                print(
                    f"forge: warning: {self.abandoned_threads} reward call(s) timed out and still run "
                    "in the background; a reward that hangs should enforce its own timeout",
                    file=sys.stderr,
                )
        return finished, raw

    def _combine(self, indices: list[int], parts: list[Outcome]) -> RewardResult:
        if not indices:  # refused before a run starts (preflight); an embedding caller may get here
            return RewardResult(value=self.failed_reward, failed=True, error="no reward scores this problem's source")
        total = 0.0
        components: dict[str, float] = {}
        errors = []
        for named, (value, subs, error) in zip((self.rewards[i] for i in indices), parts, strict=True):
            if value is None:
                value = self.failed_reward
                errors.append(f"{named.name}: {error}")
                self._note_failure(named.name, error)
            components[named.name] = value
            for key, sub in subs.items():
                components[f"{named.name}/{key}"] = sub
            total += named.weight * value
        return RewardResult(
            value=total, components=components, failed=bool(errors), error="; ".join(errors) or None
        )

    def _note_failure(self, name: str, error: str | None) -> None:
        """Log why a reward failed: its 1st, 10th, 100th... failure, so that a reward that
        fails on every sample says so without flooding the log."""
        count = self.failures[name] = self.failures.get(name, 0) + 1
        if str(count).rstrip("0") == "1":
            log.warning("reward %r failed (%d sample(s) so far): %s", name, count, error)


def _run_into_future(
    fn: Callable[[RewardInput], Any],
    sample: RewardInput,
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future[Any],
) -> None:
    try:
        outcome, ok = fn(sample), True
    except Exception as exc:  # noqa: BLE001 - handed to the awaiting coroutine
        outcome, ok = exc, False
    except BaseException as exc:  # noqa: BLE001 - SystemExit in a reward must not end the run
        outcome, ok = RewardError(f"raised {type(exc).__name__}: {exc}"), False

    def deliver() -> None:
        if future.done():  # timed out and cancelled meanwhile
            return
        if ok:
            future.set_result(outcome)
        else:
            future.set_exception(outcome)

    try:
        loop.call_soon_threadsafe(deliver)
    except RuntimeError:
        pass  # the loop closed while this reward was running (it had timed out)


def _blocking(reward: Reward) -> bool:
    """True for a reward that implements only the blocking :meth:`Reward.score`."""
    return type(reward).ascore is Reward.ascore


def _unique_names(rewards: list[NamedReward]) -> list[NamedReward]:
    seen: dict[str, int] = {}
    out = []
    for r in rewards:
        seen[r.name] = seen.get(r.name, 0) + 1
        name = r.name if seen[r.name] == 1 else f"{r.name}_{seen[r.name]}"
        out.append(dataclasses.replace(r, name=name))
    return out
