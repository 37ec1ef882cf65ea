"""Run untrusted programs: a fresh directory, resource limits, namespaces where possible.

:class:`Sandbox` runs one program at a time per call (:meth:`Sandbox.run`), at most
``concurrency`` at once across every process of this user on the machine (slots are lock
files, so the reward worker processes of a run share them). The supervision itself is
done by :mod:`.sandbox_launcher`, a separate small process, so that a sandboxed program
never runs as a child of a process that holds anything worth protecting.

Isolation levels (see docs/rewards.md for what each does and does not protect against):
``namespace`` (network/PID/mount namespaces, read-only ``/``), ``bwrap`` (bubblewrap on
PATH), ``process`` (resource limits and process tracking only). ``auto`` takes the first
of them that works here.
"""

from __future__ import annotations

import contextlib
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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TypedDict

from forgerl.errors import ConfigError

log = logging.getLogger("forgerl.rewards")

LAUNCHER = str(Path(__file__).with_name("sandbox_launcher.py"))
#: Where a program sees its directory and the interpreter in the ``namespace`` level (the
#: launcher's constants, which is run as a script and imports nothing of ours).
VIEW_BOX, VIEW_PYTHON = "/tmp/sandbox", "/tmp/python"
LEVELS = ("namespace", "bwrap", "process")

#: As root, slot ``i`` runs its programs as uid/gid ``SANDBOX_UID_BASE + i``: an id of its
#: own, so RLIMIT_NPROC applies (root is exempt) and the program can signal nothing else.
SANDBOX_UID_BASE = 2_000_000


class SandboxUnavailable(ConfigError):
    """The isolation level asked for cannot be provided on this machine."""


@dataclass(frozen=True)
class Limits:
    wall_seconds: float = 5.0
    cpu_seconds: int = 5
    memory_mb: int = 1024
    processes: int = 32
    file_size_mb: int = 16
    open_files: int = 64
    max_output_bytes: int = 65536


@dataclass(frozen=True)
class RunOutcome:
    """How one program ended. ``setup_error``: the sandbox itself failed (not the program)."""

    exit_code: int | None
    signal: int | None
    timed_out: bool
    stdout: str
    stderr: str
    seconds: float
    setup_error: str | None = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and self.setup_error is None


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
        self.level = self._choose(isolation)

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
        if level in ("process", "bwrap") and self.root and self._python_bind() is not None:
            return (
                f"as root, programs run as an unprivileged uid, which cannot reach {self.python}; "
                "set options.python to an interpreter every user can run (e.g. /usr/bin/python3)"
            )
        outcome = self.run({"main.py": "print(6 * 7)\n"}, level=level)
        if outcome.ok and outcome.stdout.strip() == "42":
            return None
        return (
            outcome.setup_error or (outcome.stderr.strip().splitlines() or [f"exit {outcome.exit_code}"])[-1]
        )

    def describe(self) -> str:
        what = {
            "namespace": "network, PID, mount and IPC namespaces; / read-only, only the program's directory writable",
            "bwrap": "bubblewrap namespaces; / read-only, only the program's directory writable",
            "process": "resource limits and process tracking only: NO network or filesystem isolation",
        }[self.level]
        who = f"; programs run as uids {SANDBOX_UID_BASE}+slot" if self.root else ""
        return f"isolation {self.level!r} ({what}{who}), at most {self.concurrency} programs at once"

    # ------------------------------------------------------------------ running

    def run(
        self,
        files: Mapping[str, str],
        *,
        stdin: str = "",
        stdin_pipe: bool = False,
        level: str | None = None,
    ) -> RunOutcome:
        """Run ``python main.py`` of ``files`` (written into a fresh directory). ``stdin``
        goes through a file, or through a pipe when ``stdin_pipe`` (read once, it cannot
        be read again by seeking)."""
        level = level or self.level
        with self._slots.take() as slot:
            uid = SANDBOX_UID_BASE + slot if self.root else None
            control = Path(tempfile.mkdtemp(prefix="forge-code-", dir=self.workdir))
            try:
                return self._run_in(control, files, stdin, stdin_pipe, level, uid)
            finally:
                _remove(control)

    def _run_in(
        self,
        control: Path,
        files: Mapping[str, str],
        stdin: str,
        stdin_pipe: bool,
        level: str,
        uid: int | None,
    ) -> RunOutcome:
        control.chmod(0o711)  # the program's uid may traverse it, not list it
        box = control / "box"
        box.mkdir()
        for name, text in files.items():
            (box / name).write_text(text, encoding="utf-8", errors="replace")
        interpreter, home = self.python, str(box)
        spec_extra = {}
        if level == "namespace":
            home = VIEW_BOX
            bind = self._python_bind() if uid is not None else None
            if bind is not None:
                spec_extra["python_bind"], relative = bind
                interpreter = os.path.join(VIEW_PYTHON, relative)
        if uid is not None:
            for path in (box, *box.rglob("*")):
                os.chown(path, uid, uid)
        argv = [interpreter, "-I", "-S", "-B", "main.py"]
        if level == "bwrap":
            argv = [*bwrap_prefix(box, self.python), *argv]
        env = {
            "HOME": home,
            "TMPDIR": home,
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "LANG": "C.UTF-8",
        }
        lim = self.limits
        limits = {
            "cpu": lim.cpu_seconds,
            "address_space": lim.memory_mb * 2**20,
            "processes": lim.processes,
            "file_size": lim.file_size_mb * 2**20,
            "open_files": lim.open_files,
            "core": 0,
        }
        report_r, report_w = os.pipe()
        spec = {
            "level": level, "box": str(box), "uid": uid, "argv": argv, "env": env, "limits": limits,
            "timeout": lim.wall_seconds, "parent": os.getpid(), "report_fd": report_w, **spec_extra,
        }  # fmt: skip
        out_path, err_path = control / "stdout", control / "stderr"
        try:
            with (
                open(out_path, "wb") as out,
                open(err_path, "wb") as err,
                _stdin(control, stdin, stdin_pipe) as src,
            ):
                proc = subprocess.Popen(
                    [os.path.realpath(sys.executable), "-I", "-S", LAUNCHER, json.dumps(spec)],
                    stdin=src, stdout=out, stderr=err, pass_fds=(report_w,), start_new_session=True, cwd=control,
                )  # fmt: skip
        except OSError as exc:
            os.close(report_r)
            return RunOutcome(None, None, False, "", "", 0.0, setup_error=f"cannot start the launcher: {exc}")
        finally:
            os.close(report_w)
        try:
            if stdin_pipe and proc.stdin is not None:  # set whenever stdin_pipe (stdin=PIPE)
                with contextlib.suppress(OSError):
                    proc.stdin.write(stdin.encode("utf-8", "replace"))
                    proc.stdin.close()
            try:
                proc.wait(lim.wall_seconds + 30)
            except subprocess.TimeoutExpired:  # the launcher itself hangs: should not happen
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, 9)
                proc.wait()
            with os.fdopen(report_r, "rb") as f:
                raw = f.read()
        finally:
            with contextlib.suppress(OSError):
                if proc.stdin:
                    proc.stdin.close()
        stdout, stderr = _head(out_path, lim.max_output_bytes), _head(err_path, lim.max_output_bytes)
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

    def _python_bind(self) -> tuple[str, str] | None:
        """(prefix, interpreter relative to it) when an unprivileged uid cannot run the
        interpreter where it is (root's home), else None. The prefix is the folder above
        the interpreter's ``bin/``, where its standard library lives too."""
        if _reachable_by_anyone(self.python):
            return None
        real = os.path.realpath(self.python)
        prefix = os.path.dirname(os.path.dirname(real))
        return prefix, os.path.relpath(real, prefix)


