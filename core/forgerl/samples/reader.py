"""Sample records read back from a run directory, and the filters of ``forge samples``."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from forgerl.errors import UserError
from forgerl.samples.records import SampleRecord, message_text
from forgerl.samples.writer import SAMPLES_DIR, segments

#: What `forge eval` writes in its folder (forgerl.runloop.eval_run.SAMPLES_FILE): the same records.
EVAL_SAMPLES_FILE = "eval_samples.jsonl"


def read_samples(run_dir: Path | str) -> list[SampleRecord]:
    """Every readable record of ``run_dir`` (or of a samples folder named directly), in the
    order written. A run resumed from a checkpoint writes the steps after it again: the
    records written last for a step replace the earlier ones. Lines that are not records
    (a torn last line) are skipped. UserError when there is no samples folder."""
    path = Path(run_dir)
    folder = path if path.name == SAMPLES_DIR and not (path / SAMPLES_DIR).is_dir() else path / SAMPLES_DIR
    if not path.is_dir():
        raise UserError(f"{path} is not a directory; name a run directory (the --output of `forge run`)")
    if not folder.is_dir() and (path / EVAL_SAMPLES_FILE).is_file():  # a `forge eval` folder
        return list(_records(path / EVAL_SAMPLES_FILE))
    if not folder.is_dir():
        raise UserError(f"{path} holds no samples (no {SAMPLES_DIR}/ folder): is it a run directory, made by "
                        "a forgerl version that records samples, with logging.samples.enabled?")
    blocks: dict[tuple[str, int], list[SampleRecord]] = {}
    last: tuple[str, int] | None = None
    for seg in segments(folder):
        for record in _records(seg):
            key = (record.kind, record.step)
            if key != last and key in blocks:
                blocks[key] = []  # written again (a resumed run): the new ones replace the old
            blocks.setdefault(key, []).append(record)
            last = key
    return [r for block in blocks.values() for r in block]


def _records(path: Path) -> Iterable[SampleRecord]:
    """The records of one file; lines that are not records (a torn last line) are skipped."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:  # rotated away while reading
        return
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            yield SampleRecord.from_json(line)
        except ValueError:
            continue


def select(
    records: Iterable[SampleRecord],
    *,
    step: int | None = None,
    kind: str | None = None,
    failed: bool = False,
    grep: str | None = None,
    order: str | None = None,
    limit: int | None = None,
) -> list[SampleRecord]:
    """The records that pass every filter: ``step``, ``kind``, ``failed`` (a reward or the
    environment failed them), ``grep`` (case-insensitive, in the prompt, messages,
    completion or error); ``order`` ``"worst"``/``"best"`` sorts by reward (unscored last);
    ``limit`` keeps the first ones."""
    out = list(records)
    if step is not None:
        out = [r for r in out if r.step == step]
    if kind is not None:
        out = [r for r in out if r.kind == kind]
    if failed:
        out = [r for r in out if r.failed]
    if grep:
        needle = grep.lower()
        out = [r for r in out if needle in _haystack(r)]
    if order in ("worst", "best"):
        sign = 1.0 if order == "worst" else -1.0
        out.sort(key=lambda r: (r.reward is None, sign * (r.reward or 0.0)))
    elif order is not None:
        raise ValueError(f"order is {order!r}, not 'worst' or 'best'")
    if limit is not None:
        out = out[:limit]
    return out


def _haystack(r: SampleRecord) -> str:
    parts = [r.prompt, r.completion, r.error or "", r.problem_id or ""]
    parts += [message_text(m) for m in r.messages or []]
    return "\n".join(parts).lower()
