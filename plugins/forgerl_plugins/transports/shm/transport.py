"""The ``shm`` transport: versioned safetensors files in one directory (shared memory).

The sender (trainer rank 0) writes each version to ``v<version:08d>.safetensors`` under a
temporary name, fsyncs it and renames it into place, then points ``LATEST`` at it: a
receiver sees a version complete or not at all. Receivers (generator workers on the same
machine) poll for the file of the version they are asked for and copy its tensors out.

Pull-based: ``send`` returns once the version is published; it does not wait for readers.
The directory is in ``/dev/shm`` (RAM-backed tmpfs) when it has room, so a version costs
one memcpy to write and one to read, no disk.

The weights are the run's: the directory is created 0700 and every file in it 0600 from
the moment it exists (``/dev/shm`` is world-writable and shared by every user of the
machine). Receivers run as the same user.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from forgerl.errors import TransportError
from forgerl.interfaces import EngineReceiver, RunContext, Transport, TransportSender
from forgerl.types import WeightSet, tie_key

from .receiver import (
    _VERSION_FILE,
    DEFAULT_TIMEOUT,
    LATEST,
    ShmReceiver,
    _versions_on_disk,
    version_file,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger(__name__)

SHM_ROOT = Path("/dev/shm")
# Free space wanted in /dev/shm when the model size is unknown.
MIN_SHM_FREE = 256 * 2**20


def _write_file(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """Write one safetensors file (module-level so that tests can make it fail mid-way)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _private_file(path: Path) -> None:
    """Create ``path`` empty with mode 0600 (whatever the umask), so that a writer opening
    it afterwards never exposes what it writes, not even for a moment."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


def _private_directory(path: Path) -> None:
    """Create ``path`` (and missing parents) with mode 0700; an existing directory keeps its
    mode, with a warning when others may read or enter it."""
    try:
        path.mkdir(mode=0o700, parents=True)
        os.chmod(path, 0o700)  # mkdir's mode is filtered by the umask
    except FileExistsError:
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            log.warning(
                "shm: %s (mode %o) lets other users list it; the weight files in it are 0600, but "
                "`chmod 700 %s` keeps even their names private",
                path,
                mode,
                path,
            )


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        _private_file(tmp)
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _estimated_version_bytes(ctx: RunContext | None) -> int | None:
    """Size of one version: the model's weight files (None when unknown)."""
    if ctx is None or ctx.model_path is None:
        return None
    folder = Path(ctx.model_path)
    if not folder.is_dir():
        return None
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors")) or sum(
        p.stat().st_size for p in folder.glob("*.bin")
    )
    return size or None


