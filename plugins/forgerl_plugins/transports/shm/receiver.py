"""The ``shm`` transport's reading side: where each version's file is, which versions the
directory holds, and :class:`ShmReceiver`, which waits for a version and copies its tensors
out. A module of its own so that the transport (:mod:`.transport`, which builds receivers)
and the engine receiver (:mod:`.engine`, which wraps one) both import it, and neither the
other.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forgerl.errors import TransportError, TransportTimeout
from forgerl.interfaces import TransportReceiver

if TYPE_CHECKING:  # pragma: no cover
    import torch

LATEST = "LATEST"
_VERSION_FILE = re.compile(r"^v(\d{8,})\.safetensors$")
# Used when neither the caller nor the run config gives a timeout: never wait forever.
DEFAULT_TIMEOUT = 120.0


def version_file(directory: Path, version: int) -> Path:
    return directory / f"v{version:08d}.safetensors"


def _read_latest(directory: Path) -> int | None:
    try:
        text = (directory / LATEST).read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        text = ""
    if text.isdigit():
        return int(text)
    # LATEST not written yet (or unreadable): the newest complete file tells the same.
    versions = _versions_on_disk(directory)
    return versions[-1] if versions else None


def _versions_on_disk(directory: Path) -> list[int]:
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(m.group(1)) for n in names if (m := _VERSION_FILE.match(n)))


class ShmReceiver(TransportReceiver):
    """Reads versions from ``directory``; never modifies it."""

    def __init__(
        self, directory: Path, worker_id: str, poll_interval: float, default_timeout: float = DEFAULT_TIMEOUT
    ) -> None:
        self.directory = directory
        self.worker_id = worker_id
        self.poll_interval = poll_interval
        self.default_timeout = default_timeout
        self._closed = False

    def latest_version(self) -> int | None:
        """The newest published version (for a generator that joins late), or None."""
        return _read_latest(self.directory)

    def receive(self, version: int, timeout: float | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Wait for ``version``, then yield its tensors, each copied out of the file.

        The wait (and its TransportTimeout) happens here, not on the first ``next``.
        """
        from safetensors import safe_open

        if self._closed:
            raise TransportError(f"shm receiver {self.worker_id} is closed")
        timeout = self.default_timeout if timeout is None else timeout
        path = version_file(self.directory, version)
        start = time.monotonic()
        while True:
            try:
                handle = safe_open(str(path), framework="pt")
                break
            except FileNotFoundError:
                pass
            latest = _read_latest(self.directory)
            if latest is not None and latest > version and not path.exists():
                raise TransportError(
                    f"weights version {version} is no longer in {self.directory}: version {latest} "
                    "replaced it (only the newest versions are kept); ask for latest_version()"
                )
            waited = time.monotonic() - start
            if waited >= timeout:
                raise TransportTimeout(
                    f"weights version {version} did not appear in {self.directory} within "
                    f"{timeout:g} s (newest there: {latest if latest is not None else 'none'}); "
                    "is the trainer running?"
                )
            time.sleep(min(self.poll_interval, max(timeout - waited, 0.0)))
        # Opened: the file may now be removed by the sender without harm (Linux keeps it
        # alive for us), so reading is not racing a newer version.
        return self._read(handle, version, path)

    def _read(self, handle: Any, version: int, path: Path) -> Iterator[tuple[str, torch.Tensor]]:
        with handle as f:
            meta = f.metadata() or {}
            got = meta.get("forgerl_version")
            if got != str(version):
                raise TransportError(f"{path} holds version {got!r}, expected {version}")
            names = json.loads(meta["forgerl_names"]) if "forgerl_names" in meta else list(f.keys())
            aliases: dict[str, str] = json.loads(meta.get("forgerl_aliases") or "{}")
            # An alias is the same tensor as its target, as it was on the sender's side.
            targets = set(aliases.values())
            kept: dict[str, torch.Tensor] = {}
            for name in names:
                if name in aliases:
                    yield name, kept[aliases[name]]
                    continue
                # get_tensor maps the file lazily; the copy makes the tensor independent of
                # the file, whose pages are freed once the sender removes it.
                tensor = f.get_tensor(name).clone()
                if name in targets:
                    kept[name] = tensor
                yield name, tensor

    def close(self) -> None:
        self._closed = True
