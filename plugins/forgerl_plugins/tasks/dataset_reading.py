"""Where the ``dataset`` task's rows come from: a JSONL, Parquet or CSV file, a folder a
Hugging Face ``datasets`` object was saved to (``save_to_disk``), a folder of data files, or a
dataset by name from the local Hugging Face cache. Rows come back as plain dicts, whole
(:func:`read_all`) or one at a time (:func:`iter_rows`, for data larger than memory).

``datasets`` is imported only for the Hugging Face sources, and never downloads: its
offline switches are set before and after it is imported, so a name missing from the cache
is a one-line error, not a network call.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forgerl.errors import BackendUnavailable, ConfigError

PARQUET_SUFFIXES = (".parquet", ".pq")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
CSV_SUFFIXES = (".csv",)
#: Files that mark a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``.
SAVED_MARKERS = ("dataset_dict.json", "state.json")

#: The longest CSV field accepted (the csv module's default is 128 KiB); hostile files may
#: hold bigger ones, which are refused with the row number.
CSV_FIELD_LIMIT = 16 * 2**20


@dataclass(frozen=True)
class Where:
    """One source of rows. ``path`` (a file or folder) or ``name`` (a cached Hugging Face
    dataset); ``split`` names a split of a dataset that has them; ``split_given`` says
    whether the user named it (a file has none, and only a named split is refused there)."""

    path: str | None = None
    name: str | None = None
    config: str | None = None
    split: str = "train"
    split_given: bool = False
    format: str = "auto"

    @property
    def label(self) -> str:
        what = (
            self.path
            if self.path is not None
            else f"{self.name}" + (f" ({self.config})" if self.config else "")
        )
        return f"{what} [{self.split}]" if self.kind() not in ("jsonl", "parquet", "csv") else str(what)

    @property
    def id_prefix(self) -> str:
        """What a row's default id starts with: the file's name, or the dataset's and its split."""
        base = Path(self.path).name if self.path is not None else str(self.name)
        return base if self.kind() in ("jsonl", "parquet", "csv") else f"{base}:{self.split}"

    def kind(self) -> str:
        """jsonl, parquet, csv (a file), saved (a save_to_disk folder), folder (data files), hub (a name)."""
        if self.path is None:
            return "hub"
        if self.format != "auto":
            return self.format
        p = Path(self.path)
        if p.is_dir():
            return "saved" if any((p / m).is_file() for m in SAVED_MARKERS) else "folder"
        suffix = p.suffix.lower()
        if suffix in PARQUET_SUFFIXES:
            return "parquet"
        if suffix in CSV_SUFFIXES:
            return "csv"
        if suffix in JSONL_SUFFIXES:
            return "jsonl"
        if not p.exists():
            raise ConfigError(f"task dataset: {self.path!r} does not exist (cwd: {Path.cwd()})")
        raise ConfigError(
            f"task dataset: cannot tell the format of {self.path!r} from its name: use .jsonl, .parquet or "
            ".csv, a folder, or set format: jsonl|parquet|csv"
        )


def read_all(where: Where) -> list[dict[str, Any]]:
    """Every row of ``where``; ConfigError (one line, naming what exists) on anything wrong."""
    rows = list(iter_rows(where))
    if not rows:
        raise ConfigError(f"task dataset: {where.label} has no rows")
    return rows


def iter_rows(where: Where) -> Iterator[dict[str, Any]]:
    """The rows of ``where`` in their stored order, read as they are consumed."""
    kind = where.kind()
    if kind in ("jsonl", "parquet", "csv"):
        path = _checked_file(where)
        return {"jsonl": _jsonl, "parquet": _parquet, "csv": _csv}[kind](path)
    return _hf_rows(where, kind)


# ------------------------------------------------------------------------ files


def _checked_file(where: Where) -> Path:
    path = Path(str(where.path))
    if where.split_given:
        raise ConfigError(
            f"task dataset: {where.path} is a file, which has no splits (split: {where.split!r}); "
            "name held-out rows with eval_path or eval_fraction"
        )
    try:
        if not path.exists():
            raise ConfigError(f"task dataset: {str(path)!r} does not exist (cwd: {Path.cwd()})")
        if not path.is_file():
            raise ConfigError(f"task dataset: {str(path)!r} is not a regular file")
        if path.stat().st_size == 0:
            raise ConfigError(f"task dataset: {str(path)!r} is empty")
    except OSError as exc:
        raise ConfigError(f"task dataset: cannot read {str(path)!r}: {exc.strerror or exc}") from None
    except ValueError as exc:  # a NUL byte in the path
        raise ConfigError(f"task dataset: {str(path)!r}: {exc}") from None
    return path