class ShmSender(TransportSender):
    """Publishes versions into ``directory``. Owns it: :meth:`close` removes what it wrote."""

    def __init__(self, directory: Path, keep_versions: int, *, owns_directory: bool) -> None:
        self.directory = directory
        self.keep_versions = keep_versions
        self.owns_directory = owns_directory
        self.last_version: int | None = None
        #: Seconds and bytes of the last :meth:`send` (write + fsync + publish).
        self.last_send_seconds: float | None = None
        self.last_send_bytes: int = 0
        self._closed = False
        _private_directory(directory)
        # Versions left by an earlier process (a crashed run being resumed) would be served
        # as if this trainer had sent them: a resumed trainer re-sends from its checkpoint.
        self._remove_files()

    @property
    def last_send_bytes_per_s(self) -> float | None:
        if not self.last_send_seconds:
            return None
        return self.last_send_bytes / self.last_send_seconds

    def send(self, weights: WeightSet, timeout: float | None = None) -> None:
        """Write ``weights`` atomically and publish it. ``timeout`` is not used: publishing
        is local and returns when written; receivers apply their own timeouts."""
        if self._closed:
            raise TransportError(f"shm sender for {self.directory} is closed")
        version = int(weights.version)
        if self.last_version is not None and version <= self.last_version:
            raise ValueError(
                f"weight versions must strictly increase: got {version} after {self.last_version}"
            )
        start = time.perf_counter()
        tensors, order, aliases = self._prepare(weights)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        final = version_file(self.directory, version)
        tmp = self.directory / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        metadata = {"format": "pt", "forgerl_version": str(version), "forgerl_names": json.dumps(order)}
        if aliases:
            metadata["forgerl_aliases"] = json.dumps(aliases)
        try:
            _private_file(tmp)
            _write_file(tensors, tmp, metadata)
            _fsync_path(tmp)
            os.replace(tmp, final)
        except OSError as exc:
            free = shutil.disk_usage(self.directory).free if self.directory.exists() else 0
            raise TransportError(
                f"could not write weights version {version} ({nbytes / 2**20:.1f} MiB) to "
                f"{self.directory}: {exc.strerror or exc} ({free / 2**20:.0f} MiB free); "
                "set transport.options.directory to a larger filesystem"
            ) from exc
        finally:
            tmp.unlink(missing_ok=True)
        _fsync_path(self.directory)
        _atomic_write_text(self.directory / LATEST, f"{version}\n")
        self.last_version = version
        self._remove_old_versions()
        self.last_send_seconds = time.perf_counter() - start
        self.last_send_bytes = nbytes
        log.debug(
            "shm: published version %d (%.1f MiB in %.3f s) in %s",
            version,
            nbytes / 2**20,
            self.last_send_seconds,
            self.directory,
        )

    @staticmethod
    def _prepare(weights: WeightSet) -> tuple[dict[str, torch.Tensor], list[str], dict[str, str]]:
        """The tensors to write (CPU, contiguous, unshared: safetensors refuses tensors that
        share memory), every name in order, and the aliases: a name whose tensor is one
        already written (tied embeddings: ``lm_head.weight`` is ``embed_tokens.weight``) is
        written once and recorded as ``{alias: name}``, which saves the bytes and the time
        of the copy (113 MiB of SmolLM2's 621). Iterates the set once, as its contract says."""
        tensors: dict[str, torch.Tensor] = {}
        order: list[str] = []
        aliases: dict[str, str] = {}
        first_with_tie_key: dict[tuple[Any, ...], str] = {}
        storages_written: set[tuple[int, int]] = set()
        for name, tensor in weights.items():
            if name in tensors or name in aliases:
                raise ValueError(f"weight name {name!r} appears twice in version {weights.version}")
            order.append(name)
            t = tensor.detach().to("cpu").contiguous()
            if t.numel():
                earlier = first_with_tie_key.setdefault(tie_key(t), name)
                if earlier != name:
                    aliases[name] = earlier
                    continue
                storage = t.untyped_storage()
                key = (storage.data_ptr(), storage.nbytes())
                if key in storages_written or t.storage_offset() or storage.nbytes() != t.nbytes:
                    t = t.clone()  # shares memory with another tensor, or a view of a bigger buffer
                else:
                    storages_written.add(key)
            tensors[name] = t
        return tensors, order, aliases

    def _remove_old_versions(self) -> None:
        for v in _versions_on_disk(self.directory)[: -self.keep_versions]:
            version_file(self.directory, v).unlink(missing_ok=True)

    def _remove_files(self) -> None:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return
        for n in names:
            if _VERSION_FILE.match(n) or n == LATEST or (n.startswith(".v") and ".tmp-" in n):
                (self.directory / n).unlink(missing_ok=True)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.owns_directory:
            shutil.rmtree(self.directory, ignore_errors=True)
        else:
            # A directory the user named may hold other things: remove only our files.
            self._remove_files()
            try:
                self.directory.rmdir()
            except OSError:
                pass


