"""Run untrusted programs: a fresh directory, resource limits, namespaces where possible.

:class:`Sandbox` runs one program at a time per call (:meth:`Sandbox.run`), at most
``concurrency`` at once across every process of this user on the machine (slots are lock
files, so the reward worker processes of a run share them). The supervision itself is
done by :mod:`.sandbox_launcher`, a separate small process, so that a sandboxed program
never runs as a child of a process that holds anything worth protecting.

Isolation levels (see docs/rewards.md for what each does and does not protect against):
``namespace`` (network/PID/mount namespaces, a read-only root holding only what the
interpreter needs: :mod:`.sandbox_root`), ``bwrap`` (bubblewrap on PATH, the same root),
``process`` (resource limits and process tracking only). ``auto`` takes the first of them
that works here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from forgerl.errors import ConfigError
from forgerl_plugins.rewards.conversation import Conversation
from forgerl_plugins.rewards.sandbox_outcome import RunOutcome
from forgerl_plugins.rewards.sandbox_root import InterpreterUnusable, RootView, root_view

log = logging.getLogger("forgerl.rewards")

LAUNCHER = str(Path(__file__).with_name("sandbox_launcher.py"))
#: Where a program sees its directory in the ``namespace`` level (the launcher's constant;
#: it is run as a script and imports nothing of ours).
VIEW_BOX = "/tmp/sandbox"
LEVELS = ("namespace", "bwrap", "process")

#: As root, slot ``i`` runs its programs as uid/gid ``SANDBOX_UID_BASE + i``: an id of its
#: own, so RLIMIT_NPROC applies (root is exempt) and the program can signal nothing else.
SANDBOX_UID_BASE = 2_000_000


class SandboxUnavailable(ConfigError):
    """The isolation level asked for cannot be provided on this machine."""


class SandboxBusy(Exception):
    """No slot came free before the caller's deadline: the program did not run."""


@dataclass(frozen=True)
class Limits:
    wall_seconds: float = 5.0
    cpu_seconds: int = 5
    memory_mb: int = 1024
    processes: int = 32
    file_size_mb: int = 16
    open_files: int = 64
    max_output_bytes: int = 65536


