"""Version 0 from the model's files: a run's trainer and generators all start from the same
Hugging Face folder (each cluster its own copy), so the first update need not go whole.

Both sides build the same base from their folder for the tensors the trainer sends (its
names, dtypes and shapes, from the first version): each tensor read from the safetensors
files and cast to the sent dtype, as the trainer's export casts its masters. The sender
offers a delta against it with its digest; a receiver whose files give another digest
(another revision, another dtype, files changed on disk) refuses it and gets the version
whole, as for any wrong base. So a seed can only save bytes, never change them.
"""

from __future__ import annotations

import logging
import threading
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from .encoding import TensorInfo, Version, checksum, digest, tensor_bytes

log = logging.getLogger(__name__)

#: The base number of a delta against the model's files (real versions are >= 0).
SEED = -1

# What Hugging Face leaves out of the files when the output layer shares the embedding (a
# wrong guess gives another digest: the version then goes whole).
TIED = {"lm_head.weight": "model.embed_tokens.weight"}


def seed_version(folder: Path | str, infos: list[TensorInfo]) -> tuple[Version | None, str]:
    """(the base the files give for ``infos``, "") or (None, why not)."""
    try:
        return _read(Path(folder), infos)
    except Exception as exc:  # noqa: BLE001 - unreadable or torn files only cost the saving
        return None, f"the model's files in {folder} do not read ({type(exc).__name__}: {exc})"[:300]


def _read(folder: Path, infos: list[TensorInfo]) -> tuple[Version | None, str]:
    import torch

    try:
        from safetensors import safe_open
    except ImportError:  # a receiver's machine without it: the first version goes whole
        return None, "safetensors is not installed (pip install safetensors)"
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None, f"no *.safetensors files in {folder}"
    out_infos: list[TensorInfo] = []
    data: list[Any] = []
    with ExitStack() as stack:  # each file opened once (a sharded checkpoint has several)
        where: dict[str, Any] = {}
        for path in files:
            handle = stack.enter_context(safe_open(str(path), framework="pt"))
            where.update((key, handle) for key in handle.keys())  # noqa: SIM118 (safe_open is no mapping)
        for info in infos:
            key = info.name if info.name in where else TIED.get(info.name)
            if key is None or key not in where:
                return None, f"{info.name!r} is not in the model's files"
            tensor = where[key].get_tensor(key)
            if tuple(tensor.shape) != info.shape:
                return None, f"{info.name!r} is {tuple(tensor.shape)} in the files, {info.shape} in the version"
            raw = tensor_bytes(tensor.to(getattr(torch, info.dtype)), copy=True)
            out_infos.append(TensorInfo(info.name, info.dtype, info.shape, int(raw.size), checksum(raw)))
            data.append(raw)
    return Version(SEED, out_infos, data, digest(out_infos)), ""



class FilesBase:
    """The sender's base from the model's files: built from the first version's layout,
    freed once every receiver holds a version of its own (it is a whole copy of the
    weights), read again for a receiver that joins or restarts later."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        self.version: Version | None = None
        #: Why a new receiver cannot start from the files ("" when it can).
        self.why = "not built yet" if folder is not None else "no model folder to seed from"
        self._lock = threading.Lock()

    def first(self, infos: list[TensorInfo]) -> None:
        """Build it from the first version's layout (once)."""
        if self.folder is not None and self.why == "not built yet":
            self.version, self.why = seed_version(self.folder, infos)
            if self.version is None:
                log.info("delta sender: new receivers get their first version whole (%s)", self.why)
            else:
                log.info("delta sender: new receivers start from the model's files (%s)", self.folder)

    def get(self, infos: list[TensorInfo]) -> Version | None:
        """The base, read again if it was freed (one reader at a time); None: there is none."""
        if self.version is None and self.why == "" and self.folder is not None:
            with self._lock:
                if self.version is None:
                    self.version, self.why = seed_version(self.folder, infos)
                    if self.version is None:
                        log.info("delta sender: the model's files no longer give a base (%s)", self.why)
        return self.version

    def free(self) -> None:
        self.version = None
