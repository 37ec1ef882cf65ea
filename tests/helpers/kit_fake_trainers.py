"""A plugin of deliberately broken trainers, each the ``fsdp`` trainer with one rule of the
trainer kit (:class:`forgerl.testing.TrainerContract`) broken: the tests of the kit show
that each check can fail. Loaded by import path
(``plugins = ("tests.helpers.kit_fake_trainers",)``). Each is one class with a name of its
own; its options model, requires, local_preflight and the rest are ``fsdp``'s, inherited."""

from __future__ import annotations

from forgerl.hookspecs import hookimpl
from forgerl.types import WeightSet
from forgerl_plugins.trainers.fsdp.trainer import FSDPTrainer


class PrefixedNames(FSDPTrainer):
    """Exports the names of a DDP wrapper ('module.model.norm.weight')."""

    name = "kit_prefixed_names"

    def export_weights(self, version):
        weights = super().export_weights(version)
        return None if weights is None else WeightSet(version, {f"module.{k}": v for k, v in weights.tensors.items()})


class LiveExport(FSDPTrainer):
    """Exports its live parameters: the next step changes a version the transport holds."""

    name = "kit_live_export"

    def export_weights(self, version):
        return WeightSet(version, dict(self.model.state_dict()))


class IgnoresTemperature(FSDPTrainer):
    """Computes logprobs of the plain logits whatever the sampling temperature."""

    name = "kit_ignores_temperature"

    def __init__(self, options, *, context):
        super().__init__(options, context=context)
        self.temperature = 1.0


class ReportsOnlyTheLoss(FSDPTrainer):
    name = "kit_reports_only_the_loss"

    def train_step(self, batch):
        return {"loss": super().train_step(batch)["loss"]}


class DriftsEveryStep(FSDPTrainer):
    """Moves the final norm by a constant every step, gradient or not."""

    name = "kit_drifts_every_step"

    def train_step(self, batch):
        import torch

        metrics = super().train_step(batch)
        with torch.no_grad():
            self.model.get_parameter("model.norm.weight").add_(1e-3)
        return metrics


class ForgetsTheOptimizer(FSDPTrainer):
    """Loads the model from a checkpoint but starts a fresh optimiser (no Adam moments)."""

    name = "kit_forgets_the_optimizer"

    def load(self, path):
        import torch

        super().load(path)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.options.lr)


class KeepsItsProcessGroup(FSDPTrainer):
    """Leaves the default process group it created behind when closed."""

    name = "kit_keeps_its_process_group"

    def close(self):
        self._owns_process_group = False
        super().close()


class SftAtSamplingTemperature(FSDPTrainer):
    """Takes the supervised loss at the sampling temperature, as the RL loss's logprobs are."""

    name = "kit_sft_at_sampling_temperature"

    def _forward_logprobs(
        self, model, input_ids, attention_mask, entropy=False, positions=None, temperature=None, images=None
    ):
        return super()._forward_logprobs(model, input_ids, attention_mask, entropy, positions, images=images)
class AdvantagePerRow(FSDPTrainer):
    """Reads per-token advantages as one per row (their mean over the row's loss tokens)."""

    name = "kit_advantage_per_row"

    def train_step(self, batch):
        from dataclasses import replace

        if batch.advantages.dim() == 2:
            counted = (batch.loss_mask != 0).sum(-1).clamp(min=1)
            batch = replace(batch, advantages=(batch.advantages * batch.loss_mask).sum(-1) / counted)
        return super().train_step(batch)


class AdvantageOneTokenOff(FSDPTrainer):
    """Reads the advantage of token t at position t - 1 (the logits' position)."""

    name = "kit_advantage_one_token_off"

    def train_step(self, batch):
        from dataclasses import replace

        import torch

        if batch.advantages.dim() == 2:
            shifted = torch.zeros_like(batch.advantages)
            shifted[:, 1:] = batch.advantages[:, :-1]
            batch = replace(batch, advantages=shifted)
        return super().train_step(batch)


@hookimpl
def forge_trainers():
    return [
        PrefixedNames,
        LiveExport,
        IgnoresTemperature,
        ReportsOnlyTheLoss,
        DriftsEveryStep,
        ForgetsTheOptimizer,
        KeepsItsProcessGroup,
        SftAtSamplingTemperature,
        AdvantagePerRow,
        AdvantageOneTokenOff,
    ]