class Sandbox:
    def __init__(
        self,
        *,
        isolation: str = "auto",
        limits: Limits = Limits(),
        concurrency: int | None = None,
        python: str | None = None,
        workdir: str | None = None,
    ):
        self.limits = limits
        self.concurrency = concurrency or _usable_cores()
        self.python = python or os.path.realpath(sys.executable)
        self.workdir = workdir
        self.root = os.geteuid() == 0
        self._slots = _Slots(self.concurrency)
        self._view: RootView | None = None
        self.level = self._choose(isolation)

    def view(self) -> RootView:
        """The program's root at the ``namespace`` and ``bwrap`` levels (asked of the
        interpreter once: :func:`.sandbox_root.root_view`)."""
        if self._view is None:
            self._view = root_view(self.python)
        return self._view

    # ------------------------------------------------------------------ levels

    def _choose(self, wanted: str) -> str:
        if wanted not in ("auto", *LEVELS):
            raise ConfigError(f"code reward: unknown isolation {wanted!r}; choose auto, {', '.join(LEVELS)}")
        candidates = LEVELS if wanted == "auto" else (wanted,)
        reasons = []
        for level in candidates:
            why = self._probe(level)
            if why is None:
                return level
            reasons.append(f"{level}: {why}")
        raise SandboxUnavailable(
            f"code reward: isolation {wanted!r} is not available on this machine ({'; '.join(reasons)})"
        )

    def _probe(self, level: str) -> str | None:
        """None when ``level`` runs a trivial program here, else why not."""
        if level == "bwrap" and shutil.which("bwrap") is None:
            return "bwrap is not on PATH"
        if level in ("process", "bwrap") and self.root and not _reachable_by_anyone(self.python):
            return (
                f"as root, programs run as an unprivileged uid, which cannot reach {self.python}; "
                "set options.python to an interpreter every user can run (e.g. /usr/bin/python3)"
            )
        if level in ("namespace", "bwrap"):
            try:
                self.view()
            except InterpreterUnusable as exc:
                return str(exc)
        outcome = self.run({"main.py": "print(6 * 7)\n"}, level=level)
        if outcome.ok and outcome.stdout.strip() == "42":
            return None
        return (
            outcome.setup_error or (outcome.stderr.strip().splitlines() or [f"exit {outcome.exit_code}"])[-1]
        )

    def describe(self) -> str:
        what = {
            "namespace": "network, PID, mount and IPC namespaces; a read-only root of the interpreter, its "
            "standard library and the system's libraries only, the program's directory writable",
            "bwrap": "bubblewrap namespaces; a read-only root of the interpreter, its standard library and "
            "the system's libraries only, the program's directory writable",
            "process": "resource limits and process tracking only: NO network or filesystem isolation",
        }[self.level]
        who = f"; programs run as uids {SANDBOX_UID_BASE}+slot" if self.root else ""
        return f"isolation {self.level!r} ({what}{who}), at most {self.concurrency} programs at once"

    # ------------------------------------------------------------------ running

    def run(
        self, files: Mapping[str, str], *, stdin: str = "", level: str | None = None, deadline: float | None = None
    ) -> RunOutcome:
        """Run ``python main.py`` of ``files`` (written into a fresh directory) to its end,
        with ``stdin`` as its input. With ``deadline`` (a ``time.monotonic()`` time) the
        program is stopped by then at the latest (its wall clock is cut to the time left),
        and :class:`SandboxBusy` is raised when no slot comes free early enough to start it."""
        with self._launched(files, stdin, level or self.level, converse=False, deadline=deadline) as launched:
            return launched.finish()

    @contextlib.contextmanager
    def converse(self, files: Mapping[str, str]) -> Iterator[Conversation]:
        """Run ``python main.py`` of ``files`` with its stdin and stdout as a conversation
        of lines (:class:`Conversation`), within the wall-clock and CPU limits. Leaving
        the block stops the program (the supervisor kills what is left of it); the
        conversation's ``outcome`` then says how it ended."""
        with self._launched(files, "", self.level, converse=True) as launched:
            proc = launched.proc
            if proc is None or proc.stdin is None or proc.stdout is None:
                raise RuntimeError(f"the sandbox could not run the program: {launched.finish().setup_error}")
            talk = Conversation(proc.stdin, proc.stdout, seconds=self.limits.wall_seconds + _LAUNCHER_GRACE)
            try:
                yield talk
            finally:
                launched.stop()
                talk.close()
                talk.outcome = launched.finish()

    @contextlib.contextmanager
    def _launched(
        self, files: Mapping[str, str], stdin: str, level: str, converse: bool, deadline: float | None = None
    ) -> Iterator[_Launched]:
        with self._slots.take(None if deadline is None else deadline - _MIN_RUN_S) as slot:
            limits = self.limits
            if deadline is not None:
                left = deadline - time.monotonic()
                if left < _MIN_RUN_S:
                    raise SandboxBusy(f"a sandbox slot came free {left:.2f} s before the deadline: too late to start")
                limits = dataclasses.replace(limits, wall_seconds=min(limits.wall_seconds, left))
            uid = SANDBOX_UID_BASE + slot if self.root else None
            control = Path(tempfile.mkdtemp(prefix="forge-code-", dir=self.workdir))
            launched = None
            try:
                launched = self._launch(control, files, stdin, level, uid, converse, limits)
                yield launched
            finally:
                if launched is not None:  # the caller left early: end the program, reap the launcher
                    launched.stop()
                    launched.finish()
                _remove(control)

    def _launch(
        self, control: Path, files: Mapping[str, str], stdin: str, level: str, uid: int | None, converse: bool,
        lim: Limits,
    ) -> _Launched:
        control.chmod(0o711)  # the program's uid may traverse it, not list it
        box = control / "box"
        box.mkdir()
        for name, text in files.items():
            (box / name).write_text(text, encoding="utf-8", errors="replace")
        home = str(box)
        spec_extra = {}
        if level == "namespace":
            home = VIEW_BOX
            spec_extra["root"] = self.view().as_spec()
        if uid is not None:
            for path in (box, *box.rglob("*")):
                os.chown(path, uid, uid)
        argv = [self.python, "-I", "-S", "-B", "main.py"]
        if level == "bwrap":
            argv = [*bwrap_prefix(box, self.view()), *argv]
        env = {
            "HOME": home,
            "TMPDIR": home,
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "LANG": "C.UTF-8",
        }
        limits = {
            "cpu": lim.cpu_seconds,
            "address_space": lim.memory_mb * 2**20,
            "processes": lim.processes,
            "file_size": lim.file_size_mb * 2**20,
            "open_files": lim.open_files,
            "core": 0,
        }
        report_r, report_w = os.pipe()
        # Closing (or writing to) the stop pipe tells the supervisor to end the program now.
        stop_r, stop_w = os.pipe()
        spec = {
            "level": level, "box": str(box), "uid": uid, "argv": argv, "env": env, "limits": limits,
            "timeout": lim.wall_seconds, "parent": os.getpid(), "report_fd": report_w, "stop_fd": stop_r,
            **spec_extra,
        }  # fmt: skip
        out_path, err_path = control / "stdout", control / "stderr"
        try:
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                if not converse:
                    (control / "stdin").write_text(stdin, encoding="utf-8", errors="replace")
                with open(control / "stdin", "rb") if not converse else contextlib.nullcontext() as src:
                    proc = subprocess.Popen(
                        [os.path.realpath(sys.executable), "-I", "-S", LAUNCHER, json.dumps(spec)],
                        stdin=subprocess.PIPE if converse else src, stdout=subprocess.PIPE if converse else out,
                        stderr=err, pass_fds=(report_w, stop_r), start_new_session=True, cwd=control,
                    )  # fmt: skip
        except OSError as exc:
            for fd in (report_r, stop_w):
                os.close(fd)
            return _Launched(None, -1, -1, out_path, err_path, lim, f"cannot start the launcher: {exc}")
        finally:
            os.close(report_w)
            os.close(stop_r)
        return _Launched(proc, report_r, stop_w, out_path, err_path, lim)


