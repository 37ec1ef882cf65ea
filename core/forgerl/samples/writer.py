"""Sample records on disk: ``<run_dir>/samples/samples-NNNNNN.jsonl``, one record a line.

The folder is bounded: a segment is closed once it holds ``max_file_bytes`` and a new one
begun; beyond ``keep_files`` segments the oldest is deleted (its records are gone, the
newest stay). A run resuming from its checkpoint of step ``s`` first drops the records
of later steps (:meth:`SampleWriter.drop_after`), which it makes again: each step's
records are on disk once, however often the run was killed. Writing never fails the
run: a full disk or an unwritable folder is said once in the log and the records of that
write are dropped (samples are for looking at, metrics.jsonl and the checkpoints are what
a run depends on).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path

from forgerl.samples.records import SampleRecord

log = logging.getLogger("forgerl.samples")

SAMPLES_DIR = "samples"
SEGMENT = "samples-{n:06d}.jsonl"
SEGMENT_RE = re.compile(r"^samples-(\d{6,})\.jsonl$")


def segments(folder: Path) -> list[Path]:
    """The segment files of ``folder``, oldest first."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    found = [(int(m.group(1)), name) for name in names if (m := SEGMENT_RE.match(name))]
    return [folder / name for _, name in sorted(found)]


class SampleWriter:
    """Appends records to the newest segment of ``folder`` (created on first write)."""

    def __init__(self, folder: Path, *, max_file_bytes: int = 16 << 20, keep_files: int = 4):
        if max_file_bytes < 1 or keep_files < 1:
            raise ValueError(f"max_file_bytes ({max_file_bytes}) and keep_files ({keep_files}) must be at least 1")
        self.folder = Path(folder)
        self.max_file_bytes = max_file_bytes
        self.keep_files = keep_files
        self._warned = False

    @classmethod
    def for_run(cls, run_dir: Path, **bounds: int) -> SampleWriter:
        return cls(Path(run_dir) / SAMPLES_DIR, **bounds)

    def write(self, records: Iterable[SampleRecord]) -> int:
        """Append ``records``; returns how many were written (0 after a disk error)."""
        lines = [(r.to_json() + "\n").encode("utf-8") for r in records]
        if not lines:
            return 0
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            existing = segments(self.folder)
            path = existing[-1] if existing else self.folder / SEGMENT.format(n=1)
            size = path.stat().st_size if path.exists() else 0
            n = _number(path)
            chunk: list[bytes] = []
            if size and _last_byte(path) != b"\n":
                chunk.append(b"\n")  # after a torn line (a kill mid-write): the next record on a line of its own
                size += 1
            for line in lines:
                if chunk or size:
                    if size + len(line) > self.max_file_bytes:
                        _append(path, chunk)
                        chunk, size, n = [], 0, n + 1
                        path = self.folder / SEGMENT.format(n=n)
                chunk.append(line)
                size += len(line)
            _append(path, chunk)
            self._prune()
        except OSError as exc:
            if not self._warned:
                log.warning("samples are not recorded in %s: %s", self.folder, exc)
                self._warned = True
            return 0
        return len(lines)

    def drop_after(self, step: int | None) -> int:
        """Delete the records of steps after ``step`` (None: every record) and every line
        that is not a record (a torn line): a run resuming from its checkpoint of ``step``
        makes those steps again, an evaluation of that step included (it ran before the
        checkpoint was saved). A changed segment is rewritten whole (a temporary file
        renamed over it); an emptied one is deleted. Returns how many records were
        dropped; OSError is the caller's (:class:`~forgerl.samples.capture.Recorder` logs it)."""
        dropped = 0
        for path in segments(self.folder):
            data = path.read_bytes()
            kept: list[bytes] = []
            for line in data.split(b"\n"):
                if not line.strip():
                    continue
                try:
                    record = SampleRecord.from_json(line)
                except ValueError:
                    continue
                if step is not None and record.step <= step:
                    kept.append(line + b"\n")
                else:
                    dropped += 1
            text = b"".join(kept)
            if text == data:
                continue
            if not text:
                path.unlink(missing_ok=True)
                continue
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_bytes(text)
            os.replace(tmp, path)
        return dropped

    def _prune(self) -> None:
        existing = segments(self.folder)
        for old in existing[: max(0, len(existing) - self.keep_files)]:
            old.unlink(missing_ok=True)


def _number(path: Path) -> int:
    m = SEGMENT_RE.match(path.name)
    return int(m.group(1)) if m else 1


def _last_byte(path: Path) -> bytes:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1)


def _append(path: Path, lines: list[bytes]) -> None:
    if not lines:
        return
    with open(path, "ab") as f:
        f.write(b"".join(lines))
