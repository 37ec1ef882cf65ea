"""Loading DCP checkpoints without running code from them, and saying why a save failed.

torch.distributed.checkpoint keeps tensors as ``torch.save`` blobs, which its reader
already loads with ``weights_only=True``. Two parts of a DCP folder are loaded with plain
pickle, though: the ``.metadata`` file (``pickle.load``) and non-tensor values such as
the optimizer's hyperparameters (``torch.load(weights_only=False)`` in the default
planner). A checkpoint from someone else could run anything through either. Here:

* :func:`read_metadata_safely` unpickles ``.metadata`` with an allow-list of the few
  classes DCP writes there (its metadata dataclasses, ``torch.Size``, dtypes, layouts,
  paths); any other global is refused before anything is called, and data files must lie
  inside the checkpoint folder. :class:`SafeReader` hands that metadata to DCP;
* :class:`SafePlanner` loads non-tensor values with ``torch.load(weights_only=True)``
  (plain numbers, strings, tuples, lists, dicts).

Both refusals surface as :class:`~forgerl.errors.CheckpointUnusable` naming the file.
"""

from __future__ import annotations

import contextlib
import io
import pickle
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

from forgerl.errors import CheckpointUnusable, CheckpointWriteError

METADATA_FILE = ".metadata"

_ALLOWED: dict[str, set[str]] = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # looks a layout up by its name
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import torch

        allowed = name in _ALLOWED.get(module, ())
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            allowed = True
        if not allowed:
            raise pickle.UnpicklingError(f"it references {module}.{name}, which DCP metadata never holds")
        return super().find_class(module, name)


def read_metadata_safely(path: Path) -> Any:
    """DCP's ``.metadata`` of the checkpoint folder ``path``, unpickled with the allow-list."""
    f = path / METADATA_FILE
    try:
        with open(f, "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
    except OSError as exc:
        raise CheckpointUnusable(f"{f}: unreadable ({exc.strerror or exc})") from None
    except Exception as exc:  # noqa: BLE001 - any failure to parse means the file is unusable
        raise CheckpointUnusable(f"{f}: refused ({exc})") from None
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(metadata, Metadata):
        raise CheckpointUnusable(f"{f}: holds a {type(metadata).__name__}, not DCP metadata")
    for info in getattr(metadata, "storage_data", {}).values():
        rel = PurePosixPath(getattr(info, "relative_path", ""))
        if rel.is_absolute() or len(rel.parts) != 1 or rel.name in ("", ".", ".."):
            raise CheckpointUnusable(f"{f}: names the data file {str(rel)!r}, outside the checkpoint folder")
    return metadata


class SafeReader(FileSystemReader):
    """A DCP file-system reader serving metadata already read by :func:`read_metadata_safely`
    (so a refusal reaches the caller as itself, not wrapped in DCP's own errors)."""

    def __init__(self, path: Path, metadata: Any) -> None:
        super().__init__(str(path))
        self._metadata = metadata

    # No parameter named ``kwargs``: DCP then never falls back to per-rank metadata files.
    def read_metadata(self, *args: Any, **_ignored: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class SafePlanner(DefaultLoadPlanner):
    """Loads non-tensor values (optimizer hyperparameters, ...) with ``weights_only=True``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        # DefaultLoadPlanner.load_bytes, with weights_only=True. Validating with a
        # restricted load and then handing the bytes to the parent's plain torch.load is
        # not the same: two unpicklers could read one crafted file differently.
        import torch
        from torch.distributed.checkpoint._traverse import set_element

        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any refusal means the checkpoint is unusable
            raise CheckpointUnusable(
                f"the value {read_item.dest_index.fqn!r} is refused ({_first_line(exc)})"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


@contextlib.contextmanager
def one_line_errors(path: Path, *, saving: bool) -> Iterator[None]:
    """Around a DCP save or load: its failure as :func:`failure`'s one line, where it is
    about the files (the same line on every rank); anything else raised as it is."""
    try:
        yield
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        err = failure(path, exc, saving=saving)
        if err is None:
            raise
        raise err from err.__cause__  # a write error keeps its OSError: the core reads errno there


def failure(path: Path, exc: BaseException, saving: bool) -> Exception | None:
    """One line for a failed DCP save or load, or None when ``exc`` is not about the files.

    DCP runs each rank's file work, gathers the errors and raises them on every rank as a
    CheckpointException carrying ``failures``; a save fails for the disk when one of them
    is an OSError (e.g. ``no space left on device``, with the file it concerns), a load
    fails for the checkpoint whatever the error. A collective that fails outside those
    steps (a dead rank) is raised as is: it is not the checkpoint's fault."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return None
    errors = [w[0] if isinstance(w, tuple) else w for _, w in sorted(failures.items())]
    errors = [e for e in errors if isinstance(e, BaseException)] or [exc]
    if saving:
        os_error = next((e for e in errors if isinstance(e, OSError)), None)
        if os_error is None:
            return None
        import os

        reason = os.strerror(os_error.errno).lower() if os_error.errno else str(os_error)
        err = CheckpointWriteError(f"{os_error.filename or path}: {reason}")
        err.__cause__ = os_error  # the core reads errno from here to say what to do
        return err
    unusable = next((e for e in errors if isinstance(e, CheckpointUnusable)), None)
    if unusable is not None:
        return CheckpointUnusable(str(unusable))
    return CheckpointUnusable(f"trainer checkpoint {path}: cannot be loaded ({_first_line(errors[0])})")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300]
