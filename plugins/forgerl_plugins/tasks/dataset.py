"""The ``dataset`` task: problems from a dataset, by file, folder or name, with a column
mapping (docs/data.md).

Rows come from :mod:`forgerl_plugins.tasks.dataset_reading` (JSONL, Parquet, CSV, a
``save_to_disk`` folder, a folder of data files, a Hugging Face dataset in the local cache).
Each row becomes a :class:`Problem` through ``columns``: a prompt column (text, optionally
put through ``prompt_template``) or a messages column (a chat), an answer, an id, and the
metadata the rewards see. Dataset content is untrusted: every value is type-checked, and a
wrong column, split or type is one line naming what exists, before the run starts.

Two ways to go through the training rows, both resumable exactly:

- in memory (the default): every row is read and checked at start; each epoch visits them
  in a fresh order shuffled from ``(seed, epoch)``; the position is two integers;
- ``streaming: true``: rows are read as they are consumed, in stored order or through a
  seeded shuffle buffer; the position is the epoch and the rows taken in it, and a resumed
  run re-reads the epoch up to there (replaying the same buffer) and continues at the same row.
"""

from __future__ import annotations

import math
import random
import string
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from forgerl.epochs import EpochCursor
from forgerl.errors import ConfigError, ImageError
from forgerl.images import image_references
from forgerl.interfaces import Task
from forgerl.options import OptionsModel
from forgerl.types import Problem
from forgerl_plugins.tasks.holdout import hold_out

from .dataset_reading import Where, iter_rows, read_all

#: Text that tokenizers use as a beginning-of-sequence token. A prompt that starts with
#: one gets a second from the chat template or the tokenizer (NeMo-RL #855): refused.
BOS_MARKERS = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>", "<|endoftext|>", "[CLS]")

#: Rows the pre-flight check reads of a streamed dataset (the run checks the rest as it reads).
PREFLIGHT_STREAM_ROWS = 16


class Columns(OptionsModel):
    """Which column holds what. A column that is configured but missing is an error that
    lists the columns the dataset has."""

    prompt: str | None = Field("prompt", description="Column of the prompt text (a string).")
    messages: str | None = Field(
        None, description='Column of a chat (a list of {"role", "content"}), instead of prompt.'
    )
    answer: str | None = Field("answer", description="Column of the reference answer; null: no answers.")
    images: str | None = Field(
        None,
        description="Column of the prompt's images: one reference or a list (a data URL or a file path, relative "
        "to the dataset's folder), put before the prompt text in the user message (docs/vision.md).",
    )
    id: str | None = Field(None, description="Column of a problem id; null: `<source>:<row>`.")
    metadata: list[str] | None = Field(
        None, description="Columns passed to the rewards as metadata; null: every column not mapped above."
    )

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> Columns:
        if self.messages is not None:
            # prompt keeps its default unless given: with messages, a prompt other than the
            # default is a second answer to one question (the default one is dropped).
            if self.prompt is not None and (self.prompt != "prompt" or "prompt" in self.model_fields_set):
                raise ValueError("give columns.prompt or columns.messages, not both")
            self.prompt = None
        elif self.prompt is None:
            raise ValueError("columns.prompt or columns.messages must name a column")
        return self