# ---------------------------------------------------------------------- helpers


def bwrap_prefix(box: Path, python: str) -> list[str]:
    """bubblewrap's command line before the program's: every namespace new, ``/``
    read-only, a fresh ``/tmp`` (the host's hidden, as at the namespace level) with the
    program's directory bound back read-write, and the interpreter's prefix bound back
    read-only when it lives under ``/tmp`` (a virtual environment there)."""
    binds = ["--ro-bind", "/", "/", "--tmpfs", "/tmp"]
    prefix = os.path.dirname(os.path.dirname(os.path.realpath(python)))
    if prefix == "/tmp" or prefix.startswith("/tmp/"):
        binds += ["--ro-bind", prefix, prefix]
    binds += ["--bind", str(box), str(box)]
    return [shutil.which("bwrap") or "bwrap", "--unshare-all", "--die-with-parent", "--new-session",
            *binds, "--proc", "/proc", "--dev", "/dev", "--chdir", str(box), "--"]  # fmt: skip


@contextlib.contextmanager
def _stdin(control: Path, text: str, pipe: bool) -> Iterator[int | IO[bytes]]:
    if pipe:
        yield subprocess.PIPE
        return
    path = control / "stdin"
    path.write_text(text, encoding="utf-8", errors="replace")
    with open(path, "rb") as f:
        yield f


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
    def take(self) -> Iterator[int]:
        self.directory.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(self.directory)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
            # Someone else made it (the temp dir is shared): its lock files are not ours to trust.
            raise RuntimeError(f"{self.directory} is not a private directory of this user; remove it")
        with self._lock:
            start, self._next = self._next, (self._next + 1) % self.n
        slot, fd = self._lock_one(start)
        try:
            yield slot
        finally:
            os.close(fd)  # releases the lock

    def _lock_one(self, start: int) -> tuple[int, int]:
        """The first free slot from ``start`` on, locked: (slot, its lock file's fd)."""
        for i in range(self.n):
            candidate = (start + i) % self.n
            fd = os.open(self.directory / f"slot-{candidate}", _SLOT_FLAGS, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return candidate, fd
            except BlockingIOError:
                os.close(fd)
        # All busy: queue on one of them.
        fd = os.open(self.directory / f"slot-{start}", _SLOT_FLAGS, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return start, fd


class _JobOptions(TypedDict, total=False):
    stdin: str
    stdin_pipe: bool
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
