"""Runs environments written for the ``verifiers`` library, inside verifiers' own Python.

This file is run by path with the interpreter of a virtual environment that has verifiers
(``.venv-verifiers``, scripts/setup.sh); it imports nothing of forgerl, which is not
installed there (verifiers needs ``openai<3``, forgerl's vLLM build ``openai`` 3). The
``verifiers`` environment (verifiers_env.py) and task (tasks/verifiers_task.py) start it:

``check SPEC``
    Load the environment; print ``{"verifiers": version, "train": n, "eval": m}``.
``serve SPEC``
    Load the environment once, then answer requests, one JSON object per stdin line:
    ``{"id", "base_url", "api_key", "model", "sampling_args", "problem"}`` runs an episode,
    a process of its own forked from this one (the import of verifiers and the environment
    are paid once, not per episode), in a session of its own so that ``{"kill": id}`` ends
    it and whatever it started; ``{"id", "rows": true}`` asks for the dataset rows (the
    ``verifiers`` task's problems), ``{"train": [...], "eval": [...]}``, each
    ``{"prompt": [{"role", "content"}], "answer": str}``. One JSON line per answer on
    stdout: ``{"id", "result": {"reward", "components"}}``, ``{"id", "rows": ...}`` or
    ``{"id", "error": why}``. The first line is ``{"ready": ...}``, or ``{"fatal": why}``
    when the environment does not load. Stdin closing ends it all.

SPEC is JSON: ``{"environment": id, "args": {...}}``. Exit status 3 with a one-line
message on stderr: this Python has no usable verifiers.

One episode is one verifiers rollout, ``env.rollout(row, client, model, sampling_args)``,
with the client pointed at the episode's base URL, scored by ``env.rubric.score_rollout``:
the reward is the rubric's, its components the rubric's metrics.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import math
import os
import selectors
import signal
import sys
import traceback
from typing import Any

#: Exit status: this interpreter has no verifiers with the classic Environment API.
NO_VERIFIERS = 3
#: Error codes of forgerl's endpoint that mean "a limit of the run", not a failure.
LIMIT_CODES = ("episode_call_limit", "context_length_exceeded")
MAX_COMPONENTS = 64
STDERR_TAIL = 4000


def import_verifiers() -> Any:
    try:
        import verifiers as vf  # type: ignore[import-not-found]

        vf.Environment  # noqa: B018 - the classic API (verifiers 0.1-0.3); 0.4 has only verifiers.v1
    except Exception as exc:  # noqa: BLE001 - any failure to import is the same answer
        print(f"this Python ({sys.executable}) has no usable verifiers (classic API, 0.1-0.3): "
              f"{type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(NO_VERIFIERS)
    return vf


def load(spec: dict[str, Any]) -> tuple[Any, Any]:
    """verifiers and the loaded environment; ValueError saying what is wrong with it."""
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    vf = import_verifiers()
    env = vf.load_environment(spec["environment"], **spec.get("args", {}))
    if not isinstance(env, vf.Environment):
        raise ValueError(f"load_environment() of {spec['environment']!r} returned {type(env).__name__}, "
                         "not a verifiers Environment of the classic API (vf.Environment); environments of the "
                         "verifiers.v1 API are not supported")
    if env.rubric.has_group_rewards:
        raise ValueError(f"{spec['environment']!r} has group reward functions; forgerl scores each rollout "
                         "on its own (GRPO groups are the run's), so they are not supported")
    return vf, env


def datasets(env: Any) -> dict[str, Any]:
    """The environment's datasets by split: ``eval`` only where it has one of its own."""
    out = {"train": env.build_dataset()}
    eval_dataset = env.build_eval_dataset()
    if eval_dataset is not None:
        out["eval"] = eval_dataset
    return {k: v for k, v in out.items() if v is not None}


def text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict) and p.get("type") == "text")
    return "" if content is None else str(content)


