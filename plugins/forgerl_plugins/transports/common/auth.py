"""The run's transport secret, and values in the control store signed with it.

A torch ``TCPStore`` authenticates nobody: whoever reaches its port can list every key
(``list_keys``), read, write and delete. So the store is treated as a public blackboard
and what matters is who can *write what the transports act on*:

* every value the ``nccl`` and ``rdma`` transports write (registrations, requests,
  offers and layouts, acknowledgements, the rdma sender's memory address, the addresses
  of a process group's rendezvous) carries an HMAC-SHA256 tag over its full key and its
  bytes, made with a key derived from the run's secret. A reader checks the tag before
  it acts on a value; a value without a valid tag is refused (:class:`ForgedValue`).
  A stranger can therefore not register as a receiver (the sender drops unsigned
  registrations), cannot point a receiver at its own process group or memory, and cannot
  hand it a layout; copying a signed value to another key fails too (the key is signed).
* the sender proves the secret first (:data:`PROOF_KEY`), so a receiver with a wrong
  secret is refused at once with a message saying so, instead of timing out.

What this does not do (docs/security.md): it does not encrypt (a stranger can read the
layouts, and the rdma sender's address, and the bytes on the wire), it does not stop a
stranger from deleting or overwriting values (that breaks a transfer, and the transports
then fail it as they fail a dead peer), and the data channels themselves (gloo/NCCL
connections, Mooncake's reads) are not authenticated by their libraries.

The secret is 32 random bytes in hex: per run in ``<run_dir>/transport.secret`` (mode
0600), or per transport object when there is no run; receivers get it in the sender's
``receiver_spec()``, never on a command line.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import Any

from forgerl.errors import TransportError

SECRET_FILE = "transport.secret"
#: Written by the sender when it starts its store: a signed constant a receiver checks.
PROOF_KEY = "auth/proof"
PROOF_VALUE = b"forgerl transport v1"
_TAG_HEX = 64  # hex digits of an HMAC-SHA256 tag
_SEPARATOR = b":"


class ForgedValue(RuntimeError):
    """A value in the control store is not signed with the run's secret.

    A RuntimeError, like the store's own errors, so that the transports' loops treat it as
    a failed store operation (retry, or drop the peer it concerns), never as data."""


def new_secret() -> str:
    return secrets.token_hex(32)


def run_secret(run_dir: Path | str) -> str:
    """The run's secret from ``<run_dir>/transport.secret``, created (0600) if absent."""
    return secret_from_file(Path(run_dir) / SECRET_FILE)


def secret_from_file(path: Path | str) -> str:
    """The secret in ``path``, which is created (0600, a fresh secret) if absent.

    Creation is atomic (a private temporary file hard-linked into place), so a sender
    and a receiver of one run that start together agree on one secret."""
    path = Path(path)
    try:
        return _read(path)
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(new_secret() + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # fails if another process created it first: use theirs
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)
    return _read(path)


def _read(path: Path) -> str:
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise TransportError(
            f"{path} is readable by other users (mode {mode:o}): it holds the run's transport secret. "
            f"Run `chmod 600 {path}` (and check who read it) or delete it to make a new one"
        )
    secret = path.read_text().strip()
    if len(secret) < 32:
        raise TransportError(f"{path} does not hold a transport secret; delete it to make a new one")
    return secret


class Signer:
    """Signs and checks store values with a key derived from the run's secret."""

    def __init__(self, secret: str) -> None:
        if not secret:
            raise TransportError("a transport needs the run's secret to sign its control messages")
        # A key for this purpose only: the secret itself never goes into a tag.
        self._key = hmac.new(secret.encode(), b"forgerl transport control store", hashlib.sha256).digest()

    def _tag(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._key, key.encode() + b"\0" + value, hashlib.sha256).hexdigest().encode()

    def seal(self, key: str, value: str | bytes) -> bytes:
        """``value`` with its tag for ``key`` (the full key, namespace included)."""
        raw = value.encode() if isinstance(value, str) else bytes(value)
        return self._tag(key, raw) + _SEPARATOR + raw

    def open(self, key: str, sealed: bytes | str) -> bytes:
        """The value under its tag; :class:`ForgedValue` when the tag is not ours."""
        sealed = sealed.encode() if isinstance(sealed, str) else bytes(sealed)
        tag, sep, raw = sealed[:_TAG_HEX], sealed[_TAG_HEX : _TAG_HEX + 1], sealed[_TAG_HEX + 1 :]
        if sep != _SEPARATOR or not hmac.compare_digest(tag, self._tag(key, raw)):
            raise ForgedValue(
                f"control store value at {key!r} is not signed with this run's transport secret "
                "(written by someone else, or by a sender of another run)"
            )
        return raw


def signed_store(raw: Any, prefix: str, signer: Signer) -> Any:
    """A ``torch.distributed.Store`` over ``raw`` that keeps its keys under ``prefix`` and
    signs what it stores: what a process group's rendezvous goes through, so that the
    addresses the two ranks exchange (the peer each one connects to) are ones a holder of
    the secret wrote."""
    from torch.distributed import Store

    class SignedStore(Store):
        def __init__(self) -> None:
            super().__init__()

        def set(self, key: str, value: Any) -> None:
            raw.set(prefix + key, signer.seal(prefix + key, value))

        def get(self, key: str) -> bytes:
            return signer.open(prefix + key, raw.get(prefix + key))

        def multi_set(self, keys: list[str], values: list[Any]) -> None:
            for key, value in zip(keys, values):
                self.set(key, value)

        def multi_get(self, keys: list[str]) -> list[bytes]:
            return [self.get(key) for key in keys]

        def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
            if expected not in ("", b""):
                raise NotImplementedError("a signed store compares only against an absent key")
            sealed = signer.seal(prefix + key, desired)
            return signer.open(prefix + key, raw.compare_set(prefix + key, "", sealed))

        def wait(self, keys: list[str], timeout: Any = None) -> None:
            full = [prefix + k for k in keys]
            raw.wait(full) if timeout is None else raw.wait(full, timeout)

        def check(self, keys: list[str]) -> bool:
            return bool(raw.check([prefix + k for k in keys]))

        def add(self, key: str, amount: int) -> int:
            # A counter cannot carry a tag; nothing the transports act on is one.
            return int(raw.add(prefix + key, amount))

        def delete_key(self, key: str) -> bool:
            return bool(raw.delete_key(prefix + key))

        def num_keys(self) -> int:
            return int(raw.num_keys())

        def set_timeout(self, timeout: Any) -> None:
            raw.set_timeout(timeout)

    return SignedStore()
