"""Sample records on disk: ``<run_dir>/samples/samples-NNNNNN.jsonl``, one record a line.

The folder is bounded: a segment is closed once it holds ``max_file_bytes`` and a new one
begun; beyond ``keep_files`` segments the oldest is deleted (its records are gone, the
newest stay). Writing never fails the run: a full disk or an unwritable folder is said
once in the log and the records of that write are dropped (samples are for looking at,
metrics.jsonl and the checkpoints are what a run depends on).
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

    def _prune(self) -> None:
        existing = segments(self.folder)
        for old in existing[: max(0, len(existing) - self.keep_files)]:
            old.unlink(missing_ok=True)


def _number(path: Path) -> int:
    m = SEGMENT_RE.match(path.name)
    return int(m.group(1)) if m else 1


def _append(path: Path, lines: list[bytes]) -> None:
    if not lines:
        return
    with open(path, "ab") as f:
        f.write(b"".join(lines))