def row_summary(row: dict[str, Any]) -> dict[str, Any]:
    prompt = row.get("prompt")
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    return {
        "prompt": [{"role": str(m.get("role")), "content": text_of(m.get("content"))} for m in messages
                   if isinstance(m, dict)],
        "answer": "" if row.get("answer") is None else str(row.get("answer")),
    }


def input_row(env: Any, splits: dict[str, Any], spec: dict[str, Any], problem: dict[str, Any]) -> dict[str, Any]:
    """The rollout input for a problem: a row of the environment's own dataset when the
    problem names one (the ``verifiers`` task's problems), else the problem itself, laid out
    as verifiers lays out a dataset row (the environment's system prompt and few-shot
    messages, then the prompt)."""
    metadata = problem.get("metadata") or {}
    ref = metadata.get("verifiers") if isinstance(metadata, dict) else None
    if isinstance(ref, dict):
        if ref.get("environment") != spec["environment"]:
            raise ValueError(f"the problem is a row of {ref.get('environment')!r}'s dataset, but this episode runs "
                             f"{spec['environment']!r}: give the task and the environment the same `environment`")
        dataset = splits.get(str(ref.get("split")))
        index = ref.get("index")
        if dataset is None or not isinstance(index, int) or not 0 <= index < len(dataset):
            raise ValueError(f"the environment has no {ref.get('split')} row {index!r}")
        return dict(dataset[index])
    prompt = problem.get("prompt")
    if isinstance(prompt, list):
        messages = [dict(m) for m in prompt]
        if env.system_prompt and not (messages and messages[0].get("role") == "system"):
            messages.insert(0, {"role": "system", "content": env.system_prompt})
    else:
        messages = [{"role": "system", "content": env.system_prompt}] if env.system_prompt else []
        messages += list(env.few_shot or [])
        messages.append({"role": "user", "content": str(prompt)})
    return {"prompt": messages, "answer": str(problem.get("answer", "")),
            "info": metadata if isinstance(metadata, dict) else {}, "example_id": 0}


class RolloutFailed(Exception):
    """verifiers ended the rollout with an error, or scored it with something not a number."""


def limit_code(error: BaseException | None) -> str | None:
    """The endpoint's limit code anywhere in an error's chain of causes."""
    seen = 0
    while error is not None and seen < 20:
        if getattr(error, "code", None) in LIMIT_CODES:
            return str(error.code)  # type: ignore[attr-defined]
        error, seen = error.__cause__ or error.__context__, seen + 1
    return None


def outcome(vf: Any, env: Any, state: Any) -> dict[str, Any]:
    """The scored rollout as the run takes it; RolloutFailed for one verifiers ended with an
    error that is neither the run's limit nor the model's unusable reply."""
    error = state.get("error")
    if error is not None and limit_code(error) is None and not isinstance(error, vf.InvalidModelResponseError):
        raise RolloutFailed(f"the verifiers rollout ended with an error: {type(error).__name__}: {error}"
                           + (f" (from {type(error.__cause__).__name__}: {error.__cause__})" if error.__cause__ else ""))
    reward = state.get("reward")
    if not isinstance(reward, (int, float)) or isinstance(reward, bool) or not math.isfinite(reward):
        raise RolloutFailed(f"the rubric gave the reward {reward!r}, not a finite number")
    components = {
        str(k)[:200]: float(v) for k, v in sorted((state.get("metrics") or {}).items())
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }
    threshold = getattr(env, "pass_threshold", None)
    if "correct" not in components and isinstance(threshold, (int, float)):
        # The run's held-out accuracy counts a component named `correct`: verifiers' pass@k
        # counts a rollout whose reward reaches the environment's pass_threshold.
        components["correct"] = float(reward >= threshold)
    return {"reward": float(reward), "components": dict(list(components.items())[:MAX_COMPONENTS])}


