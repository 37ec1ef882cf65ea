"""What every tracker plugin shares: the run hooks, one open tracker per run directory, the
scalars of a metrics row, and a tracker that cannot start or write being skipped (with a
note in the run's progress and log) instead of stopping the run.

A tracker module subclasses :class:`Tracker` with how it opens, writes and closes a run,
and binds its instance's hooks as the module's own (pluggy registers the module the entry
point names)::

    _tracker = MyTracker()
    forge_run_start, forge_step_end, forge_run_end = _tracker.run_hooks()
    forge_step_samples = _tracker.forge_step_samples  # where it shows samples (write_samples)
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from forgerl import events
from forgerl.hookspecs import hookimpl
from forgerl.samples.records import message_text

log = logging.getLogger("forgerl.trackers")

#: Row keys that are not a series to plot: the step is the x axis, time/wall a clock.
NOT_SCALARS = {"step", "time/wall"}
#: The columns of a tracker's samples table (forgerl.samples.SampleRecord's fields, messages
#: as text).
SAMPLE_COLUMNS = ("step", "kind", "group", "index", "problem_id", "policy_version", "reward", "advantage",
                  "correct", "finish_reason", "error", "prompt", "completion", "messages")


def sample_rows(samples: Sequence[Any]) -> list[list[Any]]:
    """A samples table's rows, one per record, in :data:`SAMPLE_COLUMNS` order."""
    rows = []
    for r in samples:
        messages = "\n".join(f"[{m.get('role', '?')}] {message_text(m)}" for m in r.messages or []
                              if isinstance(m, dict))
        rows.append([r.step, r.kind, r.group, r.index, r.problem_id, r.policy_version, r.reward, r.advantage,
                     r.correct, r.finish_reason, r.error, r.prompt, r.completion, messages or None])
    return rows


def scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics row (booleans and nulls left out)."""
    return {
        k: float(v)
        for k, v in metrics.items()
        if k not in NOT_SCALARS and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


class Tracker:
    """Subclasses say whether the config enables them, which module they need, how to
    install it, and how to open, write and close one run."""

    name = ""
    module = ""
    install = ""
    switch = ""  # the config key that turns it off (or on)

    def __init__(self) -> None:
        self.open_runs: dict[Path, Any] = {}

    # -- to implement
    def enabled(self, config: Any) -> bool:
        raise NotImplementedError

    def open(self, config: Any, run_dir: Path) -> Any:
        raise NotImplementedError

    def write(self, handle: Any, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def close(self, handle: Any, summary: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def write_samples(self, handle: Any, step: int, samples: Sequence[Any]) -> None:
        """Show a step's sample records (a tracker without tables does nothing)."""

    # -- the run hooks
    def run_hooks(self) -> tuple[Callable[..., None], Callable[..., None], Callable[..., None]]:
        """``forge_run_start``, ``forge_step_end``, ``forge_run_end`` of this tracker, in
        that order, for its module to bind under those names."""
        return self.forge_run_start, self.forge_step_end, self.forge_run_end

    @hookimpl
    def forge_run_start(self, config: Any, run_dir: Path) -> None:
        if not self.enabled(config):
            return
        try:
            __import__(self.module)
        except ImportError as exc:
            self._skip(run_dir, f"{self.module} is not installed ({self.install}; or {self.switch})", exc)
            return
        try:
            self.open_runs[run_dir] = self.open(config, run_dir)
        except Exception as exc:  # noqa: BLE001 - a tracker must not stop training
            self._skip(run_dir, f"could not start: {type(exc).__name__}: {exc}", exc)
            return
        events.announce(f"{self.name}: {self.where(run_dir)}", stage="tracker", run_dir=run_dir)

    def where(self, run_dir: Path) -> str:
        return "writing"

    @hookimpl
    def forge_step_end(self, step: int, metrics: Mapping[str, Any], run_dir: Path) -> None:
        handle = self.open_runs.get(run_dir)
        if handle is None:
            return
        try:
            self.write(handle, step, scalars(metrics))
        except Exception as exc:  # noqa: BLE001 - a tracker must not stop training
            self.open_runs.pop(run_dir, None)
            self._skip(run_dir, f"stopped after a failed write at step {step}: {type(exc).__name__}: {exc}", exc)

    @hookimpl
    def forge_step_samples(self, step: int, samples: Sequence[Any], run_dir: Path) -> None:
        handle = self.open_runs.get(run_dir)
        if handle is None:
            return
        try:
            self.write_samples(handle, step, samples)
        except Exception as exc:  # noqa: BLE001 - a tracker must not stop training
            # The metrics matter more than the table: the tracker goes on without samples.
            log.warning("%s: samples of step %d not logged: %s: %s", self.name, step, type(exc).__name__, exc)

    @hookimpl
    def forge_run_end(self, summary: Mapping[str, Any], run_dir: Path) -> None:
        handle = self.open_runs.pop(run_dir, None)
        if handle is None:
            return
        try:
            self.close(handle, summary)
        except Exception:  # the run has ended: say it in the log only
            log.exception("%s: closing failed", self.name)

    def _skip(self, run_dir: Path, why: str, exc: BaseException) -> None:
        log.warning("%s: skipped: %s", self.name, why, exc_info=not isinstance(exc, ImportError))
        events.announce(f"{self.name}: skipped: {why}", stage="tracker", state="skipped", run_dir=run_dir)
