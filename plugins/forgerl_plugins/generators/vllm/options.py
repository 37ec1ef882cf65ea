"""The ``vllm`` generator's options (``VLLMGenerator.Options``), in a module of their own so
that the parts the class assembles (:mod:`.engine`, :mod:`.fleet`, :mod:`.server`,
:mod:`.preflight`) read them without importing the class."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from forgerl.configuration.config import MAX_SECONDS
from forgerl.options import OptionsModel


class Options(OptionsModel):
    replicas: int = Field(1, ge=1, le=1024, description="vLLM server processes; requests are balanced across them.")
    tensor_parallel_size: int = Field(1, ge=1, le=1024, description="Tensor-parallel workers per replica.")
    dtype: str = Field(
        "auto",
        pattern="^(auto|float32|bfloat16|float16)$",
        description="Serving dtype (auto: model.dtype of the run, so sampler and trainer agree).",
    )
    max_model_len: int | None = Field(None, ge=1, le=2**24, description="Context length (default: the model's).")
    kv_cache_gb: float | None = Field(
        None, gt=0, le=1 << 20, description="KV cache per replica in GiB (default: 1 on CPU, vLLM's own on GPU)."
    )
    enforce_eager: bool = Field(True, description="No torch.compile / CUDA graphs: fast start-up.")
    max_concurrency: int = Field(64, ge=1, le=1 << 20, description="HTTP requests in flight across all replicas.")
    update_policy: str = Field(
        "wait",
        pattern="^(wait|abort|keep)$",
        description="In-flight requests at a weight update: wait (drain first), abort (and resubmit), "
        "or keep (frozen in place, then continued with the new weights; their completions carry "
        "per-token versions, and a sample's staleness counts from its oldest token).",
    )
    stage_updates: bool = Field(
        False,
        description="At a weight update, read the new version from the transport while the replica still "
        "generates, and pause it only for the load (with the shm transport: one more copy of the weights in "
        "host memory during the update; full weights only, a LoRA adapter is read under the pause).",
    )
    prepack_updates: bool = Field(
        True,
        description="With stage_updates on a CPU server run with enforce_eager: also build the new packed linear "
        "layers before the pause, so that the pause only swaps them in (one more packed copy of the weights during the update; "
        "a model whose vLLM internals are not the expected ones is loaded through vLLM's reload, said once in "
        "the server's log).",
    )
    startup_timeout: float = Field(
        300.0,
        gt=0,
        le=MAX_SECONDS,
        description="Seconds to wait for a replica to become healthy (at start and after a restart).",
    )
    request_timeout: float = Field(600.0, gt=0, le=MAX_SECONDS, description="Seconds one generation request may take.")
    health_interval: float = Field(2.0, gt=0, le=3600, description="Seconds between health checks of each replica.")
    liveness_timeout: float = Field(
        60.0,
        gt=0,
        le=MAX_SECONDS,
        description="Seconds a running server's engine may go without answering its launcher's probe "
        "(tokens made since the last probe, or a one-token request) before the launcher kills it as hung; "
        "it is then restarted and re-synced like a crashed one. A weight load does not count.",
    )
    max_restarts: int = Field(3, ge=0, le=1000, description="Times the scheduler restarts a replica that dies.")
    host: str = Field("127.0.0.1", description="Address the servers bind to (loopback by default).")
    send_seed: bool = Field(
        True,
        description="Send per-request seeds to vLLM, so sampling is reproducible (default: on). On "
        "vLLM's CPU build this also turns chunked prefill off, which seeded requests need there; "
        "false leaves both off.",
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="Extra environment of the server processes."
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="More vLLM engine arguments, e.g. {max_num_seqs: 64} becomes --max-num-seqs 64.",
    )
    fleet: str | None = Field(
        None,
        description="Attach to the shared fleet of vLLM servers in this directory instead of starting "
        "servers (a LoRA trainer only; its adapter is served under a name of its own; docs/lora.md).",
    )
    max_adapters: int = Field(
        1, ge=1, le=256, description="LoRA adapters a server holds at once (--max-loras): a fleet's runs."
    )
