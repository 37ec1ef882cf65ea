"""The ``delta`` transport's options (``DeltaTransport.Options``), in a module of their own so
that the sender and the receiver read them without importing the class that assembles them."""

from __future__ import annotations

from pydantic import Field

from forgerl.options import OptionsModel


class Options(OptionsModel):
    host: str = Field(
        "127.0.0.1",
        description="Address of trainer rank 0 as receivers reach it (the sender's one TCP port listens "
        "there; 0.0.0.0 for every interface, e.g. generators in another cluster).",
    )
    port: int = Field(0, ge=0, le=65535, description="The sender's TCP port (0: any free port).")
    advertise: str | None = Field(
        None,
        pattern=r"^[^\s:]+:\d{1,5}$|^\[[0-9a-fA-F:]+\]:\d{1,5}$",
        description="HOST:PORT receivers connect to, when something stands between them and the sender "
        "(a NAT, a port forward, a proxy, a Kubernetes service); default: host and the sender's port.",
    )
    secret_file: str | None = Field(
        None,
        description="File (mode 0600) holding the secret both sides authenticate with, for a sender and "
        "receivers started apart on a fixed port (default: <run_dir>/transport.secret, or the sender's "
        "receiver_spec()).",
    )
    timeout: float | None = Field(
        None, gt=0, description="Default seconds for a send or receive (None: the run's transport.timeout)."
    )
    connect_timeout: float = Field(30.0, gt=0, description="Seconds to reach the sender and authenticate.")
    stall_timeout: float = Field(
        30.0,
        gt=0,
        description="Seconds a receiver may go without reading a block or acknowledging a version before "
        "the sender drops it as dead (the others go on).",
    )
    block_mb: int = Field(
        4, ge=1, le=64, description="Each tensor is encoded and sent in blocks of at most this many MiB."
    )
    level: int = Field(
        1,
        ge=-7,
        le=19,
        description="zstandard level of the xor-encoded blocks (1: fast; higher: smaller, slower).",
    )
    seed: bool = Field(
        True,
        description="A receiver that holds nothing (a new or restarted generator) gets its first version as "
        "a delta against the model folder it loaded, when its files give the trainer's starting weights "
        "exactly (digests compared; else the version goes whole).",
    )
