"""forgerl's own trainers, ``fsdp`` and ``torchtitan``, pass the trainer kit
(forgerl.testing.TrainerContract) on the tiny model: on one rank (each check builds the
trainer in this process, under a second), and two gloo ranks in their own processes
against one. ``torchtitan`` is skipped where TorchTitan is not installed, unless
FORGE_REQUIRE_TORCHTITAN=1 (CI) makes that a failure."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from forgerl.testing import TrainerContract


class TestFSDPTrainerKit(TrainerContract):
    backend = "fsdp"
    options = {"lr": 1e-3, "micro_batch_size": 2, "autocast_bf16": False}
    two_ranks = True

    @pytest.mark.integration
    @pytest.mark.slow  # two processes importing torch and transformers: 20-60 s on two busy cores
    def test_two_ranks_take_the_same_step_as_one(self, model_dir, tmp_path):
        super().test_two_ranks_take_the_same_step_as_one(model_dir, tmp_path)


class TestTorchTitanTrainerKit(TrainerContract):
    backend = "torchtitan"
    options = {"lr": 1e-3, "micro_batch_size": 2, "autocast_bf16": False}
    required = os.environ.get("FORGE_REQUIRE_TORCHTITAN") == "1"
    two_ranks = True

    @pytest.mark.integration
    @pytest.mark.slow  # two processes importing torch and TorchTitan
    def test_two_ranks_take_the_same_step_as_one(self, model_dir, tmp_path):
        super().test_two_ranks_take_the_same_step_as_one(model_dir, tmp_path)
