"""The trainer's LoRA adapter on the ``hf`` generator's model (``context.adapter``).

The generator wraps its model's targeted linear layers with PEFT exactly as the trainer
does (:func:`forgerl_plugins.trainers.shared.lora.apply_lora`: the same options resolve
to the same layers of the same model), so a received version's tensors, under PEFT's
file names, have one place each. Loading a version copies A and B into those places;
the base weights are never touched and nothing is merged. Until the first version
arrives (version 0, the base model) the adapter layers are switched off, so the model
computes exactly as the base model does.

The forward pass is PEFT's ``W x + scale * B A x`` on both sides: the generator's
logprobs equal the trainer's with the adapter applied.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from forgerl.errors import TransportError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from forgerl.adapters import LoraOptions


class ServedAdapter:
    """``ServedAdapter(model, lora)``: wraps ``model`` in place (it keeps its module tree;
    call it as before) with an adapter that is off until :meth:`load` puts a version in."""

    def __init__(self, model: Any, lora: LoraOptions) -> None:
        from forgerl_plugins.trainers.shared.lora import apply_lora, exported_names

        peft_model, self.targets = apply_lora(model, lora)
        peft_model.eval().requires_grad_(False)  # no dropout, no gradients: it only samples
        self._tuner = peft_model.base_model  # PEFT's LoraModel: switches its layers on and off
        own = {n: p for n, p in peft_model.named_parameters() if ".lora_A." in n or ".lora_B." in n}
        # The exported name of each parameter (PEFT's adapter_model.safetensors names, as
        # the trainer sends them) -> the parameter itself.
        self.params: dict[str, torch.Tensor] = exported_names(own)
        self.on = False
        self._tuner.disable_adapter_layers()

    @property
    def nbytes(self) -> int:
        """What one version of this adapter holds, in bytes."""
        return sum(p.numel() * p.element_size() for p in self.params.values())

    def check(self, version: int, staged: dict[str, torch.Tensor]) -> None:
        """TransportError unless ``staged`` holds exactly this adapter's tensors, with its
        shapes (a full model's weights, another rank or other target modules are told apart)."""
        unknown = sorted(set(staged) - set(self.params))
        missing = sorted(set(self.params) - set(staged))
        if unknown or missing:
            raise TransportError(
                f"adapter version {version} does not match the generator's adapter "
                f"({len(self.params)} tensors on {len(self.targets)} layers): "
                + "; ".join(
                    part
                    for part in (
                        f"unknown {few(unknown)}" if unknown else "",
                        f"missing {few(missing)}" if missing else "",
                    )
                    if part
                )
                + " (does the trainer train the same trainer.options.lora on the same model?)"
            )
        wrong = [
            f"{n} {tuple(t.shape)} (adapter: {tuple(self.params[n].shape)})"
            for n, t in staged.items()
            if tuple(t.shape) != tuple(self.params[n].shape)
        ]
        if wrong:
            raise TransportError(f"adapter version {version} has wrong shapes: {few(wrong)}")

    def load(self, staged: dict[str, torch.Tensor]) -> None:
        """Copy a checked version into A and B and switch the adapter on."""
        import torch

        with torch.no_grad():
            for name, tensor in staged.items():
                self.params[name].copy_(tensor)
        if not self.on:
            self._tuner.enable_adapter_layers()
            self.on = True


def few(names: list[str], limit: int = 5) -> str:
    """The first ``limit`` of ``names``, and how many more there are."""
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
