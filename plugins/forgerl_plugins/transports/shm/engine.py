"""The ``shm`` transport's receiver for an engine that loads a folder itself (SGLang's
``/update_weights_from_disk``): each version, already one safetensors file in the
transport's directory, is hard-linked alone into a folder of its own, which is what such
an engine reads (it loads every ``*.safetensors`` of a folder, and the transport's
directory holds several versions). No copy: the link shares the file's pages.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from forgerl.errors import TransportError
from forgerl.interfaces import FilesEngineReceiver

from .receiver import ShmReceiver, version_file

#: The file's name in a staged folder: what ``save_pretrained`` names a one-file model.
STAGED_NAME = "model.safetensors"


class ShmFilesEngineReceiver(FilesEngineReceiver):
    """Stages versions of ``directory`` as ``<directory>/engine-<worker>/v<version>/``."""

    def __init__(self, inner: ShmReceiver) -> None:
        self._inner = inner
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in inner.worker_id)
        self.root = inner.directory / f"engine-{safe}"

    def latest_version(self) -> int | None:
        return self._inner.latest_version()

    def stage(self, version: int, timeout: float | None = None) -> Path:
        # The inner receiver waits for the file and checks its version header (raising
        # TransportTimeout / TransportError as a receiver does) when the first tensor is
        # asked for; the rest is left to the engine, which reads the file.
        tensors = self._inner.receive(version, timeout)
        next(iter(tensors), None)
        close = getattr(tensors, "close", None)
        if close is not None:
            close()
        folder = self.root / f"v{version:08d}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(mode=0o700, parents=True)
        try:
            os.link(version_file(self._inner.directory, version), folder / STAGED_NAME)
        except FileNotFoundError:
            shutil.rmtree(folder, ignore_errors=True)
            raise TransportError(
                f"weights version {version} left {self._inner.directory} before it could be staged "
                "(a newer one replaced it); ask for latest_version()"
            ) from None
        except OSError as exc:
            shutil.rmtree(folder, ignore_errors=True)
            raise TransportError(f"cannot stage weights version {version} in {folder}: {exc}") from exc
        return folder

    def release(self, version: int) -> None:
        shutil.rmtree(self.root / f"v{version:08d}", ignore_errors=True)

    def close(self) -> None:
        self._inner.close()
        shutil.rmtree(self.root, ignore_errors=True)
