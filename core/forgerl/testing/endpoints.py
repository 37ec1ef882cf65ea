"""Helper processes (:mod:`forgerl.testing.transport_receiver`) and the JSON events they print.

Two ways to start one:

* ``fork`` (default): a child of a multiprocessing *forkserver* that imported torch and
  forgerl once; the child runs the helper's ``main(argv)``. A fresh interpreter spends
  seconds of CPU importing torch (15-20 s of wall time on two busy cores); a forked one
  starts in a fraction of a second, which keeps the suite within its time budget. The
  child is still its own process, with its own store connections, groups and engines,
  and dies for real when killed.
* ``subprocess`` (``FORGE_CONFORMANCE_SPAWN=subprocess``): a fresh
  ``python -m forgerl.testing.transport_receiver ...``, exactly as a generator worker
  would start. Slower; use it to rule out anything inherited from the forkserver.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from forgerl.testing.timing import scaled

HELPER = "forgerl.testing.transport_receiver"
#: Name prefix of the threads that read a helper's output (the transport kit's check that
#: a transport's own threads end at close leaves them out).
READER_THREAD_PREFIX = "forgerl-testing-endpoint"
SPAWN = os.environ.get("FORGE_CONFORMANCE_SPAWN", "fork")

_forkserver: ForkServerContext | None = None


def _context() -> ForkServerContext:
    global _forkserver
    if _forkserver is None:
        ctx: ForkServerContext = multiprocessing.get_context("forkserver")
        # Imported once in the server, inherited by every child; nothing here starts a
        # thread, so forking after it is safe.
        ctx.set_forkserver_preload(["torch", "forgerl.registry.plugins", HELPER])
        _forkserver = ctx
    return _forkserver


class _LineSender:
    """``sys.stdout`` of a forked helper: whole lines go to the parent through a pipe."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.pending = ""

    def write(self, text: str) -> int:
        self.pending += text
        while "\n" in self.pending:
            line, self.pending = self.pending.split("\n", 1)
            self.conn.send(line)
        return len(text)

    def flush(self) -> None:
        pass


