"""Backends that do not take images say so in one line when handed one, never dropping it:
the sglang generator (any ReplicaPool without ``accepts_images``) and the torchtitan
trainer. Fakes only, well under 1 s."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from forgerl.errors import NotSupported
from forgerl.types import GenerationRequest, ImageInputs, SamplingParams


def test_a_replica_pool_without_accepts_images_refuses_a_request_with_images() -> None:
    from forgerl_plugins.generators.common.pool import ReplicaPool
    from forgerl_plugins.generators.sglang.generator import SGLangGenerator
    from forgerl_plugins.generators.vllm.generator import VLLMGenerator

    assert not SGLangGenerator.accepts_images and VLLMGenerator.accepts_images
    pool = SimpleNamespace(_closed=False, accepts_images=False, engine=SimpleNamespace(role="sglang"))
    request = GenerationRequest("r1", [1, 2], 1, SamplingParams(), images=ImageInputs(images=("x",), features={}))
    with pytest.raises(NotSupported, match="the sglang generator does not take images yet") as info:
        asyncio.run(ReplicaPool.generate(pool, [request]))  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


def test_the_torchtitan_trainer_refuses_image_rows() -> None:
    pytest.importorskip("torch")
    from forgerl_plugins.trainers.fsdp.trainer import FSDPTrainer
    from forgerl_plugins.trainers.shared.base import ShardedTrainer
    from forgerl_plugins.trainers.torchtitan.trainer import TorchTitanTrainer

    assert FSDPTrainer.accepts_images and not TorchTitanTrainer.accepts_images
    trainer = SimpleNamespace(name="torchtitan")
    with pytest.raises(NotSupported, match="the torchtitan trainer does not train on images; use trainer fsdp"):
        ShardedTrainer._image_logits(trainer, None, None, None, [None])  # type: ignore[arg-type]