class DatasetTask(Task):
    name = "dataset"
    description = (
        "problems from a dataset: JSONL, Parquet, CSV, a save_to_disk folder or a cached Hugging Face name"
    )

    class Options(OptionsModel):
        path: str | None = Field(
            None,
            description="A .jsonl, .parquet or .csv file, a save_to_disk folder or a folder of data files.",
        )
        name: str | None = Field(
            None, description="A Hugging Face dataset name, read from the local cache (never downloaded)."
        )
        config: str | None = Field(None, description="The dataset's configuration (subset) name, with name.")
        # None rather than "train": a split named for a file is refused, and only None says
        # "not named" once the options have travelled to the trainer (model_fields_set does not).
        split: str | None = Field(
            None, min_length=1, description="The split to train on; none: `train` (datasets with splits)."
        )
        format: str = Field(
            "auto", pattern="^(auto|jsonl|parquet|csv)$", description="File format; auto: from the suffix."
        )
        columns: Columns = Field(default_factory=Columns, description="Column mapping (docs/data.md).")
        prompt_template: str | None = Field(
            None, description="Template of the prompt text: {prompt} and any {column} of the row."
        )
        system_prompt: str | None = Field(
            None, description="System message before every prompt (chat_template only)."
        )
        chat_template: bool = Field(
            True,
            description="true: the prompt is a chat and the model's chat template writes the special tokens; "
            "false: the text is tokenized as is, with the tokenizer's own BOS.",
        )
        eval_split: str | None = Field(None, description="Held-out problems: this split of the same dataset.")
        eval_path: str | None = Field(
            None, description="Held-out problems: this file or folder (same columns)."
        )
        eval_fraction: float = Field(
            0.0,
            ge=0,
            lt=1,
            description="Held-out problems: this share of the training rows, chosen with eval_seed.",
        )
        eval_seed: int = Field(
            20250101, description="Seed of the eval_fraction choice (the same for every run seed)."
        )
        streaming: bool = Field(
            False, description="Read rows as they are consumed (data larger than memory)."
        )
        shuffle_buffer: int = Field(
            0,
            ge=0,
            le=10_000_000,
            description="Streaming: rows in the seeded shuffle buffer; 0: stored order.",
        )

        @model_validator(mode="after")
        def _consistent(self) -> DatasetTask.Options:
            if (self.path is None) == (self.name is None):
                raise ValueError(
                    "give exactly one of path (a file or folder) and name (a cached Hugging Face dataset)"
                )
            if self.config is not None and self.name is None:
                raise ValueError("config goes with name (a Hugging Face dataset's configuration)")
            held = [k for k in ("eval_split", "eval_path") if getattr(self, k) is not None]
            held += ["eval_fraction"] if self.eval_fraction > 0 else []
            if len(held) > 1:
                raise ValueError(f"name the held-out problems one way, not {' and '.join(held)}")
            if self.streaming and self.eval_fraction > 0:
                raise ValueError(
                    "eval_fraction needs every row in memory; with streaming, name the held-out rows "
                    "(eval_split or eval_path)"
                )
            if self.shuffle_buffer and not self.streaming:
                raise ValueError(
                    "shuffle_buffer is for streaming: true (in memory, every epoch is shuffled whole)"
                )
            if not self.chat_template:
                if self.columns.messages is not None:
                    raise ValueError("columns.messages is a chat: it needs chat_template: true")
                if self.system_prompt is not None:
                    raise ValueError("system_prompt is a chat message: it needs chat_template: true")
            if self.prompt_template is not None:
                template_fields(self.prompt_template)
            return self

    @staticmethod
    def preflight(options: DatasetTask.Options) -> None:
        if not options.streaming:
            DatasetTask(options)
            return
        converter = RowConverter(options, _where(options))
        for i, row in zip(range(PREFLIGHT_STREAM_ROWS), iter_rows(_where(options))):
            converter(row, i)
        if _eval_where(options) is not None:
            _eval_problems(options)

    def __init__(self, options: Options, *, seed: int = 0):
        self.options = options
        self.seed = int(seed)
        self.where = _where(options)
        self._stream: StreamCursor | None = None
        if options.streaming:
            self._stream = StreamCursor(
                self.where, RowConverter(options, self.where), self.seed, options.shuffle_buffer
            )
            self._train: list[Problem] = []
            self._eval = _eval_problems(options)
            self.cursor = EpochCursor(0, self.seed, "dataset")
            return
        convert = RowConverter(options, self.where)
        problems = [convert(row, i) for i, row in enumerate(read_all(self.where))]
        if _eval_where(options) is not None:
            self._train, self._eval = problems, _eval_problems(options)
        else:
            self._train, self._eval = held_out(
                problems, options.eval_fraction, options.eval_seed, self.where.label
            )
        if not self._train:
            raise ConfigError(f"task dataset: {self.where.label} has no problems to train on")
        self.cursor = EpochCursor(len(self._train), self.seed, "dataset")

    # ------------------------------------------------------------------ Task

    def next_problems(self, n: int) -> list[Problem]:
        if self._stream is not None:
            return self._stream.take(n)
        return [self._train[i] for i in self.cursor.take(n)]

    def eval_problems(self) -> list[Problem]:
        return list(self._eval)

    def state_dict(self) -> dict[str, Any]:
        if self._stream is not None:
            s = self._stream
            return {
                "epoch": s.epoch,
                "taken": s.taken,
                "seed": self.seed,
                "source": self.where.label,
                "streaming": True,
            }
        c = self.cursor
        return {"epoch": c.epoch, "position": c.position, "seed": self.seed, "size": len(self._train),
                "source": self.where.label}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        label = self.where.label
        if "seed" in state and int(state["seed"]) != self.seed:
            raise ConfigError(
                f"task dataset: the saved state is for seed {state['seed']}, this run uses seed {self.seed}"
            )
        if bool(state.get("streaming", False)) != (self._stream is not None):
            raise ConfigError(
                "task dataset: the checkpoint was saved with streaming: "
                f"{str(bool(state.get('streaming'))).lower()}; resume with the same setting"
            )
        if "source" in state and state["source"] != label:
            raise ConfigError(
                f"task dataset: the saved state is for {state['source']}, this run reads {label}"
            )
        if self._stream is not None:
            self._stream.restore(int(state["epoch"]), int(state["taken"]))
            return
        if "size" in state and int(state["size"]) != len(self._train):
            raise ConfigError(
                f"task dataset: the saved state is for {state['size']} training problems, {label} now gives "
                f"{len(self._train)}; the data changed since the checkpoint"
            )
        self.cursor.restore(state["epoch"], state["position"])

    @property
    def train_size(self) -> int | None:
        """Training problems in memory; None when streaming (not known without reading them all)."""
        return None if self._stream is not None else len(self._train)