async def rollout(vf: Any, env: Any, row: dict[str, Any], request: dict[str, Any], spec: dict[str, Any]) -> dict:
    from openai import AsyncOpenAI

    client = vf.OpenAIChatCompletionsClient(
        AsyncOpenAI(base_url=request["base_url"], api_key=request["api_key"], max_retries=0)
    )
    state = await env.rollout(row, client, request["model"], dict(request.get("sampling_args") or {}))
    await env.rubric.score_rollout(state)
    await env.rubric.cleanup(state)
    return outcome(vf, env, state)


# ------------------------------------------------------------------ the episode server


class Child:
    def __init__(self, pid: int, result_fd: int, stderr_fd: int):
        self.pid = pid
        self.fds = {result_fd: bytearray(), stderr_fd: bytearray()}
        self.result_fd, self.stderr_fd = result_fd, stderr_fd


def run_child(vf: Any, env: Any, row: dict[str, Any], request: dict[str, Any], spec: dict[str, Any],
              result_w: int, stderr_w: int) -> None:
    """In the forked episode process: never returns."""
    code = 0
    try:
        os.setsid()  # a session of its own: the server kills it and what it started as one group
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(stderr_w, 1)  # the environment's prints must not reach the server's protocol
        os.dup2(stderr_w, 2)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        result: dict[str, Any] = asyncio.run(rollout(vf, env, row, request, spec))
    except BaseException as exc:  # noqa: BLE001 - the episode's failure, reported as its result
        traceback.print_exc()
        why = str(exc) if isinstance(exc, RolloutFailed) else f"the verifiers environment raised {describe(exc)}"
        result, code = {"error": why}, 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        os.write(result_w, json.dumps(result).encode())
    finally:
        os._exit(code)  # not the server's atexit handlers: they are the server's