#: The least wall clock worth starting a program for (it starts in about 0.06 s).
_MIN_RUN_S = 0.2
#: How long past the program's wall clock its supervisor may take to report: it kills and
#: reaps what is left; only a launcher that hangs itself (a bug) takes longer.
_LAUNCHER_GRACE = 30.0


class _Launched:
    """A started supervisor (or why it could not start): stopping it, and its outcome."""

    def __init__(
        self,
        proc: subprocess.Popen | None,
        report_fd: int,
        stop_fd: int,
        out_path: Path,
        err_path: Path,
        limits: Limits,
        setup_error: str | None = None,
    ):
        self.proc, self._report_fd, self._stop_fd = proc, report_fd, stop_fd
        self._out_path, self._err_path, self._limits = out_path, err_path, limits
        self._outcome = None if proc is not None else RunOutcome(None, None, False, "", "", 0.0, setup_error)

    def stop(self) -> None:
        """Tell the supervisor to end the program now (closing our end of the stop pipe)."""
        if self._stop_fd >= 0:
            os.close(self._stop_fd)
            self._stop_fd = -1

    def finish(self) -> RunOutcome:
        """Wait for the supervisor and read its report (once; later calls return it again)."""
        if self._outcome is None:
            assert self.proc is not None  # noqa: S101 - an outcome is set at start when there is none
            self._outcome = self._wait(self.proc)
        return self._outcome

    def _wait(self, proc: subprocess.Popen) -> RunOutcome:
        try:
            try:
                proc.wait(self._limits.wall_seconds + _LAUNCHER_GRACE)
            except subprocess.TimeoutExpired:  # the launcher itself hangs: should not happen
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, 9)
                proc.wait()
            with os.fdopen(self._report_fd, "rb") as f:
                raw = f.read()
        finally:
            self.stop()
            for pipe in (proc.stdin, proc.stdout):
                with contextlib.suppress(OSError):
                    if pipe is not None:
                        pipe.close()
        limit = self._limits.max_output_bytes
        stdout, stderr = _head(self._out_path, limit), _head(self._err_path, limit)
        try:
            report = json.loads(raw or b"{}")
        except ValueError:
            report = {}
        if "exit_code" not in report and "setup_error" not in report and proc.returncode < 0:
            # The supervisor was killed mid-run: at the process level the program (same
            # uid) can do that. The program's failure, not the sandbox's.
            return RunOutcome(None, -proc.returncode, False, stdout, stderr, 0.0)
        if "setup_error" in report or "exit_code" not in report:
            why = (
                report.get("setup_error") or f"the launcher ended without a report (status {proc.returncode})"
            )
            return RunOutcome(None, None, False, stdout, stderr, 0.0, setup_error=why)
        return RunOutcome(
            report["exit_code"], report["signal"], report["timed_out"], stdout, stderr, report["seconds"]
        )


# ---------------------------------------------------------------------- helpers


