"""forgerl's side of the verifiers runner (verifiers_runner.py): which Python runs it, the
check before a run, and the server that the ``verifiers`` task asks for dataset rows and
the ``verifiers`` environment sends its episodes to.

verifiers lives in a virtual environment of its own (.venv-verifiers: a hundred packages
the training environment must not take on; verifiers 0.4 even needs ``openai<3`` where
vLLM's build here pins ``openai`` 3), so forgerl never imports it: the runner is started
with that environment's Python. One server per process and source (:func:`worker_for`)
loads the verifiers environment once and forks a process per episode: importing verifiers
takes seconds of CPU (4-5 s here), paid once per run, not per episode.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import json
import logging
import os
import signal
import subprocess
import threading
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field

from forgerl.configuration.limits import MAX_SECONDS
from forgerl.errors import ConfigError
from forgerl.options import OptionsModel

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.rollouts.agent_runner import AgentEpisode

log = logging.getLogger("forgerl.environment.verifiers")

RUNNER = Path(__file__).resolve().with_name("verifiers_runner.py")
#: Where scripts/setup.sh builds verifiers' environment: the checkout's root.
DEFAULT_PYTHON = Path(__file__).resolve().parents[3] / ".venv-verifiers" / "bin" / "python"
CONSTRAINTS = "scripts/verifiers-constraints.txt"
#: verifiers_runner.NO_VERIFIERS: the Python has no usable verifiers.
NO_VERIFIERS = 3
STDERR_LINES = 40
HOW_TO_BUILD = (
    "build it with `bash scripts/setup.sh` (it makes .venv-verifiers at the checkout's root), or point "
    f"options.python at a Python 3.11+ with `pip install -c {CONSTRAINTS} verifiers`"
)


class VerifiersSource(OptionsModel):
    """Which verifiers environment, and the Python that runs it (the ``verifiers``
    environment's and task's options)."""

    environment: str = Field(
        min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_][\w.\-/]*$",
        description="The verifiers environment: the id verifiers' load_environment takes (a module, e.g. "
        "\"my-env\" imports my_env, or \"org/my-env\"), whose load_environment(**args) returns a vf.Environment.",
    )
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of load_environment (JSON).")
    python: str | None = Field(
        None, description="Python of the virtual environment that has verifiers (default: .venv-verifiers/bin/python "
        "at the checkout's root, which scripts/setup.sh builds).",
    )
    pythonpath: list[str] = Field(
        default_factory=list, description="Directories searched for the environment's module (the runner's "
        "PYTHONPATH; the run's own is not passed on).",
    )
    env: dict[str, str] = Field(default_factory=dict, description="More environment variables for the runner.")
    load_timeout: float = Field(
        300.0, gt=0, le=MAX_SECONDS, description="Seconds importing verifiers and loading the environment may take.",
    )

    def interpreter(self) -> str:
        return self.python or str(DEFAULT_PYTHON)

    def spec(self) -> str:
        return json.dumps({"environment": self.environment, "args": self.args}, sort_keys=True)

    def process_env(self) -> dict[str, str]:
        """The runner's environment: the run's, less what would point verifiers' Python at
        forgerl's packages, plus ``env`` and ``pythonpath``."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env.update(self.env)
        paths = [str(Path(p).resolve()) for p in self.pythonpath]
        if paths:
            env["PYTHONPATH"] = os.pathsep.join(paths)
        return env


def where_searched(source: VerifiersSource, key: str) -> str:
    """Where the runner looks for the environment's module, naming the option (``key``:
    ``task.options`` or ``environment.options``) that adds a directory."""
    given = ", ".join(source.pythonpath) if source.pythonpath else "none given"
    return (f"its module is looked for in the packages of {source.interpreter()} and in {key}.pythonpath "
            f"({given}); the verifiers task and environment each read their own options, so a directory "
            "goes into both")


