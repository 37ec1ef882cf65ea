"""``fsdp``: torch FSDP2 (``fully_shard``) on 1..N ranks; gloo on CPU, NCCL on GPU."""

from __future__ import annotations

from forgerl.hookspecs import hookimpl


@hookimpl
def forge_trainers():
    return ["forgerl_plugins.trainers.fsdp.trainer:FSDPTrainer"]
