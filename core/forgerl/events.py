"""Progress events: what a run is doing before (and between) its steps.

Any process of a run — the trainer, a generator's server launcher, a plugin — says what it
is doing with :func:`announce`, or times a stretch of work with :func:`phase`; each event
is one JSON line appended to ``<run_dir>/events.jsonl``. ``forge run`` follows that file
and prints the events (:mod:`forgerl.runloop.progress`), so a user sees "converting the model",
"starting vLLM replica 0 (log: ...)", "waiting for /health" from the first second, in a
terminal and in a Slurm or CI log alike.

:func:`phase` remembers how long each kind of work took (``timings.json`` in the model
cache folder) and the next run's event says "usually ~N s". Nothing here may fail a run:
an event that cannot be written is dropped.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path
from typing import Any, TextIO

from forgerl.rundirs.runs import append_line

EVENTS_FILE = "events.jsonl"
TIMINGS_FILE = "timings.json"


def _who() -> str:
    role = os.environ.get("FORGE_ROLE")
    if not role:
        return "forge"
    return f"{role}-{os.environ.get('FORGE_REPLICA', '0')}"


def _run_dir(run_dir: str | Path | None) -> Path | None:
    if run_dir is not None:
        return Path(run_dir)
    env = os.environ.get("FORGE_RUN_DIR")
    return Path(env) if env else None


def announce(
    message: str,
    *,
    run_dir: str | Path | None = None,
    stage: str = "info",
    state: str = "info",
    log: str | Path | None = None,
    **extra: Any,
) -> None:
    """Append one event to the run's events.jsonl (``run_dir`` defaults to
    ``$FORGE_RUN_DIR``, which every process of a run has). ``log`` names the file where
    the details are (a server's log). Without a run directory, nothing happens."""
    folder = _run_dir(run_dir)
    if folder is None:
        return
    event = {"time": time.time(), "who": _who(), "stage": stage, "state": state, "message": message}
    if log is not None:
        event["log"] = str(log)
    event.update(extra)
    # Whole lines only, and a full disk drops the event (runs.append_line).
    append_line(folder / EVENTS_FILE, (json.dumps(event) + "\n").encode())


def forward_warnings(category: type[Warning], *, run_dir: str | Path | None = None) -> None:
    """From now on, also announce each warning of ``category`` that this process shows (a
    plugin's use of a deprecated name, :mod:`forgerl.deprecation`): it may happen deep in
    a trainer rank, whose stderr goes to a log file, and ``forge run`` prints events.
    Python's warning filters still decide what is shown, so a warning repeated at the same
    place is announced once. Calling it again for the same category and run changes nothing."""
    key = (category, str(run_dir))
    if getattr(warnings.showwarning, "forge_forwards", None) == key:
        return
    shown_before, forwarded = warnings.showwarning, category

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: TextIO | None = None, line: str | None = None) -> None:
        if issubclass(category, forwarded):
            announce(str(message), run_dir=run_dir, stage="warning", state="warning")
        shown_before(message, category, filename, lineno, file, line)

    show.forge_forwards = key  # type: ignore[attr-defined]
    warnings.showwarning = show


class phase:
    """Announce ``message`` (with ``detail``, said at the start only, and how long it took
    last time, when known), and when the work ends, that it is done and how long it took. A context manager (an exception
    marks it failed), or call :meth:`done` / :meth:`failed` where the work ends in several
    places. ``key`` names the kind of work for the remembered durations (default
    ``stage``), e.g. ``model:tiny``."""

    def __init__(
        self,
        message: str,
        *,
        stage: str,
        key: str | None = None,
        run_dir: str | Path | None = None,
        log: str | Path | None = None,
        detail: str | None = None,
    ) -> None:
        self.message, self.stage, self.key, self.run_dir, self.log = message, stage, key or stage, run_dir, log
        self.ended = False
        typical = _timings().get(self.key)
        extra: dict[str, Any] = {"typical_s": round(typical, 1)} if typical is not None else {}
        if detail:
            extra["detail"] = detail
        announce(message, run_dir=run_dir, stage=stage, state="start", log=log, **extra)
        self.start = time.monotonic()

    def done(self) -> None:
        if self.ended:
            return
        self.ended = True
        took = time.monotonic() - self.start
        announce(f"{self.message}: done", run_dir=self.run_dir, stage=self.stage, state="done", took_s=round(took, 1))
        _remember(self.key, took)

    def failed(self, why: str = "") -> None:
        if self.ended:
            return
        self.ended = True
        announce(f"{self.message}: failed" + (f" ({why})" if why else ""), run_dir=self.run_dir, stage=self.stage,
                 state="failed", log=self.log, took_s=round(time.monotonic() - self.start, 1))

    def __enter__(self) -> phase:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if kind is None:
            self.done()
        else:
            self.failed(type(exc).__name__ if not str(exc) else " ".join(str(exc).split())[:200])


def _timings_path() -> Path:
    env = os.environ.get("FORGE_CACHE_DIR")
    cache = Path(env).expanduser() if env else Path.home() / ".cache" / "forgerl" / "models"
    return cache / TIMINGS_FILE


def _timings() -> dict[str, float]:
    try:
        data = json.loads(_timings_path().read_text())
    except (OSError, ValueError):
        return {}
    return {k: float(v) for k, v in data.items() if isinstance(v, (int, float))} if isinstance(data, dict) else {}


def _remember(key: str, seconds: float) -> None:
    path = _timings_path()
    data = _timings()
    data[key] = seconds
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass


def events_size(run_dir: Path) -> int:
    """Where a follower starts reading: events already in the file (an earlier job's, in a
    resumed run) are history."""
    try:
        return (Path(run_dir) / EVENTS_FILE).stat().st_size
    except OSError:
        return 0


def read_events(path: Path, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """Complete event lines from ``offset`` on, and the offset after the last of them
    (a line being written stays for the next read)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return [], offset
    end = data.rfind(b"\n") + 1
    events = []
    for line in data[:end].splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events, offset + end
