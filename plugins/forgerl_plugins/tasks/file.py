"""The ``file`` task: prompts and reference answers from a JSONL or Parquet file.

Every row becomes a :class:`Problem`: the prompt field (a string or a list of chat
messages), the answer field, an id (the id field when present, else ``file:row``) and the
remaining fields as metadata, which reaches the rewards unchanged. The training rows are
visited in a fresh order every epoch, shuffled from ``(seed, epoch)``, so the position in
the data is two integers and a resumed run sees exactly the rows it would have seen.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field

from forgerl.epochs import EpochCursor
from forgerl.errors import BackendUnavailable, ConfigError
from forgerl.interfaces import Task
from forgerl.options import OptionsModel
from forgerl.types import Problem
from forgerl_plugins.tasks.holdout import hold_out

#: Seeds the choice of held-out rows (eval_fraction); fixed so every run seed holds out the same rows.
EVAL_SEED = 20250101

PARQUET_SUFFIXES = (".parquet", ".pq")

#: The pre-flight check reads files up to this size whole, exactly as the run will; of
#: larger ones it reads the first rows only (the rest is checked when the run loads them).
PREFLIGHT_READ_WHOLE_BYTES = 64 * 2**20


class FileTask(Task):
    name = "file"
    description = "prompts and answers from a JSONL or Parquet file"

    class Options(OptionsModel):
        path: str = Field(
            min_length=1, description="JSONL (one object per line) or Parquet (.parquet) file of problems."
        )
        eval_path: str | None = Field(
            None, description="Held-out problems; without it, eval_fraction of path."
        )
        prompt_field: str = Field("prompt", description="Field holding a string or a list of chat messages.")
        answer_field: str | None = Field(
            "answer", description="Field holding the reference; None: no answers."
        )
        id_field: str = Field("id", description="Field holding a problem id, when present (else file:row).")
        eval_fraction: float = Field(0.1, ge=0, lt=1, description="Share of path held out when no eval_path.")
        system_prompt: str | None = Field(None, description="System message put before every prompt.")
        format: str = Field(
            "qa",
            pattern="^(qa|code)$",
            description="qa: prompt and answer; code: prompt and tests for the code reward (docs/rewards.md).",
        )

    @staticmethod
    def preflight(options: FileTask.Options) -> None:
        check_files(options)

    def __init__(self, options: Options, *, seed: int = 0):
        self.options = options
        self.seed = int(seed)
        rows = self._rows(options)
        problems = [self._problem(row, options.path, i) for i, row in enumerate(rows)]
        if options.eval_path:
            eval_rows = read_rows(Path(options.eval_path))
            self._eval = [self._problem(row, options.eval_path, i) for i, row in enumerate(eval_rows)]
            self._train = problems
        else:
            self._train, self._eval = _split(problems, options.eval_fraction, options.path)
        if not self._train:
            raise ConfigError(f"task file: {options.path} has no problems to train on")
        self.cursor = EpochCursor(len(self._train), self.seed, "file")

    # ------------------------------------------------------------------ Task

    def next_problems(self, n: int) -> list[Problem]:
        return [self._train[i] for i in self.cursor.take(n)]

    def eval_problems(self) -> list[Problem]:
        return list(self._eval)

    def state_dict(self) -> dict[str, Any]:
        c = self.cursor
        return {"epoch": c.epoch, "position": c.position, "seed": self.seed, "size": len(self._train)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "seed" in state and int(state["seed"]) != self.seed:
            raise ConfigError(
                f"task file: the saved state is for seed {state['seed']}, this run uses seed {self.seed}"
            )
        if "size" in state and int(state["size"]) != len(self._train):
            # A different file (or split) makes the saved position meaningless.
            raise ConfigError(
                f"task file: the saved state is for {state['size']} training problems, "
                f"{self.options.path} now gives {len(self._train)}; the file changed since the checkpoint"
            )
        self.cursor.restore(state["epoch"], state["position"])

    @property
    def train_size(self) -> int:
        return len(self._train)

    # ------------------------------------------------------------- helpers

    def _rows(self, options: FileTask.Options) -> list[dict[str, Any]]:
        return read_rows(Path(options.path))

    def _problem(self, row: Mapping[str, Any], source: str, index: int) -> Problem:
        return problem_from_row(self.options, row, source, index)


def problem_from_row(o: FileTask.Options, row: Mapping[str, Any], source: str, index: int) -> Problem:
    """Row ``index`` of ``source`` as a Problem; ConfigError when a configured field is missing."""
    where = f"{source} row {index + 1}"
    if o.prompt_field not in row:
        raise ConfigError(
            f"{where}: no field {o.prompt_field!r} (fields: {', '.join(map(str, row)) or 'none'}); "
            "set task.options.prompt_field"
        )
    prompt = _chat(row[o.prompt_field], o.system_prompt, where, o.prompt_field)
    if o.format == "code":
        return _code_problem(o, row, where, source, index, prompt)
    answer = ""
    if o.answer_field is not None:
        if o.answer_field not in row or row[o.answer_field] is None:
            raise ConfigError(
                f"{where}: no field {o.answer_field!r} (fields: {', '.join(map(str, row))}); "
                "set task.options.answer_field, or answer_field: null for rewards that need no answer"
            )
        answer = str(row[o.answer_field])
    problem_id = str(row[o.id_field]) if row.get(o.id_field) is not None else f"{Path(source).name}:{index}"
    used = {o.prompt_field, o.answer_field, o.id_field}
    metadata = {k: v for k, v in row.items() if k not in used}
    return Problem(id=problem_id, prompt=prompt, answer=answer, metadata=metadata)


def _code_problem(
    o: FileTask.Options,
    row: Mapping[str, Any],
    where: str,
    source: str,
    index: int,
    prompt: list[dict[str, str]],
) -> Problem:
    """A ``format: code`` row: the tests travel in the metadata (for the code reward), the
    reference solution (optional field ``solution``) is the answer."""
    tests, stdio = row.get("tests"), row.get("stdio")
    if stdio is not None:
        if not (
            isinstance(stdio, list) and stdio and all(isinstance(c, Mapping) and "output" in c for c in stdio)
        ):
            raise ConfigError(f'{where}: "stdio" must be a non-empty list of {{"input", "output"}} cases')
    elif isinstance(tests, str):
        if not row.get("entry_point"):
            raise ConfigError(
                f'{where}: "tests" as check(candidate) code needs an "entry_point" (the function)'
            )
    elif not (isinstance(tests, list) and tests and all(isinstance(t, str) for t in tests)):
        raise ConfigError(
            f'{where}: a code problem needs "tests" (a list of assert statements, or check(candidate) code '
            'with "entry_point") or "stdio" (input/output cases)'
        )
    problem_id = str(row[o.id_field]) if row.get(o.id_field) is not None else f"{Path(source).name}:{index}"
    metadata = {k: v for k, v in row.items() if k not in (o.prompt_field, o.id_field, "solution")}
    return Problem(id=problem_id, prompt=prompt, answer=str(row.get("solution") or ""), metadata=metadata)


def _chat(value: Any, system_prompt: str | None, where: str, field: str) -> list[dict[str, str]]:
    if isinstance(value, str):
        messages = [{"role": "user", "content": value}]
    elif isinstance(value, list) and value:
        messages = []
        for m in value:
            if not (
                isinstance(m, Mapping)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
            ):
                raise ConfigError(
                    f'{where}: {field!r} must be a string or a list of {{"role", "content"}} messages; '
                    f"got the item {m!r}"
                )
            messages.append({"role": m["role"], "content": m["content"]})
    else:
        raise ConfigError(
            f"{where}: {field!r} must be a string or a non-empty list of chat messages, not {value!r:.80}"
        )
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def _split(problems: list[Problem], fraction: float, source: str) -> tuple[list[Problem], list[Problem]]:
    too_few = (f"task file: {source} has {{n}} problem(s), too few to hold out eval_fraction={{fraction}}; "
               "add rows, give eval_path, or set eval_fraction: 0")  # fmt: skip
    return hold_out(problems, fraction, f"file:eval:{EVAL_SEED}", too_few)


# ------------------------------------------------------------------ pre-flight


def check_files(options: FileTask.Options) -> None:
    """What ``forge run`` checks before it creates the run directory: the files exist, are
    readable, non-empty regular files, and their rows have the configured fields. Small
    files are loaded whole (every row, the eval split), large ones by their first rows."""
    paths = [Path(options.path)] + ([Path(options.eval_path)] if options.eval_path else [])
    sizes = [_checked_file(p) for p in paths]
    if sum(sizes) <= PREFLIGHT_READ_WHOLE_BYTES:
        FileTask(options)
        return
    for path in paths:
        for i, row in enumerate(_first_rows(path, 16)):
            problem_from_row(options, row, str(path), i)


def _checked_file(path: Path) -> int:
    """The size of ``path``; ConfigError when it is missing, not a regular file or empty."""
    try:
        if not path.exists():
            raise ConfigError(f"task file {str(path)!r} does not exist (cwd: {Path.cwd()})")
        if not path.is_file():
            raise ConfigError(f"task file {str(path)!r} is not a regular file")
        size = path.stat().st_size
        with path.open("rb"):
            pass
    except OSError as exc:
        raise ConfigError(f"cannot read task file {str(path)!r}: {exc.strerror or exc}") from None
    except ValueError as exc:  # a NUL byte in the path
        raise ConfigError(f"task file {str(path)!r}: {exc}") from None
    if size == 0:
        raise ConfigError(
            f"task file {str(path)!r} is empty; it needs one problem per line (JSONL) or .parquet"
        )
    return size


def _first_rows(path: Path, n: int) -> list[dict[str, Any]]:
    if path.suffix.lower() in PARQUET_SUFFIXES:
        return _read_parquet(path)[:n]  # pyarrow has no cheap partial read of a row group
    rows: list[dict[str, Any]] = []
    try:
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if line.strip():
                    rows.append(_jsonl_row(path, lineno, line))
                if len(rows) >= n:
                    break
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason}); JSONL or .parquet expected") from None
    except OSError as exc:
        raise ConfigError(f"cannot read task file {str(path)!r}: {exc.strerror or exc}") from None
    if not rows:
        raise ConfigError(f"task file {str(path)!r} has no rows (only blank lines)")
    return rows


# ------------------------------------------------------------------ reading files


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSONL or Parquet file, as dicts; ConfigError on anything unreadable."""
    if not path.exists():
        raise ConfigError(f"task file {str(path)!r} does not exist (cwd: {Path.cwd()})")
    if not path.is_file():
        raise ConfigError(f"task file {str(path)!r} is not a file")
    rows = _read_parquet(path) if path.suffix.lower() in PARQUET_SUFFIXES else _read_jsonl(path)
    if not rows:
        raise ConfigError(f"task file {str(path)!r} has no rows (it is empty or only blank lines)")
    return rows


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    try:
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if line.strip():
                    rows.append(_jsonl_row(path, lineno, line))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason}); JSONL or .parquet expected") from None
    except OSError as exc:
        raise ConfigError(f"cannot read task file {str(path)!r}: {exc.strerror or exc}") from None
    return rows


def _jsonl_row(path: Path, lineno: int, line: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, RecursionError) as exc:
        hint = " (expected JSON Lines: one object per line)" if path.suffix.lower() == ".json" else ""
        msg = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
        raise ConfigError(f"{path}:{lineno}: not valid JSON: {msg}{hint}") from None
    if not isinstance(row, dict):
        raise ConfigError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
    return row


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise BackendUnavailable(
            f"task file: reading {path.name} needs pyarrow: pip install 'forgerl[parquet]'"
        ) from None
    try:
        return pq.read_table(path).to_pylist()
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise ConfigError(f"{path}: not a readable Parquet file ({type(exc).__name__}: {exc})") from None
