"""Reading demonstration files: JSON Lines (one object per line) or Parquet.

Each row comes with where it was (``demos.jsonl line 7``, ``demos.parquet row 7``), so
that every problem with it is reported as one line naming the file and the row. A file is
hostile input like a row: a line too long to be a demonstration is refused before it is
parsed, JSON nested deeper than the parser allows is one line, not a traceback.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from forgerl.errors import BackendUnavailable
from forgerl.sft.rows import MAX_ROW_CHARS, DataError

PARQUET_SUFFIXES = (".parquet", ".pq")
#: Bytes of one JSONL line: a row's text may be MAX_ROW_CHARS characters of up to 4 bytes
#: each, plus its JSON around them.
MAX_LINE_BYTES = 4 * MAX_ROW_CHARS + 65_536


def check_file(path: Path) -> int:
    """The size of ``path``; DataError when it is missing, not a regular file, unreadable
    or empty."""
    try:
        if not path.is_file():
            raise DataError(f"sft.data: {str(path)!r} {'is not a file' if path.exists() else 'does not exist'} "
                            f"(cwd: {Path.cwd()})")
        size = path.stat().st_size
        with path.open("rb"):
            pass
    except OSError as exc:
        raise DataError(f"sft.data: cannot read {str(path)!r}: {exc.strerror or exc}") from None
    except ValueError as exc:  # a NUL byte in the path
        raise DataError(f"sft.data: {str(path)!r}: {exc}") from None
    if size == 0:
        raise DataError(f"sft.data: {str(path)!r} is empty; it needs one demonstration per line (JSONL) or .parquet")
    return size


def read_rows(path: Path, limit: int | None = None) -> Iterator[tuple[str, Any]]:
    """``(where, row)`` for each row of ``path`` (at most ``limit``), in file order."""
    check_file(path)
    if path.suffix.lower() in PARQUET_SUFFIXES:
        yield from _parquet_rows(path, limit)
    else:
        yield from _jsonl_rows(path, limit)


def _jsonl_rows(path: Path, limit: int | None) -> Iterator[tuple[str, Any]]:
    count = 0
    try:
        with path.open("rb") as f:
            for lineno in range(1, 1 << 62):
                line = f.readline(MAX_LINE_BYTES + 1)
                if not line:
                    break
                where = f"{path} line {lineno}"
                if len(line) > MAX_LINE_BYTES:
                    raise DataError(f"{where}: longer than {MAX_LINE_BYTES} bytes; not a demonstration")
                if not line.strip():
                    continue
                yield where, _json(line, where, path)
                count += 1
                if limit is not None and count >= limit:
                    return
    except OSError as exc:
        raise DataError(f"sft.data: cannot read {str(path)!r}: {exc.strerror or exc}") from None
    if count == 0:
        raise DataError(f"sft.data: {str(path)!r} has no rows (only blank lines)")


def _json(line: bytes, where: str, path: Path) -> Any:
    try:
        return json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise DataError(f"{where}: not UTF-8 text ({exc.reason}); JSONL or .parquet expected") from None
    except RecursionError:
        raise DataError(f"{where}: JSON nested too deeply") from None
    except json.JSONDecodeError as exc:
        hint = " (expected JSON Lines: one object per line)" if path.suffix.lower() == ".json" else ""
        raise DataError(f"{where}: not valid JSON: {exc.msg}{hint}") from None


def _parquet_rows(path: Path, limit: int | None) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise BackendUnavailable(f"sft.data: reading {path.name} needs pyarrow: pip install 'forgerl[parquet]'") from None
    try:
        reader = pq.ParquetFile(path)
        batches = reader.iter_batches(batch_size=256)
        index = 0
        for batch in batches:
            for row in batch.to_pylist():
                index += 1
                yield f"{path} row {index}", row
                if limit is not None and index >= limit:
                    return
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise DataError(f"sft.data: {path} is not a readable Parquet file ({type(exc).__name__}: {exc})") from None
    if index == 0:
        raise DataError(f"sft.data: {str(path)!r} has no rows")