def bwrap_prefix(box: Path, view: RootView) -> list[str]:
    """bubblewrap's command line before the program's: every namespace new, a root of
    ``view`` (bubblewrap's own is an empty tmpfs: the binds read-only, the links, the
    package folders covered), a fresh ``/tmp`` (the host's hidden, as at the namespace
    level) with the interpreter's files bound back where they live under it (a virtual
    environment there) and the program's directory read-write, and the rest of the root
    and of ``/tmp`` made read-only."""
    under_tmp = [b for b in view.binds if b == "/tmp" or b.startswith("/tmp/")]
    mounts = [arg for b in view.binds if b not in under_tmp for arg in ("--ro-bind", b, b)]
    mounts += ["--tmpfs", "/tmp", *(arg for b in under_tmp for arg in ("--ro-bind", b, b))]
    for hidden in view.hidden:
        mounts += ["--tmpfs", hidden, "--remount-ro", hidden]
    mounts += [arg for path, target in view.links for arg in ("--symlink", target, path)]
    mounts += ["--bind", str(box), str(box), "--remount-ro", "/tmp"]
    return [shutil.which("bwrap") or "bwrap", "--unshare-all", "--die-with-parent", "--new-session",
            *mounts, "--proc", "/proc", "--dev", "/dev", "--remount-ro", "/", "--chdir", str(box), "--"]  # fmt: skip


def _head(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", "replace")


def _remove(path: Path) -> None:
    def writable_then_retry(func, target, _exc):  # a program may leave read-only directories
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(target), 0o700)
            os.chmod(target, 0o700)
            func(target)

    shutil.rmtree(path, onerror=writable_then_retry)


def _reachable_by_anyone(path: str) -> bool:
    """Every directory above ``path`` searchable by others and the file executable by them."""
    current = Path(path)
    try:
        if not current.stat().st_mode & stat.S_IXOTH:
            return False
        return all(parent.stat().st_mode & stat.S_IXOTH for parent in current.parents)
    except OSError:
        return False


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


#: How often a caller with a deadline looks for a free slot again.
_SLOT_POLL_S = 0.02
_SLOT_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


class _Slots:
    """At most ``n`` programs at once for every process of this user: ``n`` lock files,
    each held (flock) by the process running a program in that slot. A process that dies
    releases its locks, so a killed reward worker never leaks a slot."""

    def __init__(self, n: int):
        self.n = n
        self.directory = Path(tempfile.gettempdir()) / f"forgerl-sandbox-slots-{os.geteuid()}"
        self._next = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def take(self, deadline: float | None = None) -> Iterator[int]:
        self.directory.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(self.directory)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
            # Someone else made it (the temp dir is shared): its lock files are not ours to trust.
            raise RuntimeError(f"{self.directory} is not a private directory of this user; remove it")
        with self._lock:
            start, self._next = self._next, (self._next + 1) % self.n
        slot, fd = self._lock_one(start, deadline)
        try:
            yield slot
        finally:
            os.close(fd)  # releases the lock

    def _lock_one(self, start: int, deadline: float | None) -> tuple[int, int]:
        """The first free slot from ``start`` on, locked: (slot, its lock file's fd)."""
        while True:
            for i in range(self.n):
                candidate = (start + i) % self.n
                fd = os.open(self.directory / f"slot-{candidate}", _SLOT_FLAGS, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return candidate, fd
                except BlockingIOError:
                    os.close(fd)
            if deadline is None:
                break
            # flock has no timed wait: look again shortly, until the deadline.
            if time.monotonic() >= deadline:
                raise SandboxBusy(f"all {self.n} sandbox slots stayed busy until the deadline")
            time.sleep(_SLOT_POLL_S)
        # All busy: queue on one of them.
        fd = os.open(self.directory / f"slot-{start}", _SLOT_FLAGS, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return start, fd


class _JobOptions(TypedDict, total=False):
    stdin: str
    level: str | None


class Job(_JobOptions):
    """One program for :func:`run_all`: the keyword arguments of :meth:`Sandbox.run`."""

    files: Mapping[str, str]


def run_all(sandbox: Sandbox, jobs: Sequence[Job]) -> list[RunOutcome]:
    """Run several programs (keyword arguments of :meth:`Sandbox.run`), at most
    ``sandbox.concurrency`` at once from this process."""
    if len(jobs) <= 1:
        return [sandbox.run(**job) for job in jobs]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(sandbox.concurrency, len(jobs))) as pool:
        return list(pool.map(lambda job: sandbox.run(**job), jobs))
