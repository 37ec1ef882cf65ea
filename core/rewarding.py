"""The scoring engine: runs the configured rewards over finished samples.

Every (sample, reward) pair is scored concurrently under ``loop.reward_timeout``. A reward
that raises, times out or returns something that is not a finite number scores
``loop.failed_reward`` for its component; the sample is marked failed with the reason and
the run goes on: :meth:`RewardSet.score` never raises because of a reward.

Blocking rewards (those implementing :meth:`Reward.score`) run on daemon threads, at most
``max_workers`` at a time. Daemon threads rather than a ThreadPoolExecutor because a hung
reward cannot be interrupted: an executor's worker would hold its slot forever and block
interpreter exit, while an abandoned daemon thread only costs its stack. Rewards that
override :meth:`Reward.ascore` run on the event loop and must not block it.
"""

from __future__ import annotations

import asyncio
import math
import numbers
import os
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from pydantic import ValidationError

from forgerl.errors import ConfigError, RewardError
from forgerl.interfaces import Reward
from forgerl.types import RewardInput, RewardResult

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.config import RunConfig
    from forgerl.plugins import Registry


@dataclass(frozen=True)
class NamedReward:
    """One configured reward: its component name, its weight in the total, the instance."""

    name: str
    weight: float
    reward: Reward


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
    ):
        if not rewards:
            raise ConfigError("no rewards configured: add at least one under `rewards:`")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.rewards = _unique_names([r if isinstance(r, NamedReward) else NamedReward(*r) for r in rewards])
        self.timeout = float(timeout)
        self.failed_reward = float(failed_reward)
        self.max_workers = max_workers or min(32, (os.cpu_count() or 1) + 4)
        # One semaphore per event loop: asyncio primitives are bound to the loop that
        # first waits on them, and score_sync runs each call in a new loop.
        self._limits: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )
        self.abandoned_threads = 0  # threads still running a reward that timed out

    @classmethod
    def from_config(
        cls, config: "RunConfig", registry: "Registry", *, max_workers: int | None = None
    ) -> "RewardSet":
        """Build every reward of ``config.rewards`` through the registry."""
        rewards = []
        for i, choice in enumerate(config.rewards):
            backend = registry.require("reward", choice.name)
            try:
                instance = backend.create(choice.options)
            except ValidationError as exc:
                from forgerl.config import format_validation_error

                raise ConfigError(format_validation_error(exc, prefix=f"rewards.{i}.options")) from None
            rewards.append(NamedReward(choice.name, choice.weight, instance))
        return cls(
            rewards,
            timeout=config.loop.reward_timeout,
            failed_reward=config.loop.failed_reward,
            max_workers=max_workers,
        )

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.rewards]

    # ---------------------------------------------------------------- scoring

    async def score(self, samples: Sequence[RewardInput]) -> list[RewardResult]:
        """One result per sample, in order. Never raises because of a reward."""
        per_sample = [asyncio.gather(*(self._one(r, s) for r in self.rewards)) for s in samples]
        outcomes = await asyncio.gather(*per_sample)
        return [self._combine(parts) for parts in outcomes]

    def score_sync(self, samples: Sequence[RewardInput]) -> list[RewardResult]:
        """:meth:`score` for callers without an event loop (not from inside a running one)."""
        return asyncio.run(self.score(samples))

    async def _one(
        self, named: NamedReward, sample: RewardInput
    ) -> tuple[float | None, dict[str, float], str | None]:
        """(value, sub-components, error) of one reward on one sample; value None when failed."""
        try:
            if type(named.reward).ascore is Reward.ascore:
                finished, raw = await self._in_thread(named.reward.score, sample)
            else:
                finished, raw = await self._within_timeout(asyncio.ensure_future(named.reward.ascore(sample)))
            if not finished:
                return None, {}, f"timed out after {self.timeout:g}s"
            return _unpack(raw)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any reward failure is scored, not raised
            return None, {}, f"{type(exc).__name__}: {exc}"

    async def _within_timeout(self, future: "asyncio.Future[Any]") -> tuple[bool, Any]:
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

    def _combine(self, parts: list[tuple[float | None, dict[str, float], str | None]]) -> RewardResult:
        total = 0.0
        components: dict[str, float] = {}
        errors = []
        for named, (value, subs, error) in zip(self.rewards, parts, strict=True):
            if value is None:
                value = self.failed_reward
                errors.append(f"{named.name}: {error}")
            components[named.name] = value
            for key, sub in subs.items():
                components[f"{named.name}/{key}"] = sub
            total += named.weight * value
        return RewardResult(
            value=total, components=components, failed=bool(errors), error="; ".join(errors) or None
        )


def _run_into_future(
    fn: Callable[[RewardInput], Any],
    sample: RewardInput,
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future,
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


def _unpack(raw: Any) -> tuple[float | None, dict[str, float], str | None]:
    if isinstance(raw, RewardResult):
        if raw.failed:
            return None, {}, raw.error or "the reward reported a failure"
        value, subs = raw.value, dict(raw.components)
    elif isinstance(raw, numbers.Real):  # bool, int, float, numpy scalars
        value, subs = raw, {}
    else:
        return None, {}, f"returned {type(raw).__name__} {raw!r:.60}, expected a float or RewardResult"
    value = float(value)
    if not math.isfinite(value):
        return None, {}, f"returned {value}, expected a finite number"
    return value, {k: float(v) for k, v in subs.items()}, None


def _unique_names(rewards: list[NamedReward]) -> list[NamedReward]:
    seen: dict[str, int] = {}
    out = []
    for r in rewards:
        seen[r.name] = seen.get(r.name, 0) + 1
        name = r.name if seen[r.name] == 1 else f"{r.name}_{seen[r.name]}"
        out.append(NamedReward(name, r.weight, r.reward))
    return out
