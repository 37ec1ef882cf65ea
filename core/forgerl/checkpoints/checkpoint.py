"""Checkpoints of a run: the trainer's state (its own format, e.g. DCP) plus the loop's.

Layout::

    <run_dir>/checkpoints/step-000010/
        trainer/              written by Trainer.save (every rank)
        loop.json             loop state and pending rollouts (see forgerl.checkpoints.checkpoint_format)
        arrays.safetensors    token ids, logprobs, torch RNG state
        manifest.json         written last: format version, step, every file with its size
    <run_dir>/checkpoints/latest   the newest committed folder's name (for people and tools)

Nothing is pickled: loading a checkpoint runs no code from it.

Writing: everything that needs disk space is written and fsynced under a temporary name
(``.tmp-step-N``, plus the new ``latest`` as ``.latest.tmp``) before anything is renamed
into place, so a full disk or an unwritable directory leaves the previous checkpoint and
``latest`` untouched; the failure is one :class:`CheckpointWriteError` line that names the
path, the cause and what to do.

Reading: a checkpoint is usable when its manifest parses, every file it lists exists with
the recorded size (a truncated or missing trainer file shows here, whatever the trainer's
format) and the loop state passes its strict checks. Resuming takes the newest usable
checkpoint and warns about each newer one it skips; when none is usable it says why in one
:class:`CheckpointUnusable` line.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from forgerl.checkpoints.checkpoint_format import ARRAYS_FILE, LOOP_FILE, Snapshot, decode, encode
from forgerl.errors import CheckpointError, CheckpointUnusable, CheckpointWriteError
from forgerl.rundirs.diskerrors import advice as _advice
from forgerl.rundirs.diskerrors import os_error as _os_error

log = logging.getLogger("forgerl.checkpoints.checkpoint")

LOOP_STATE = LOOP_FILE
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "forgerl.checkpoint"
MANIFEST_VERSION = 1
TRAINER = "trainer"
LATEST = "latest"
_STEP_DIR = re.compile(r"step-(\d+)")

T = TypeVar("T")


def root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def staging_dir(run_dir: Path, step: int) -> Path:
    return root(run_dir) / f".tmp-step-{step:06d}"


def final_dir(run_dir: Path, step: int) -> Path:
    return root(run_dir) / f"step-{step:06d}"


# ---------------------------------------------------------------------------- writing


def save(
    run_dir: Path,
    step: int,
    snapshot: Snapshot,
    write_trainer: Callable[[Path], None],
    keep: int,
) -> Path:
    """Write the checkpoint of ``step``: ``write_trainer(folder)`` (every rank's trainer
    state), then the loop's snapshot and the manifest; move it into place, point ``latest``
    at it and delete the oldest beyond ``keep``. Rank 0 only."""
    tmp = staging_dir(run_dir, step)
    final = final_dir(run_dir, step)
    pointer = root(run_dir) / f".{LATEST}.tmp"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / TRAINER).mkdir(parents=True)
        write_trainer(tmp / TRAINER)
        text, arrays = encode(snapshot)
        _write_durably(tmp / LOOP_FILE, text.encode())
        _write_durably(tmp / ARRAYS_FILE, _safetensors_bytes(arrays))
        manifest = {
            "format": MANIFEST_FORMAT,
            "version": MANIFEST_VERSION,
            "step": step,
            "files": _file_sizes(tmp),
        }
        # The manifest last: without it a folder is never taken for a checkpoint.
        _write_durably(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
        _fsync_dir(tmp)
        _write_durably(pointer, final.name.encode())
    except (OSError, CheckpointError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        _unlink_quietly(pointer)
        raise _write_failed(run_dir, step, exc) from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _unlink_quietly(pointer)
        raise
    # From here on only renames, which need no free space.
    aside = root(run_dir) / f".old-{final.name}"
    if final.exists():  # the same step saved again (e.g. stopped right after a periodic save)
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(tmp, final)
    os.replace(pointer, root(run_dir) / LATEST)
    _fsync_dir(root(run_dir))
    shutil.rmtree(aside, ignore_errors=True)
    _prune(run_dir, keep)
    return final


def _write_failed(run_dir: Path, step: int, exc: BaseException) -> CheckpointWriteError:
    # Cause and remedy first: schedulers show a shortened last log line.
    cause = _os_error(exc)
    if cause is not None:
        reason = os.strerror(cause.errno).lower() if cause.errno else str(cause)
        what = f"{reason} ({_short(Path(cause.filename or staging_dir(run_dir, step)), run_dir)})"
    else:
        what = str(exc)
    previous = next((p for p in checkpoints(run_dir) if (p / MANIFEST).is_file()), None)
    kept = f"{previous.name} is intact" if previous else "there is no earlier checkpoint"
    return CheckpointWriteError(
        f"checkpoint of step {step} not written: {what}; {kept}; {_advice(cause, _short(root(run_dir), run_dir))}, "
        f"then continue with `forge run --resume {run_dir}`"
    )


def _short(path: Path, run_dir: Path) -> str:
    """``path`` relative to the run directory when inside it (the message names that)."""
    try:
        return str(Path(path).relative_to(run_dir))
    except ValueError:
        return str(path)


def _safetensors_bytes(arrays: dict[str, Any]) -> bytes:
    from safetensors.numpy import save as save_arrays

    return save_arrays(arrays, metadata={"format": "forgerl.checkpoint-arrays", "version": "1"})


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _file_sizes(folder: Path) -> dict[str, int]:
    return {
        p.relative_to(folder).as_posix(): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()
    }


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def clean_staging(run_dir: Path) -> None:
    """Remove half-written checkpoints left by a crash."""
    for tmp in [*root(run_dir).glob(".tmp-step-*"), *root(run_dir).glob(".old-step-*")]:
        shutil.rmtree(tmp, ignore_errors=True)
    _unlink_quietly(root(run_dir) / f".{LATEST}.tmp")


def _prune(run_dir: Path, keep: int) -> None:
    complete = [p for p in checkpoints(run_dir) if (p / MANIFEST).is_file()]
    for old in complete[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- reading


def checkpoints(run_dir: Path) -> list[Path]:
    """Every ``step-N`` folder, newest first (usable or not)."""
    found = []
    for p in root(run_dir).glob("step-*"):
        m = _STEP_DIR.fullmatch(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found, reverse=True)]


def load(path: Path) -> Snapshot:
    """Check the checkpoint at ``path`` (manifest, file sizes, loop state) and return the
    loop's snapshot; :class:`CheckpointUnusable` naming the file otherwise."""
    files = _check_manifest(path)
    for name, size in files.items():
        f = path / name
        try:
            actual = f.stat().st_size
        except OSError:
            raise CheckpointUnusable(f"{f}: missing (listed in {MANIFEST})") from None
        if actual != size:
            raise CheckpointUnusable(f"{f}: {actual} bytes, {MANIFEST} recorded {size} (truncated or replaced)")
    for name in (LOOP_FILE, ARRAYS_FILE):
        if name not in files:
            raise CheckpointUnusable(f"{path / MANIFEST}: does not list {name}")
    try:
        text = (path / LOOP_FILE).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointUnusable(f"{path / LOOP_FILE}: unreadable ({exc})") from None
    return decode(text, _read_arrays(path / ARRAYS_FILE), path / LOOP_FILE)