def _jsonl(path: Path) -> Iterator[dict[str, Any]]:
    try:
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except (json.JSONDecodeError, RecursionError) as exc:
                    msg = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
                    raise ConfigError(
                        f"{path}:{lineno}: not valid JSON ({msg}); JSON Lines: one object per line"
                    ) from None
                if not isinstance(row, dict):
                    raise ConfigError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
                yield row
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason})") from None
    except OSError as exc:
        raise ConfigError(f"task dataset: cannot read {str(path)!r}: {exc.strerror or exc}") from None


def _csv(path: Path) -> Iterator[dict[str, Any]]:
    csv.field_size_limit(CSV_FIELD_LIMIT)
    try:
        with path.open(encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            try:
                for row in reader:
                    if None in row:  # more fields than the header names
                        raise ConfigError(
                            f"{path}:{reader.line_num}: {len(row) - 1 + len(row[None])} fields, "
                            f"the header names {len(reader.fieldnames or ())}"
                        )
                    yield dict(row)
            except csv.Error as exc:
                raise ConfigError(f"{path}:{reader.line_num}: not valid CSV ({exc})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason})") from None
    except OSError as exc:
        raise ConfigError(f"task dataset: cannot read {str(path)!r}: {exc.strerror or exc}") from None


def _parquet(path: Path) -> Iterator[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise BackendUnavailable(
            f"task dataset: reading {path.name} needs pyarrow: pip install 'forgerl[parquet]'"
        ) from None
    try:
        handle = pq.ParquetFile(path)
        batches = handle.iter_batches(batch_size=1024)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise ConfigError(f"{path}: not a readable Parquet file ({type(exc).__name__}: {exc})") from None
    with handle:
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except Exception as exc:  # noqa: BLE001
                raise ConfigError(
                    f"{path}: not a readable Parquet file ({type(exc).__name__}: {exc})"
                ) from None
            yield from batch.to_pylist()


# --------------------------------------------------------------- Hugging Face


def hf_datasets() -> Any:
    """The ``datasets`` module, offline; BackendUnavailable with the install hint without it."""
    # Before the import: datasets reads it when it loads. HF_HUB_OFFLINE is left alone (the
    # process may still fetch a model by hub id); datasets' own copy of it is set below.
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    try:
        import datasets
    except ImportError:
        raise BackendUnavailable(
            "task dataset: Hugging Face datasets need the `datasets` package: pip install 'forgerl[datasets]'"
        ) from None
    datasets.config.HF_DATASETS_OFFLINE = True
    datasets.config.HF_HUB_OFFLINE = True
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def _hf_rows(where: Where, kind: str) -> Iterator[dict[str, Any]]:
    if kind == "saved":
        dataset = _split_of(_load_saved(where), where)
    else:
        dataset = _load_named(where, kind)
    for row in dataset:
        yield dict(row)


def _load_saved(where: Where) -> Any:
    datasets = hf_datasets()
    try:
        return datasets.load_from_disk(str(where.path))
    except Exception as exc:  # noqa: BLE001 - datasets raises many types for a bad folder
        raise ConfigError(
            f"task dataset: {where.path} is not a readable save_to_disk folder ({type(exc).__name__}: {exc})"
        ) from None


def _split_of(loaded: Any, where: Where) -> Any:
    """The configured split of a DatasetDict; a single Dataset is its own (only) split."""
    if hasattr(loaded, "keys"):
        splits = list(loaded.keys())
        if where.split not in splits:
            raise ConfigError(
                f"task dataset: {where.path} has no split {where.split!r}; splits: {', '.join(splits)}"
            )
        return loaded[where.split]
    if where.split_given:
        raise ConfigError(
            f"task dataset: {where.path} holds one dataset without splits (split: {where.split!r}); "
            "leave split out, or save a DatasetDict"
        )
    return loaded


def _load_named(where: Where, kind: str) -> Any:
    """A dataset by name (from the cache) or a folder of data files, as an IterableDataset:
    rows are read as they are consumed, never the whole set at once."""
    datasets = hf_datasets()
    target = str(where.path if kind == "folder" else where.name)
    try:
        splits = datasets.get_dataset_split_names(target, where.config)
    except Exception as exc:  # noqa: BLE001 - not in the cache, no data files, bad config name
        raise ConfigError(_named_error(where, kind, exc)) from None
    if where.split not in splits:
        raise ConfigError(
            f"task dataset: {where.label} has no split {where.split!r}; splits: {', '.join(splits)}"
        )
    try:
        return datasets.load_dataset(target, where.config, split=where.split, streaming=True)
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(_named_error(where, kind, exc)) from None


def _named_error(where: Where, kind: str, exc: Exception) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if kind == "folder":
        return f"task dataset: cannot read the folder {where.path} as a dataset ({first:.300})"
    config = f" config {where.config!r}" if where.config else ""
    return (
        f"task dataset: {where.name!r}{config} is not readable from the local Hugging Face cache "
        f"({first:.300}); forge never downloads: load it once with network access, or save it with "
        "save_to_disk and give the folder as path"
    )