# ------------------------------------------------------------------ sources


def _where(o: DatasetTask.Options) -> Where:
    return Where(path=o.path, name=o.name, config=o.config, split=o.split or "train",
                 split_given=o.split is not None, format=o.format)  # fmt: skip


def _eval_where(o: DatasetTask.Options) -> Where | None:
    if o.eval_split is not None:
        return Where(
            path=o.path, name=o.name, config=o.config, split=o.eval_split, split_given=True, format=o.format
        )
    if o.eval_path is not None:
        return Where(path=o.eval_path, format=o.format if Path(o.eval_path).suffix == "" else "auto")
    return None


def _eval_problems(o: DatasetTask.Options) -> list[Problem]:
    where = _eval_where(o)
    if where is None:
        return []
    convert = RowConverter(o, where)
    return [convert(row, i) for i, row in enumerate(read_all(where))]


def held_out(
    problems: list[Problem], fraction: float, seed: int, label: str
) -> tuple[list[Problem], list[Problem]]:
    """(train, held out): ``floor(n * fraction)`` (at least 1) problems chosen with ``seed``."""
    too_few = (f"task dataset: {label} has {{n}} row(s), too few to hold out eval_fraction={{fraction}}; "
               "add rows, name eval_split or eval_path, or set eval_fraction: 0")  # fmt: skip
    return hold_out(problems, fraction, f"dataset:eval:{seed}", too_few)


# ------------------------------------------------------------------ rows → problems


def template_fields(template: str) -> list[str]:
    """The column names ``template`` uses; ValueError for anything but plain ``{name}`` fields
    (no attribute or index access: the values are dataset text)."""
    names = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"prompt_template: {exc} (write a literal brace as {{{{ or }}}})") from None
    for _, field, _, _ in parsed:
        if field is None:
            continue
        if not field or any(c in field for c in ".[]"):
            raise ValueError(f"prompt_template: {{{field}}} is not a column name; use {{column}} fields only")
        names.append(field)
    return names