def load_loop_state(path: Path) -> Snapshot:
    """Alias of :func:`load` (the loop's part of a checkpoint)."""
    return load(path)


def _check_manifest(path: Path) -> dict[str, int]:
    f = path / MANIFEST
    try:
        raw = json.loads(f.read_text())
    except FileNotFoundError:
        raise CheckpointUnusable(
            f"{f}: missing (the checkpoint was never completed, or an older forgerl wrote it "
            "with pickle, which is no longer loaded)"
        ) from None
    except (OSError, ValueError) as exc:
        raise CheckpointUnusable(f"{f}: unreadable or not JSON ({exc})") from None
    if not isinstance(raw, dict) or set(raw) != {"format", "version", "step", "files"}:
        raise CheckpointUnusable(f"{f}: not a forgerl checkpoint manifest (expected format, version, step, files)")
    if raw["format"] != MANIFEST_FORMAT or raw["version"] != MANIFEST_VERSION:
        raise CheckpointUnusable(
            f"{f}: format {raw['format']!r} version {raw['version']!r}; this forgerl reads "
            f"{MANIFEST_FORMAT!r} version {MANIFEST_VERSION}"
        )
    m = _STEP_DIR.fullmatch(path.name)
    if isinstance(raw["step"], bool) or not isinstance(raw["step"], int) or (m and int(m.group(1)) != raw["step"]):
        raise CheckpointUnusable(f"{f}: step {raw['step']!r} does not match the folder {path.name}")
    files = raw["files"]
    if not isinstance(files, dict):
        raise CheckpointUnusable(f"{f}: files must be an object of path: size")
    for name, size in files.items():
        parts = Path(name).parts
        if Path(name).is_absolute() or ".." in parts or not parts:
            raise CheckpointUnusable(f"{f}: file {name!r} is outside the checkpoint")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise CheckpointUnusable(f"{f}: the size of {name!r} must be a non-negative integer, got {size!r}")
    return files


def _read_arrays(path: Path) -> dict[str, Any]:
    from safetensors.numpy import load as load_arrays

    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointUnusable(f"{path}: unreadable ({exc.strerror or exc})") from None
    try:
        return load_arrays(data)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error type for any bad file
        raise CheckpointUnusable(f"{path}: not a complete safetensors file ({exc})") from None


def latest(run_dir: Path, keep: int | None = None) -> Path | None:
    """The newest usable checkpoint, or None when the run has none at all."""
    found = _first_usable(run_dir, load, keep, action="using")
    return None if found is None else found[0]


def restore(
    run_dir: Path, load_trainer: Callable[[Path], None], keep: int | None = None
) -> tuple[Path, Snapshot] | None:
    """Load the newest usable checkpoint: its snapshot, and ``load_trainer(folder)`` for the
    trainer's state. A checkpoint the trainer refuses (:class:`CheckpointError`) is skipped
    like one that fails the checks here. None when the run has no checkpoint."""

    def attempt(path: Path) -> Snapshot:
        snapshot = load(path)
        load_trainer(path / TRAINER)
        return snapshot

    return _first_usable(run_dir, attempt, keep, action="resuming from")


def _first_usable(
    run_dir: Path, attempt: Callable[[Path], T], keep: int | None, action: str
) -> tuple[Path, T] | None:
    skipped: list[tuple[Path, str]] = []
    for path in checkpoints(run_dir):
        try:
            result = attempt(path)
        except CheckpointError as exc:
            skipped.append((path, _one_line(exc)))
            continue
        for bad, why in skipped:
            log.warning("checkpoint %s is unusable (%s); %s %s instead", bad, why, action, path.name)
        return path, result
    if not skipped:
        return None
    reasons = "; ".join(f"{p.name}: {why}" for p, why in skipped)
    if keep == 1:
        note = " checkpoint.keep is 1, so no earlier checkpoint was kept to fall back on (keep >= 2 keeps one)."
    else:
        note = ""
    raise CheckpointUnusable(
        f"no usable checkpoint in {root(run_dir)} ({reasons}).{note} Move that folder away to start the run "
        "over from step 0"
    )


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
