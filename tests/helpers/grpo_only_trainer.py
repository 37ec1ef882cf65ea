"""A plugin with a third-party trainer written before objectives existed: it says nothing
of them, so it trains ``grpo`` only (:attr:`forgerl.interfaces.Trainer.objectives`). Loaded
by import path (``FORGE_PLUGINS=tests.helpers.grpo_only_trainer``); never built."""

from __future__ import annotations

from forgerl.hookspecs import hookimpl
from forgerl.interfaces import Trainer


class GrpoOnly(Trainer):
    name = "grpo_only"
    description = "a trainer that predates supervised fine-tuning"

    def __init__(self, options, *, context):
        raise AssertionError("a run this trainer cannot train must be refused before it is built")

    def train_step(self, batch):
        raise AssertionError("not built")

    def export_weights(self, version):
        raise AssertionError("not built")

    def save(self, path):
        raise AssertionError("not built")

    def load(self, path):
        raise AssertionError("not built")


@hookimpl
def forge_trainers():
    return [GrpoOnly]
