"""When a client of a served engine may use a server again, and how long it waits for one.

Every client of a served engine (a server generator's pool on trainer rank 0, the served
reward model's client, any later served role) takes a server out of service when a
request fails on it, and must then know two things:

* **When it is back.** ``/health`` cannot say: vLLM's answers from its API server while
  the engine behind it is wedged (a stuck NCCL or CUDA call), so a client that believed it
  sent request after request into the wedged engine, each waiting its whole timeout. The
  launcher beside the server can: its liveness probe goes through the engine
  (:mod:`.liveness`). So the launcher counts the probes its engine answered in a small file
  beside the endpoint file (:class:`AnswerCount`: ``<role>-<replica>.answers``, the
  server's instance and the count), and a client takes a server back (:class:`Outage`)
  only once that count has moved on twice since the failure (the first new answer may
  come from a probe that began before it), or once another instance replaced the server.
  A server without the file (one the user runs, at a ``url``) is judged by its health
  check alone, as before.
* **How long to wait.** A request that finds every server out of service (killed,
  restarting, being re-synced) waits for one to come back instead of spending its retries
  on servers that cannot answer, for as long as a restart may take
  (:func:`restart_allowance`). A replica whose restarts are spent ends the job through its
  scheduler, which says so; the allowance bounds the wait where nothing else does.

Nothing here imports an engine or torch: launchers, the pool's event loop and blocking
clients use it alike (the reads are a few hundred bytes, cheap enough for an event loop).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from .liveness import PROBE_TIMEOUT

SUFFIX = ".answers"
#: New engine answers a client waits for before it takes a server back (see the module
#: docstring: one could be a probe that started before the failure).
ANSWERS_NEEDED = 2


def answers_file(endpoint: Path) -> Path:
    """The count of the server whose endpoint file is ``endpoint``."""
    return Path(endpoint).with_suffix(SUFFIX)


def read_answers(endpoint: Path, instance: str | None) -> int | None:
    """How many probes the engine of server ``instance`` answered, as its launcher counted;
    None when its launcher keeps no count (a server not started by ours) or the file names
    another instance."""
    try:
        data = json.loads(answers_file(endpoint).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("instance") != instance:
        return None
    count = data.get("answers")
    return count if isinstance(count, int) and not isinstance(count, bool) else None


class AnswerCount:
    """The launcher's side: :meth:`publish` before the endpoint file is written, :meth:`add`
    after each probe the engine answered, :meth:`remove` when the server is gone."""

    def __init__(self, endpoint: Path, instance: str) -> None:
        self.path = answers_file(endpoint)
        self.instance = instance
        self.count = 0

    def publish(self) -> None:
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write()

    def add(self) -> None:
        self.count += 1
        self._write()

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink(missing_ok=True)

    def _write(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        try:
            tmp.write_text(json.dumps({"instance": self.instance, "answers": self.count}))
            os.replace(tmp, self.path)
        except OSError:
            # A count that cannot be written only makes clients judge by health checks.
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)


class Outage:
    """A server a client took out of service (``Outage(endpoint, instance)``, made when it
    is taken out): :meth:`over` says when the client may use it again."""

    def __init__(self, endpoint: Path | None, instance: str | None) -> None:
        self.endpoint = endpoint
        self.instance = instance
        self.answers = read_answers(endpoint, instance) if endpoint is not None else None

    def over(self, instance: str | None) -> bool:
        """Whether the server now behind the endpoint (``instance``) may serve again: another
        instance replaced the one taken out, or its engine answered its launcher
        :data:`ANSWERS_NEEDED` times since. Without a count when it was taken out (a server
        not started by our launcher), the health check decides; a count that is gone since,
        or names another instance, means the server went: it is not back (its successor is
        met through its endpoint file)."""
        if instance != self.instance or self.answers is None or self.endpoint is None:
            return True
        now = read_answers(self.endpoint, instance)
        return now is not None and now >= self.answers + ANSWERS_NEEDED


def restart_allowance(*, startup_timeout: float, liveness_timeout: float, resync: float = 0.0) -> float:
    """The longest a server may be out of service while it is replaced: its launcher finds
    it hung (``liveness_timeout`` of silence and one more probe), the new server starts and
    answers (``startup_timeout``), and the client brings it up to date (``resync``)."""
    return liveness_timeout + PROBE_TIMEOUT + startup_timeout + resync