def serve(spec: dict[str, Any]) -> None:
    # The answers go to the real stdout; what the environment prints, here or in an episode,
    # goes to stderr, never into them.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    try:
        vf, env = load(spec)
        splits = datasets(env)
    except Exception as exc:  # noqa: BLE001 - any load failure is reported whole
        traceback.print_exc()
        print(json.dumps({"fatal": f"{type(exc).__name__}: {exc}"[:4000]}), file=out, flush=True)
        sys.exit(1)
    print(json.dumps({"ready": {"verifiers": getattr(vf, "__version__", "?"),
                                **{k: len(v) for k, v in splits.items()}}}), file=out, flush=True)

    sel = selectors.DefaultSelector()
    stdin = sys.stdin.fileno()
    sel.register(stdin, selectors.EVENT_READ)
    children: dict[str, Child] = {}
    owner: dict[int, str] = {}
    pending = bytearray()

    def say(message: dict[str, Any]) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    def start(request: dict[str, Any]) -> None:
        episode = str(request["id"])
        try:
            row = input_row(env, splits, spec, request["problem"])
        except Exception as exc:  # noqa: BLE001 - a bad problem fails its episode
            say({"id": episode, "error": f"{type(exc).__name__}: {exc}"})
            return
        result_r, result_w = os.pipe()
        stderr_r, stderr_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            for fd in (result_r, stderr_r, out.fileno(), *owner):  # not the episode's to touch
                os.close(fd)
            run_child(vf, env, row, request, spec, result_w, stderr_w)
        os.close(result_w)
        os.close(stderr_w)
        child = children[episode] = Child(pid, result_r, stderr_r)
        for fd in child.fds:
            owner[fd] = episode
            sel.register(fd, selectors.EVENT_READ)

    def finish(episode: str) -> None:
        child = children.pop(episode)
        done, status = os.waitpid(child.pid, os.WNOHANG)
        kill_group(child.pid)  # whatever it started ends with it (and it, if it lingers)
        if not done:
            _, status = os.waitpid(child.pid, 0)
        for fd in list(child.fds):
            if fd in owner:
                drain_and_close(fd, child.fds[fd])
        tail = bytes(child.fds[child.stderr_fd]).decode("utf-8", "replace").strip()[-STDERR_TAIL:]
        try:
            result = json.loads(bytes(child.fds[child.result_fd]))
        except ValueError:
            why = (f"killed by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
                   else f"exited with status {os.WEXITSTATUS(status)}")
            say({"id": episode, "error": f"the episode's process {why} without a result"
                 + (f"; its stderr ends: {tail}" if tail else "")})
            return
        if "error" in result:  # its own account of it; the traceback is in the server's stderr
            print(tail, file=sys.stderr, flush=True)
            say({"id": episode, "error": str(result["error"])})
        else:
            say({"id": episode, "result": result})

    def drain_and_close(fd: int, buf: bytearray | None = None) -> None:
        """Stop watching ``fd``; what is left in the pipe goes into ``buf`` (without waiting:
        a process that left the episode's session may still hold the pipe open)."""
        sel.unregister(fd)
        owner.pop(fd, None)
        if buf is not None:
            os.set_blocking(fd, False)
            try:
                while chunk := os.read(fd, 1 << 16):
                    buf += chunk
            except BlockingIOError:
                pass
        os.close(fd)

    def handle(line: bytes) -> None:
        try:
            request = json.loads(line)
            if "kill" in request:
                child = children.get(str(request["kill"]))
                if child is not None:
                    kill_group(child.pid)
            elif request.get("rows"):
                say({"id": str(request["id"]),
                     "rows": {k: [row_summary(dict(r)) for r in v] for k, v in splits.items()}})
            else:
                start(request)
        except Exception as exc:  # noqa: BLE001 - a bad request must not end the server
            print(f"forgerl verifiers runner: bad request: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)

    while True:
        for key, _ in sel.select():
            fd = key.fd
            if fd == stdin:
                chunk = os.read(stdin, 1 << 16)
                if not chunk:  # the run is gone: so is everything this server started
                    for child in children.values():
                        kill_group(child.pid)
                    # The atexit handlers (the environment's own teardown: its episodes' never
                    # run it), then out without the interpreter's finalisation of verifiers'
                    # modules, which takes seconds.
                    atexit._run_exitfuncs()
                    os._exit(0)
                pending += chunk
                while b"\n" in pending:
                    line, _, rest = bytes(pending).partition(b"\n")
                    pending[:] = rest
                    if line.strip():
                        handle(line)
                continue
            episode = owner.get(fd)
            if episode is None:
                continue
            child = children[episode]
            chunk = os.read(fd, 1 << 16)
            if chunk:
                buf = child.fds[fd]
                buf += chunk
                if fd == child.stderr_fd and len(buf) > STDERR_TAIL:
                    del buf[: len(buf) - STDERR_TAIL]
                continue
            drain_and_close(fd)
            if fd == child.result_fd:
                finish(episode)  # the episode process has written its result and is exiting


def describe(exc: BaseException) -> str:
    """One line: the exception, where it was raised (file:line, function), what caused it."""
    where = ""
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        last = frames[-1]
        where = f" (at {os.path.basename(last.filename)}:{last.lineno}, in {last.name})"
    text = f"{type(exc).__name__}: {exc}{where}"
    cause = exc.__cause__
    if cause is not None:
        text += f"; caused by {type(cause).__name__}: {cause}"
    return text[:2000]


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[1] not in ("check", "serve"):
        print("usage: verifiers_runner.py {check|serve} SPEC_JSON", file=sys.stderr)
        return 2
    spec = json.loads(argv[2])
    if argv[1] == "serve":
        serve(spec)
        return 0
    try:
        vf, env = load(spec)
        splits = datasets(env)
    except SystemExit:
        raise
    except Exception as exc:  # noqa: BLE001 - reported as one line for the run's error
        traceback.print_exc()
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"verifiers": getattr(vf, "__version__", "?"), **{k: len(v) for k, v in splits.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
