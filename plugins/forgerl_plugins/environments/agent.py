"""The ``agent`` environment: an existing agent program, unmodified, as the rollout.

Per episode the run starts the agent named in the options and gives it a base URL of its
OpenAI-compatible endpoint and the run's key (forgerl.rollouts.agent_runner); the agent's calls are
its trajectory. Two ways to name it:

- ``entry: "package.module:function"``: a Python function called once per episode with an
  :class:`~forgerl.rollouts.agent_runner.AgentEpisode` (``base_url``, ``api_key``, ``problem``,
  ``model``, ``timeout``). A plain function runs on a thread of its own (abandoned at the
  deadline: a thread cannot be killed); an ``async def`` runs on an event loop of its own
  in such a thread (cancelled at the deadline). It returns the reward (a number, None, or
  ``{"reward": ..., "components": {...}}``).
- ``command: [...]``: a process per episode, started without a shell, with
  ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` in its environment (what the official OpenAI
  clients read), the problem as one line of JSON on stdin (``id``, ``prompt``, ``answer``,
  ``metadata``). Its reward, if it gives one: the last line of its stdout, as JSON (a
  number, null, or the object above); logs go to stderr. It is killed (its whole process
  group) at the deadline. Exiting non-zero fails its trajectory.
"""

from __future__ import annotations

import asyncio
import atexit
import importlib
import inspect
import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from forgerl.errors import ConfigError
from forgerl.rollouts.agent_runner import AgentEnvironment, AgentEpisode
from forgerl.rollouts.bounded import call_bounded
from forgerl.rollouts.trajectory import GarbageError

#: Bytes kept of the end of a command agent's stdout (its last line is the reward) and of
#: its stderr (for the failure record).
MAX_STDOUT = 64 << 10
MAX_STDERR_TAIL = 4000


