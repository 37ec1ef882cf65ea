"""How much of the time the generator had nothing to do: ``time/generator_idle_frac``.

The generator is *busy* while at least one of the rollout producer's ``generate`` calls is
in flight, and *idle* otherwise (waiting for the version gate, for the trainer to take a
batch, for scoring, or for new weights). :class:`IdleClock` adds up the idle time;
:class:`WatchedGenerator` is the generator the producer is given, which tells the clock
when its calls start and end. The loop reads the clock at both ends of a step and reports
the idle share of that step's wall time: in the synchronous-versioned mode the generator
idles while the trainer trains and weights move, and under ``loop.overlap: continuous`` it
should not.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from forgerl.interfaces import Generator
from forgerl.types import Completion, GenerationRequest


@dataclass(frozen=True)
class Mark:
    """A reading of the clock: the time, and the idle seconds added up until then."""

    at: float
    idle: float


class IdleClock:
    """``IdleClock(clock)``: counts the generator's calls in flight (:meth:`begin`,
    :meth:`end`, from any thread) and adds up the time none was. ``clock`` gives seconds
    (``time.perf_counter``; tests give their own)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._busy = 0
        self._idle = 0.0
        self._idle_since = clock()

    def begin(self) -> None:
        with self._lock:
            if self._busy == 0:
                self._idle += self.clock() - self._idle_since
            self._busy += 1

    def end(self) -> None:
        with self._lock:
            self._busy -= 1
            if self._busy == 0:
                self._idle_since = self.clock()

    def mark(self) -> Mark:
        with self._lock:
            now = self.clock()
            return Mark(now, self._idle + (now - self._idle_since if self._busy == 0 else 0.0))

    def idle_frac(self, since: Mark) -> float:
        """The share of the time since ``since`` in which no call was in flight (for no
        time at all: 1 when none is in flight now, else 0)."""
        now = self.mark()
        wall = now.at - since.at
        if wall <= 0:
            with self._lock:
                return 1.0 if self._busy == 0 else 0.0
        return min(1.0, max(0.0, (now.idle - since.idle) / wall))


class WatchedGenerator(Generator):
    """``WatchedGenerator(inner, clock)``: ``inner``, with each ``generate`` call counted
    in flight on ``clock``. Everything else is ``inner``'s."""

    def __init__(self, inner: Generator, clock: IdleClock) -> None:
        self.inner = inner
        self.idle_clock = clock

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Completion]]:
        self.idle_clock.begin()
        try:
            return await self.inner.generate(requests)
        finally:
            self.idle_clock.end()

    def update_weights(self, version: int) -> None:
        self.inner.update_weights(version)

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    def close(self) -> None:
        pass  # the loop's generator, closed by whoever built it

    def __getattr__(self, name: str) -> Any:
        # What an environment runner may read besides the interface (an agent endpoint's
        # generator details): the wrapped generator's.
        return getattr(self.inner, name)
