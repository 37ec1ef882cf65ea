"""The ``nccl`` transport's options (``NcclTransport.Options``), in a module of their own so
that the parts the class assembles (:mod:`.sender`, :mod:`.receiver`, :mod:`.groups`) read
them without importing the class."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from forgerl_plugins.transports.common.options import StoreHostedOptions


class Options(StoreHostedOptions):
    """The store-hosted transports' options (host, port, timeouts, ...) and nccl's own."""

    bucket_mb: int = Field(256, ge=1, description="Tensors are moved in chunks of at most this many MiB.")
    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="Process-group backend: auto = nccl where CUDA is available, else gloo."
    )
    stall_timeout: float = Field(
        10.0,
        gt=0,
        description="Seconds a receiver may go without a chunk completing (or without acknowledging after "
        "its last one) before it is dropped as dead, so that the others go on.",
    )