class AgentProgram(AgentEnvironment):
    """an agent program (a Python function or a command) calling the run's OpenAI-compatible endpoint"""

    name = "agent"

    class Options(AgentEnvironment.Options):
        entry: str | None = Field(
            None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$",
            description='The agent as a Python function, "package.module:function", called per episode with an '
            "AgentEpisode (base_url, api_key, problem, model, timeout); returns the reward or None.",
        )
        command: list[str] | None = Field(
            None, min_length=1, description="The agent as a command, run per episode with OPENAI_BASE_URL and "
            "OPENAI_API_KEY set and the problem as JSON on stdin; its reward, if any, is the last line of its stdout.",
        )
        cwd: str | None = Field(None, description="Working directory of the command (default: the run's).")
        env: dict[str, str] = Field(default_factory=dict, description="More environment variables for the command.")

        @model_validator(mode="after")
        def _one_agent(self) -> AgentProgram.Options:
            if (self.entry is None) == (self.command is None):
                raise ValueError("name the agent with exactly one of entry (a Python function) and command")
            return self

    @staticmethod
    def local_preflight(options: AgentProgram.Options) -> None:
        """Where the run's processes start here: the function imports, the command exists."""
        if options.entry is not None:
            _load_entry(options.entry)
            return
        assert options.command is not None, "one of entry and command is set"
        if options.cwd is not None and not Path(options.cwd).is_dir():
            raise ConfigError(f"environment agent: options.cwd {options.cwd!r} is not a directory")
        program = options.command[0]
        found = (Path(options.cwd or ".") / program).is_file() if os.sep in program else shutil.which(program)
        if not found:
            raise ConfigError(f"environment agent: the command {program!r} (options.command) is not found")

    def __init__(self, options: Options):
        self.options = options
        self.entry = _load_entry(options.entry) if options.entry is not None else None

    async def run_episode(self, episode: AgentEpisode) -> Any:
        if self.entry is not None:
            return await _call_entry(self.entry, episode)
        return await self._run_command(episode)

    async def _run_command(self, episode: AgentEpisode) -> Any:
        assert self.options.command is not None, "a command agent has its command"
        env = {**os.environ, **self.options.env, "OPENAI_BASE_URL": episode.base_url,
               "OPENAI_API_KEY": episode.api_key}
        proc = await asyncio.create_subprocess_exec(
            *self.options.command, cwd=self.options.cwd, env=env, start_new_session=True,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        _LIVE.add(proc.pid)
        try:
            stdin = (json.dumps(episode.problem_json(), default=str) + "\n").encode()
            out, err = await asyncio.gather(_feed_and_read(proc, stdin), _tail(proc.stderr, MAX_STDERR_TAIL))
            code = await proc.wait()
        finally:
            # At the deadline (cancelled), or after it exited: nothing it started outlives the episode.
            _kill_group(proc.pid)
            _LIVE.discard(proc.pid)
            if proc.returncode is None:
                try:
                    await asyncio.wait_for(proc.wait(), 5)  # reaped, not left a zombie
                except (asyncio.TimeoutError, asyncio.CancelledError):
                    pass
        if code != 0:
            tail = err.decode("utf-8", "replace").strip()[-MAX_STDERR_TAIL:]
            raise RuntimeError(f"the agent command exited with status {code}" + (f"; its stderr ends: {tail}" if tail else ""))
        lines = [line for line in out.decode("utf-8", "replace").splitlines() if line.strip()]
        if not lines:
            return None
        try:
            return json.loads(lines[-1])
        except (ValueError, RecursionError):
            raise GarbageError(
                f"the last line of the agent's stdout is not JSON: {lines[-1][:200]!r} (print the reward as JSON "
                "last, logs to stderr)"
            ) from None

    def close(self) -> None:
        """Nothing held between episodes: each process ends with its episode."""


def _load_entry(ref: str) -> Any:
    module_name, _, attr = ref.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to fix
        raise ConfigError(f"environment agent: entry {ref!r} cannot be imported: {type(exc).__name__}: {exc}") from None
    if not callable(obj):
        raise ConfigError(f"environment agent: entry {ref!r} is a {type(obj).__name__}, not a function")
    return obj


async def _call_entry(fn: Any, episode: AgentEpisode) -> Any:
    """``fn(episode)`` on a thread of its own: a blocking agent (the sync OpenAI client)
    never holds the run's event loops. A coroutine it returns (an ``async def``) runs on a
    new event loop in that thread, and is cancelled there when this call is."""
    holder: dict[str, Any] = {}

    def run() -> Any:
        result = fn(episode)
        if not inspect.iscoroutine(result):
            return result

        async def main() -> Any:
            holder["loop"], holder["task"] = asyncio.get_running_loop(), asyncio.current_task()
            return await result

        return asyncio.run(main())

    try:
        # The episode's deadline is the runner's (it cancels this call); this one is a backstop.
        return await call_bounded(run, timeout=episode.timeout + 60, what="agent")
    except asyncio.CancelledError:
        if "task" in holder:
            try:
                holder["loop"].call_soon_threadsafe(holder["task"].cancel)
            except RuntimeError:  # its loop already ended
                pass
        raise


async def _feed_and_read(proc: asyncio.subprocess.Process, stdin: bytes) -> bytes:
    assert proc.stdin is not None and proc.stdout is not None, "started with pipes"
    try:
        proc.stdin.write(stdin)
        await proc.stdin.drain()
        proc.stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # an agent that does not read its problem
    return await _tail(proc.stdout, MAX_STDOUT)


async def _tail(stream: asyncio.StreamReader | None, limit: int) -> bytes:
    """The last ``limit`` bytes of the stream; the rest is read and dropped (a flooding
    agent neither blocks on a full pipe nor fills the run's memory)."""
    kept = bytearray()
    if stream is not None:
        while chunk := await stream.read(65536):
            kept += chunk
            if len(kept) > limit:
                del kept[: len(kept) - limit]
    return bytes(kept)


#: Process groups of running command agents, killed if the run exits with them running.
_LIVE: set[int] = set()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@atexit.register
def _kill_leftovers() -> None:
    for pid in list(_LIVE):
        _kill_group(pid)