def run_check(source: VerifiersSource, what: str, key: str) -> Any:
    """``verifiers_runner.py check SPEC`` to its end; its JSON output, or ConfigError (one
    line) saying what to do: build the environment, or fix the verifiers environment.
    ``key``: where the options are in the config (``task.options``), for the message."""
    python = source.interpreter()
    if not Path(python).is_file():
        raise ConfigError(f"{what}: {python} does not exist (options.python): {HOW_TO_BUILD}")
    try:
        proc = subprocess.run(
            [python, str(RUNNER), "check", source.spec()], capture_output=True, text=True, env=source.process_env(),
            timeout=source.load_timeout, stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{what}: loading {source.environment!r} took more than {source.load_timeout:g} s "
                          "(options.load_timeout)") from None
    except OSError as exc:
        raise ConfigError(f"{what}: cannot run {python}: {exc}; {HOW_TO_BUILD}") from None
    last = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
    if proc.returncode == NO_VERIFIERS:
        raise ConfigError(f"{what}: {last}; {HOW_TO_BUILD}")
    if proc.returncode != 0:
        raise ConfigError(f"{what}: the verifiers environment {source.environment!r} does not load: {last} "
                          f"({where_searched(source, key)})")
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise ConfigError(f"{what}: the verifiers runner printed no result (its stderr ends: {last})") from None


_CHECKED: dict[str, Any] = {}
_CHECKED_LOCK = threading.Lock()


def check(source: VerifiersSource, what: str, key: str) -> dict[str, Any]:
    """Before a run: the Python has verifiers and the environment loads (once per process
    and source: the task and the environment of one run share the answer). ``key``: where
    the options are in the config (``task.options``), for the message."""
    cached = json.dumps([source.interpreter(), source.spec(), source.pythonpath, source.env], sort_keys=True)
    with _CHECKED_LOCK:
        if cached not in _CHECKED:
            _CHECKED[cached] = run_check(source, what, key)
        return dict(_CHECKED[cached])


# ------------------------------------------------------------------ the episode server


