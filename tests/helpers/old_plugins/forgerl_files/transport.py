# src/forgerl_files/transport.py (the tutorial's, plus the run's timeout read as that day's tutorials did)
"""The ``files`` transport: each version is one file in a directory both halves read.

The sender writes a version under a temporary name and renames it into place: a receiver
sees the whole file or no file, so it never yields a partial version."""

import os
import shutil
import tempfile
import time
from pathlib import Path

from pydantic import Field

from forgerl.errors import TransportError, TransportTimeout
from forgerl.interfaces import Transport, TransportReceiver, TransportSender
from forgerl.options import OptionsModel

LATEST = "LATEST"
DEFAULT_TIMEOUT = 120.0  # when a caller gives none: never wait forever


def version_file(directory: Path, version: int) -> Path:
    return directory / f"v{version:08d}.pt"


def read_latest(directory: Path) -> int | None:
    try:
        return int((directory / LATEST).read_text())
    except (FileNotFoundError, ValueError):
        return None


def write_atomically(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)  # atomic: readers see the old file or the new one
    finally:
        tmp.unlink(missing_ok=True)


class FilesSender(TransportSender):
    def __init__(self, directory: Path, keep_versions: int):
        self.directory = directory
        self.keep_versions = keep_versions
        self.last: int | None = None

    def send(self, weights, timeout=None):
        import torch

        if self.last is not None and weights.version <= self.last:
            raise ValueError(f"weights version {weights.version} after {self.last}: versions must increase")
        # Copied to CPU here: the trainer may reuse its buffers once send returns.
        tensors = {name: t.detach().to("cpu", copy=True) for name, t in weights.items()}
        try:
            write_atomically(version_file(self.directory, weights.version), lambda p: torch.save(tensors, p))
            write_atomically(self.directory / LATEST, lambda p: p.write_text(str(weights.version)))
        except OSError as exc:
            raise TransportError(f"files transport: cannot write version {weights.version}: {exc}") from exc
        self.last = weights.version
        for old in sorted(self.directory.glob("v*.pt"))[: -self.keep_versions]:
            old.unlink(missing_ok=True)  # a reader that opened it keeps reading (POSIX)


class FilesReceiver(TransportReceiver):
    def __init__(self, directory: Path, worker_id: str, poll_interval: float, default_timeout: float):
        self.directory = directory
        self.worker_id = worker_id
        self.poll_interval = poll_interval
        self.default_timeout = default_timeout

    def latest_version(self):
        return read_latest(self.directory)

    def receive(self, version, timeout=None):
        """Wait for ``version``, load all of it, then yield its tensors. The wait and
        its TransportTimeout happen here, before anything is yielded."""
        import torch

        timeout = self.default_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        path = version_file(self.directory, version)
        while True:
            try:
                tensors = torch.load(path, weights_only=True)
                break
            except FileNotFoundError:
                latest = self.latest_version()
                # Versions only increase: once a later one is out, this one will not come.
                if latest is not None and latest > version and not path.exists():
                    raise TransportError(
                        f"{self.worker_id}: version {version} is gone (the sender is at {latest})"
                    ) from None
                if time.monotonic() >= deadline:
                    raise TransportTimeout(
                        f"{self.worker_id}: weights version {version} did not appear in "
                        f"{self.directory} within {timeout} s"
                    ) from None
                time.sleep(self.poll_interval)
        return iter(tensors.items())


class FilesTransport(Transport):
    """``FilesTransport(options, *, context)``. In a run (``context`` given) it creates
    its directory unless the options name one; built with ``context=None`` (a receiver
    in another process) it learns the directory from :meth:`receiver_spec`."""

    name = "files"  # --transport files
    description = "each weight version as one file in a shared directory"
    requires = ("torch",)  # checked without importing it

    class Options(OptionsModel):
        directory: str | None = Field(None, description="Shared directory; unset: a new temporary one.")
        keep_versions: int = Field(2, ge=1, description="Versions kept on disk.")
        poll_interval: float = Field(0.01, gt=0, le=1, description="Seconds between looks for a version.")

    def __init__(self, options: Options, *, context):
        self.options = options
        self.owned: Path | None = None
        if options.directory is not None:
            self.directory: Path | None = Path(options.directory)
        elif context is not None:
            self.directory = self.owned = Path(tempfile.mkdtemp(prefix="forge-files-"))
        else:
            self.directory = None
        # A receive given no timeout waits as long as the run's transport timeout allows.
        self.timeout = float(context.config.transport.timeout) if context is not None else DEFAULT_TIMEOUT

    def sender(self):
        if self.directory is None:
            raise TransportError("files transport: a sender needs a run context or options.directory")
        return FilesSender(self.directory, self.options.keep_versions)

    def receiver(self, worker_id, spec=None):
        directory = (spec or {}).get("directory") or self.directory
        if directory is None:
            raise TransportError("files transport: pass the sender side's receiver_spec() to receiver()")
        return FilesReceiver(Path(directory), worker_id, self.options.poll_interval, self.timeout)

    def receiver_spec(self):
        return {"directory": str(self.directory)}

    def close(self):
        if self.owned is not None:
            shutil.rmtree(self.owned, ignore_errors=True)
            self.owned = None