class RowConverter:
    """``convert(row, index)`` → Problem, under one task's options; ConfigError names the row,
    the column and the columns there are."""

    def __init__(self, options: DatasetTask.Options, where: Where):
        self.o = options
        self.label = where.label
        self.id_prefix = where.id_prefix
        self.fields = template_fields(options.prompt_template) if options.prompt_template else []
        c = options.columns
        self.mapped = {x for x in (c.prompt, c.messages, c.answer, c.id, c.images) if x is not None}
        # Relative image paths are the dataset's: resolved here, so the problem (and a
        # checkpoint holding it) names the file wherever the run is started from.
        self.image_dir = Path(where.path).parent if where.path and Path(where.path).is_file() else (
            Path(where.path) if where.path else None
        )

    def __call__(self, row: Mapping[str, Any], index: int) -> Problem:
        o, c = self.o, self.o.columns
        where = f"{self.label} row {index + 1}"
        needed = [("columns.prompt", c.prompt), ("columns.messages", c.messages), ("columns.answer", c.answer),
                  ("columns.id", c.id), ("columns.images", c.images)]
        needed += [("columns.metadata", m) for m in c.metadata or ()]  # fmt: skip
        needed += [("prompt_template", f) for f in self.fields if f != "prompt"]
        for key, column in needed:
            if column is not None and column not in row:
                hint = (
                    " (columns.answer: null for rewards that need no answer)"
                    if key == "columns.answer"
                    else ""
                )
                raise ConfigError(
                    f"{where}: no column {column!r} ({key}); columns: {', '.join(map(str, row)) or 'none'}{hint}"
                )
        prompt: str | list[dict[str, Any]]
        if c.messages is not None:
            prompt = _messages(row[c.messages], where, c.messages)
        else:
            assert c.prompt is not None, "Columns guarantees a prompt or messages column"
            text = _text(row[c.prompt], where, c.prompt)
            if o.prompt_template is not None:
                values = {
                    f: text if f == "prompt" else _text(row[f], where, f, scalar=True) for f in self.fields
                }
                text = o.prompt_template.format_map(values)
            prompt = [{"role": "user", "content": text}] if o.chat_template else text
        if c.images is not None:
            prompt = _with_images(prompt, _image_refs(row[c.images], where, c.images, self.image_dir), where)
        if isinstance(prompt, list) and o.system_prompt and prompt[0]["role"] != "system":
            prompt.insert(0, {"role": "system", "content": o.system_prompt})
        _no_bos(prompt, where)
        answer = "" if c.answer is None else _text(row[c.answer], where, c.answer, scalar=True)
        problem_id = (
            _text(row[c.id], where, c.id, scalar=True) if c.id is not None else f"{self.id_prefix}:{index}"
        )
        keep = c.metadata if c.metadata is not None else [k for k in row if k not in self.mapped]
        metadata = {str(k): plain(row[k]) for k in keep}
        return Problem(id=problem_id, prompt=prompt, answer=answer, metadata=metadata)


def _text(value: Any, where: str, column: str, *, scalar: bool = False) -> str:
    """A text cell; numbers and booleans too where ``scalar`` (answers, ids, template fields)."""
    if isinstance(value, str):
        return value
    if (
        scalar
        and isinstance(value, (int, float))
        and not (isinstance(value, float) and not math.isfinite(value))
    ):
        return str(value)
    what = "empty (null)" if value is None else f"a {type(value).__name__}"
    hint = "; a chat goes in columns.messages" if isinstance(value, list) else ""
    raise ConfigError(f"{where}: column {column!r} is {what}, not text{hint}")


def _image_refs(value: Any, where: str, column: str, base: Path | None) -> list[str]:
    """The image references of an images cell (one string or a list; empty: no image)."""
    values = [value] if isinstance(value, str) else value
    if value is None:
        values = []
    if not isinstance(values, list) or not all(isinstance(v, str) and v for v in values):
        raise ConfigError(f"{where}: column {column!r} must hold an image reference or a list of them, "
                          f"not {str(value)[:80]!r}")  # fmt: skip
    out = []
    for ref in values:
        if base is not None and "://" not in ref and not ref.startswith("data:") and not Path(ref).is_absolute():
            ref = str(base / ref)
        out.append(ref)
    return out


def _with_images(prompt: str | list[dict[str, Any]], refs: list[str], where: str) -> list[dict[str, Any]]:
    """The prompt with ``refs`` as image parts before the text of its last user message."""
    if not refs:
        return prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    users = [i for i, m in enumerate(prompt) if m["role"] == "user"]
    if not users:
        raise ConfigError(f"{where}: images need a user message to go in")
    last = prompt[users[-1]]
    content = last["content"]
    text_parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
    parts = [{"type": "image_url", "image_url": {"url": r}} for r in refs]
    prompt = list(prompt)
    prompt[users[-1]] = {**last, "content": parts + text_parts}
    return prompt