class ShmTransport(Transport):
    """Factory ``ShmTransport(options, *, context)``; ``context`` is None in a receiver process
    (then :meth:`receiver` needs the sender's :meth:`receiver_spec` or ``options.directory``)."""

    name = "shm"
    description = "safetensors in shared memory, written atomically"
    requires = ("torch", "safetensors")

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")

        directory: str | None = Field(
            None, description="Where versions are written (default: /dev/shm when large enough, else a temp dir)."
        )
        keep_versions: int = Field(2, ge=1, description="Versions kept on disk; older ones are removed.")
        poll_interval: float = Field(0.05, gt=0, description="Seconds between checks while a receiver waits.")

    @staticmethod
    def preflight(options: ShmTransport.Options) -> None:
        """Before ``forge run`` starts anything: a given ``directory`` is (or can be created as)
        a writable directory; a file there failed the trainer's first send with a raw
        ``FileExistsError``."""
        if options.directory is None:
            return
        from forgerl.errors import ConfigError
        from forgerl.rundirs.writable import directory_problem

        problem = directory_problem(Path(options.directory))
        if problem:
            raise ConfigError(
                f"transport.options.directory {options.directory!r} {problem}; give a writable directory "
                "(or leave it unset for /dev/shm)"
            )

    def __init__(self, options: Options, *, context: RunContext | None = None) -> None:
        self.options = options
        self.ctx = context
        self._directory: Path | None = Path(options.directory) if options.directory else None
        self._owns_directory = False

    @property
    def directory(self) -> Path:
        """Where versions live, chosen (and created) on first use."""
        if self._directory is None:
            self._directory = self._make_directory()
            self._owns_directory = True
        return self._directory

    def _make_directory(self) -> Path:
        per_version = _estimated_version_bytes(self.ctx)
        wanted = MIN_SHM_FREE if per_version is None else per_version * max(3, self.options.keep_versions + 1)
        if SHM_ROOT.is_dir() and os.access(SHM_ROOT, os.W_OK):
            from . import leftovers

            leftovers.sweep(SHM_ROOT)  # what killed senders left takes memory: before counting it
            free = shutil.disk_usage(SHM_ROOT).free
            if free >= wanted:
                folder = Path(tempfile.mkdtemp(prefix=leftovers.PREFIX, dir=SHM_ROOT))
                leftovers.claim(folder)
                return folder
            log.warning(
                "shm: %s has %.0f MiB free, %.0f MiB wanted; using a directory on disk",
                SHM_ROOT,
                free / 2**20,
                wanted / 2**20,
            )
        if self.ctx is not None:
            path = Path(self.ctx.run_dir) / "weights"
            _private_directory(path)
            return path
        return Path(tempfile.mkdtemp(prefix="forgerl-weights-"))

    def _timeout(self) -> float:
        if self.ctx is not None:
            return float(self.ctx.transport_timeout)
        return DEFAULT_TIMEOUT

    def sender(self) -> ShmSender:
        directory = self.directory
        return ShmSender(directory, self.options.keep_versions, owns_directory=self._owns_directory)

    def receiver(self, worker_id: str, spec: Mapping[str, Any] | None = None) -> ShmReceiver:
        if spec and spec.get("directory"):
            directory = Path(spec["directory"])
        elif self._directory is not None or self.ctx is not None:
            directory = self.directory
        else:
            raise TransportError(
                "shm receiver does not know where the weights are: pass the sender's "
                "receiver_spec() or set transport.options.directory"
            )
        return ShmReceiver(directory, worker_id, self.options.poll_interval, self._timeout())

    def receiver_spec(self) -> dict[str, Any]:
        return {"directory": str(self.directory)}

    engine_receivers = ("files",)

    def engine_receiver(self, worker_id: str, kind: str, *, ranks: int = 1) -> EngineReceiver:
        """``files``: each version staged alone in a folder (:mod:`.engine`)."""
        if kind != "files":
            return super().engine_receiver(worker_id, kind, ranks=ranks)
        from .engine import ShmFilesEngineReceiver

        return ShmFilesEngineReceiver(self.receiver(worker_id))

    def close(self) -> None:
        """Remove a directory this instance created (the sender's close does the same)."""
        if self._owns_directory and self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