class VerifiersWorker:
    """One ``serve`` process of the runner: episodes go in as JSON lines on its stdin,
    results come back on its stdout, read by a thread of this process; an episode whose
    caller is cancelled (its deadline) is killed there."""

    def __init__(self, source: VerifiersSource, spec: str):
        self.source = source
        self.ready: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        self._pending: dict[str, concurrent.futures.Future[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._stderr: collections.deque[str] = collections.deque(maxlen=STDERR_LINES)
        self.dead: str | None = None
        self.proc = subprocess.Popen(
            [source.interpreter(), str(RUNNER), "serve", spec], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, env=source.process_env(), start_new_session=True,
        )
        threading.Thread(target=self._read_stderr, name="forge-verifiers-stderr", daemon=True).start()
        threading.Thread(target=self._read_results, name="forge-verifiers-results", daemon=True).start()
        self._load_timer = threading.Timer(source.load_timeout, self._load_timed_out)
        self._load_timer.daemon = True
        self._load_timer.start()

    def stderr_tail(self) -> str:
        return "\n".join(self._stderr)[-2000:]

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None, "started with a pipe"
        for raw in self.proc.stderr:
            line = raw.decode("utf-8", "replace").rstrip()
            self._stderr.append(line)
            log.debug("verifiers runner: %s", line)

    def _read_results(self) -> None:
        assert self.proc.stdout is not None, "started with a pipe"
        for raw in self.proc.stdout:
            try:
                message = json.loads(raw)
            except ValueError:
                log.warning("verifiers runner: not a result: %r", raw[:200])
                continue
            if "ready" in message:
                self._load_timer.cancel()
                _settle(self.ready, result=message["ready"])
            elif "fatal" in message:
                _settle(self.ready, error=RuntimeError(f"the verifiers environment {self.source.environment!r} "
                                                       f"does not load: {message['fatal']}"))
            else:
                with self._lock:
                    future = self._pending.pop(str(message.get("id")), None)
                if future is not None:
                    _settle(future, result=message)
        code = self.proc.wait()
        self._load_timer.cancel()
        tail = self.stderr_tail()
        why = f"the verifiers runner exited with status {code}" + (f"; its stderr ends: {tail}" if tail else "")
        with self._lock:
            self.dead = why
            pending, self._pending = self._pending, {}
        _settle(self.ready, error=RuntimeError(why))
        for future in pending.values():
            _settle(future, error=RuntimeError(why))

    def _load_timed_out(self) -> None:
        _settle(self.ready, error=RuntimeError(
            f"the verifiers environment {self.source.environment!r} did not load within "
            f"{self.source.load_timeout:g} s (options.load_timeout)"))
        self.close()

    def failed(self) -> bool:
        """Dead, or its start failed: the next episode starts a new one."""
        return self.dead is not None or (self.ready.done() and self.ready.exception() is not None)

    def _send(self, message: dict[str, Any]) -> None:
        line = (json.dumps(message, default=str) + "\n").encode()
        with self._lock:
            if self.dead is not None:
                raise RuntimeError(self.dead)
            assert self.proc.stdin is not None, "started with a pipe"
            try:
                self.proc.stdin.write(line)
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError, OSError) as exc:
                raise RuntimeError(f"the verifiers runner is gone: {exc}") from None

    def rows(self) -> dict[str, list[dict[str, Any]]]:
        """The environment's dataset rows by split (waits for the server's start)."""
        self.ready.result()
        future: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        request_id = uuid.uuid4().hex
        with self._lock:
            if self.dead is not None:
                raise RuntimeError(self.dead)
            self._pending[request_id] = future
        self._send({"id": request_id, "rows": True})
        message = future.result()
        if "error" in message:
            raise RuntimeError(str(message["error"]))
        return dict(message["rows"])

    async def run(self, episode: AgentEpisode, sampling_args: dict[str, Any]) -> Any:
        """The episode's reward, ``{"reward", "components"}``; RuntimeError with the reason
        when the verifiers environment failed it. Cancelled: the episode's process is killed."""
        await asyncio.shield(asyncio.wrap_future(self.ready))  # one start, shared: a cancelled waiter leaves it
        episode_id = uuid.uuid4().hex
        future: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        with self._lock:
            if self.dead is not None:
                raise RuntimeError(self.dead)
            self._pending[episode_id] = future
        request = {"id": episode_id, "base_url": episode.base_url, "api_key": episode.api_key,
                   "model": episode.model, "sampling_args": sampling_args, "problem": episode.problem_json()}
        try:
            # Written here, not from a thread: a kill sent on cancellation must follow it.
            self._send(request)
            message = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            try:
                self._send({"kill": episode_id})
            except RuntimeError:
                pass  # the runner is gone, and its episodes with it
            raise
        finally:
            with self._lock:
                self._pending.pop(episode_id, None)
        if "error" in message:
            raise RuntimeError(str(message["error"]))
        return message.get("result")

    def close(self) -> None:
        """End the server and every episode process it forked (its stdin closing ends it;
        killing its session group is the backstop)."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _settle(future: concurrent.futures.Future[Any], *, result: Any = None, error: BaseException | None = None) -> None:
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass  # settled already, or cancelled by its waiter


_WORKERS: dict[str, VerifiersWorker] = {}
_WORKERS_LOCK = threading.Lock()


def worker_for(options: VerifiersSource) -> VerifiersWorker:
    """The running server for this source (one per process and source, shared by the
    ``verifiers`` task and environment of a run; started on first use and again after it
    died; its start is awaited by :meth:`VerifiersWorker.run`)."""
    source = VerifiersSource.model_validate(options.model_dump(include=set(VerifiersSource.model_fields)))
    key = source.model_dump_json()
    with _WORKERS_LOCK:
        worker = _WORKERS.get(key)
        if worker is None or worker.failed():
            if worker is not None:
                worker.close()
            worker = _WORKERS[key] = VerifiersWorker(source, source.spec())
        return worker


@atexit.register
def close_workers() -> None:
    """End every server (at exit, and for tests)."""
    with _WORKERS_LOCK:
        workers = list(_WORKERS.values())
        _WORKERS.clear()
    for worker in workers:
        worker.close()