def _messages(value: Any, where: str, column: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f'{where}: column {column!r} must be a non-empty list of {{"role", "content"}} messages, '
                          f"not {type(value).__name__}")  # fmt: skip
    out = []
    for m in value:
        if not (
            isinstance(m, Mapping)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), (str, list))
        ):
            raise ConfigError(f'{where}: column {column!r}: every message needs a "role" and a "content" (text '
                              f"or content parts); got {str(m)[:80]!r}")  # fmt: skip
        if isinstance(m["content"], list):
            try:
                image_references([m])  # checks every part's shape (docs/vision.md)
            except ImageError as exc:
                raise ConfigError(f"{where}: column {column!r}: {exc}") from None
            out.append({"role": m["role"], "content": [dict(p) for p in m["content"]]})
            continue
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _no_bos(prompt: str | list[dict[str, Any]], where: str) -> None:
    first = prompt if isinstance(prompt, str) else prompt[0]["content"]
    if not isinstance(first, str):  # content parts: the first text part
        first = next((p["text"] for p in first if p.get("type") == "text"), "")
    head = first.lstrip()
    for marker in BOS_MARKERS:
        if head.startswith(marker):
            raise ConfigError(
                f"{where}: the prompt starts with {marker!r}, a beginning-of-sequence token; the chat template "
                "(or, with chat_template: false, the tokenizer) adds its own, and a second one would be trained "
                "on: take it out of the data or the prompt_template"
            )


def plain(value: Any, depth: int = 0) -> Any:
    """``value`` as JSON-safe data (checkpoints store problems as JSON): other types as text."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if depth < 32 and isinstance(value, Mapping):
        return {str(k): plain(v, depth + 1) for k, v in value.items()}
    if depth < 32 and isinstance(value, (list, tuple)):
        return [plain(v, depth + 1) for v in value]
    return str(value)


# ------------------------------------------------------------------ streaming


class StreamCursor:
    """Problems read as they are consumed, epoch after epoch. ``(epoch, taken)`` is the whole
    position: the order of an epoch depends on the data, the seed and the epoch only."""

    def __init__(
        self, where: Where, convert: Callable[[Mapping[str, Any], int], Problem], seed: int, buffer: int
    ):
        self.where, self.convert, self.seed, self.buffer = where, convert, seed, buffer
        self.epoch = 0
        self.taken = 0
        self._it = self._epoch(0)

    def take(self, n: int) -> list[Problem]:
        out: list[Problem] = []
        while len(out) < n:
            try:
                out.append(next(self._it))
                self.taken += 1
            except StopIteration:
                if self.taken == 0:
                    raise ConfigError(f"task dataset: {self.where.label} has no rows") from None
                self.epoch, self.taken = self.epoch + 1, 0
                self._it = self._epoch(self.epoch)
        return out

    def restore(self, epoch: int, taken: int) -> None:
        self.epoch, self.taken = epoch, 0
        self._it = self._epoch(epoch)
        for _ in range(taken):
            try:
                next(self._it)
            except StopIteration:
                raise ConfigError(
                    f"task dataset: the checkpoint is at row {taken} of epoch {epoch}, but {self.where.label} "
                    f"has {self.taken} rows now; the data changed since the checkpoint"
                ) from None
            self.taken += 1

    def _epoch(self, epoch: int) -> Iterator[Problem]:
        rows: Iterator[tuple[int, Mapping[str, Any]]] = enumerate(iter_rows(self.where))
        if self.buffer > 1:
            rows = shuffle_buffered(rows, self.buffer, random.Random(f"dataset:stream:{self.seed}:{epoch}"))
        for index, row in rows:
            yield self.convert(row, index)


def shuffle_buffered(items: Iterator[Any], size: int, rng: random.Random) -> Iterator[Any]:
    """``items`` in an order shuffled within a window of ``size``, a function of ``rng``'s seed."""
    buffer: list[Any] = []
    for item in items:
        if len(buffer) < size:
            buffer.append(item)
            continue
        j = rng.randrange(size)
        yield buffer[j]
        buffer[j] = item
    rng.shuffle(buffer)
    yield from buffer