class _LineReceiver:
    """``sys.stdin`` of a forked helper."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def readline(self) -> str:
        try:
            return self.conn.recv() + "\n"
        except EOFError:
            return ""

    def __iter__(self) -> Iterator[str]:
        while line := self.readline():
            yield line


def _forked_main(argv: list[str], events: Any, commands: Any, log_path: str) -> None:
    # Native code (gloo, Mooncake) logs to fd 2: into this endpoint's own file.
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115 - lives as long as the process
    sys.stdout = _LineSender(events)
    sys.stdin = _LineReceiver(commands)
    from forgerl.testing import transport_receiver

    code = 1
    try:
        code = transport_receiver.main(argv)
    finally:
        sys.stderr.flush()
        os._exit(code)


class Endpoint:
    """A helper process and the JSON events it prints."""

    def __init__(self, args: list[str], label: str) -> None:
        self.label = label
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        self._stderr: list[str] = []
        # Exactly one of the two is set: a subprocess, or a process forked by the forkserver.
        self._popen: subprocess.Popen[str] | None = None
        self._proc: BaseProcess | None = None
        if SPAWN == "subprocess":
            self._popen = subprocess.Popen(
                [sys.executable, "-m", HELPER, *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
            self.pid = self._popen.pid
            self._reader(self._read_lines, self._popen.stdout)
            self._reader(self._read_stderr, self._popen.stderr)
        else:
            ctx = _context()
            events_in, events_out = ctx.Pipe(duplex=False)
            commands_in, commands_out = ctx.Pipe(duplex=False)
            fd, self._log_path = tempfile.mkstemp(prefix="forgerl-endpoint-", suffix=".log")
            os.close(fd)
            self._proc = ctx.Process(
                target=_forked_main, args=(args, events_out, commands_in, self._log_path), daemon=True
            )
            self._proc.start()
            events_out.close()
            commands_in.close()
            self._commands = commands_out
            assert self._proc.pid is not None  # set by start()
            self.pid = self._proc.pid
            self._reader(self._read_conn, events_in)

    # ----------------------------------------------------------------- output

    def _reader(self, target: Any, *args: Any) -> None:
        name = f"{READER_THREAD_PREFIX}-{self.pid}"
        threading.Thread(target=target, args=args, daemon=True, name=name).start()

    def _accept(self, line: str) -> None:
        if line.startswith("{"):
            self.events.put(json.loads(line))

    def _read_lines(self, stream: Any) -> None:
        for line in stream:
            self._accept(line)

    def _read_conn(self, conn: Any) -> None:
        while True:
            try:
                self._accept(conn.recv())
            except (EOFError, OSError):
                return

    def _read_stderr(self, stream: Any) -> None:
        for line in stream:
            self._stderr.append(line)

    def stderr_tail(self, lines: int = 25) -> str:
        if self._popen is not None:
            return "".join(self._stderr[-lines:])
        try:
            return "".join(Path(self._log_path).read_text(errors="replace").splitlines(True)[-lines:])
        except OSError:
            return ""

    # ---------------------------------------------------------------- control

    def wait(self, event: str, version: int | None = None, timeout: float | None = None) -> dict[str, Any]:
        """The next event of this kind (and version); fails with the process's log.
        ``timeout``: seconds, as given (pass ``scaled(...)``); default ``scaled(30)``."""
        timeout = scaled(30.0) if timeout is None else timeout
        end = time.monotonic() + timeout
        while True:
            try:
                ev = self.events.get(timeout=max(0.0, min(0.2, end - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= end:
                    raise AssertionError(
                        f"{self.label}: no {event!r} event (version {version}) within {timeout} s; "
                        f"events so far: {[e['event'] + str(e.get('version', '')) for e in self.seen]}; "
                        f"exit {self.exitcode()}; log tail:\n{self.stderr_tail()}"
                    ) from None
                continue
            self.seen.append(ev)
            if ev["event"] == event and (version is None or ev.get("version") == version):
                return ev
            if ev["event"] == "error" and event != "error":
                raise AssertionError(f"{self.label}: {ev['type']} instead of {event!r}: {ev['message']}")

    def tell(self, line: str) -> None:
        if self._popen is not None:
            assert self._popen.stdin is not None
            self._popen.stdin.write(line + "\n")
            self._popen.stdin.flush()
        else:
            self._commands.send(line)

    def exitcode(self) -> int | None:
        if self._popen is not None:
            return self._popen.poll()
        return self._forked().exitcode

    def finish(self, timeout: float | None = None) -> int:
        """Wait for the process to exit; its exit status (negative: killed by a signal).
        ``timeout``: seconds, as given; default ``scaled(30)``."""
        timeout = scaled(30.0) if timeout is None else timeout
        if self._popen is not None:
            try:
                return self._popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"{self.label} did not exit within {timeout} s") from None
        proc = self._forked()
        proc.join(timeout)
        if proc.exitcode is None:
            self.kill()
            raise AssertionError(f"{self.label} did not exit within {timeout} s")
        return proc.exitcode

    def kill(self) -> None:
        if self._popen is not None:
            if self._popen.poll() is None:
                self._popen.kill()
            self._popen.wait(timeout=scaled(30))
            return
        proc = self._forked()
        if proc.exitcode is None:
            proc.kill()
        proc.join(scaled(30))

    def _forked(self) -> BaseProcess:
        """The helper process when it was forked rather than started with Popen."""
        if self._proc is None:
            raise AssertionError(f"{self.label}: neither started nor forked")
        return self._proc

    def cleanup(self) -> None:
        self.kill()
        if self._popen is None:
            try:
                os.unlink(self._log_path)
            except OSError:
                pass

    def alive(self) -> bool:
        """Whether the process still exists (a zombie counts as gone)."""
        try:
            state = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        return state != "Z"
