"""LoRA adapters: what a trainer trains instead of the full weights, and what the
generators serve on top of the base model.

:class:`LoraOptions` is the one description of an adapter. A trainer that trains one
takes it as its options' ``lora`` field (``trainer.options.lora``, None: full
fine-tuning); the core reads it from there once, when the run's context is made
(:meth:`forgerl.interfaces.RunContext.for_run` puts it in ``context.adapter``), so a
generator learns that it serves an adapter, and of which rank, without reading the
trainer's section of the config.

An adapter travels like any weights (a :class:`~forgerl.types.WeightSet` over the run's
transport) under the names of a PEFT ``adapter_model.safetensors``
(``base_model.model.<module>.lora_A.weight`` and ``lora_B``), which both PEFT and vLLM read.
"""

from __future__ import annotations

import fnmatch

from pydantic import Field, field_validator

from forgerl.options import OptionsModel

#: The projections of the Llama/Qwen/Mistral family's attention and MLP blocks (SmolLM2
#: and the tiny test model among them): every linear layer of a decoder block.
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

#: The name every generator serves the policy's adapter under, whatever its version.
ADAPTER_NAME = "forge-adapter"


class LoraOptions(OptionsModel):
    """A low-rank adapter on the matching linear layers: ``W x + (alpha / rank) B A x``,
    with ``B`` zero at the start (the adapter begins as the base model)."""

    rank: int = Field(16, ge=1, le=512, description="Rank of each adapter's A and B matrices (at most 512).")
    alpha: int | None = Field(
        None, ge=1, le=1_000_000,
        description="Scale numerator: updates are scaled by alpha / rank (None: the rank, scale 1).",
    )
    dropout: float = Field(
        0.0, ge=0, lt=1, description="Dropout on the adapter's input during the update forward (never when scoring)."
    )
    target_modules: list[str] = Field(
        list(DEFAULT_TARGETS),
        min_length=1,
        max_length=256,
        description="Linear layers that get an adapter: glob patterns matched against a module's last name "
        "(q_proj) or its full dotted name (model.layers.*.self_attn.q_proj). The output layer never does.",
    )

    @field_validator("target_modules")
    @classmethod
    def _patterns_name_something(cls, value: list[str]) -> list[str]:
        bad = [p for p in value if not p.strip() or len(p) > 512]
        if bad:
            raise ValueError(f"target_modules: each pattern must be a non-empty name of at most 512 characters, got {bad!r}")
        return value

    @property
    def scale(self) -> float:
        """``alpha / rank``: what the adapter's product is multiplied by."""
        return self.lora_alpha / self.rank

    @property
    def lora_alpha(self) -> int:
        """``alpha``, the rank when unset."""
        return self.alpha if self.alpha is not None else self.rank

    def targets(self, module_name: str) -> bool:
        """Whether the module called ``module_name`` (dotted, as ``named_modules`` gives it)
        matches one of :attr:`target_modules`."""
        last = module_name.rpartition(".")[2]
        return any(fnmatch.fnmatchcase(last, p) or fnmatch.fnmatchcase(module_name, p) for p in self.target_modules)

    def peft_config(self, target_modules: list[str]) -> dict[str, object]:
        """The ``adapter_config.json`` of this adapter on the modules ``target_modules``
        (the names it matched, relative to the base model), as PEFT writes it and vLLM reads it."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.rank,
            "lora_alpha": self.lora_alpha,
            "lora_dropout": self.dropout,
            "target_modules": sorted(target_modules),
            "bias": "none",
            "use_rslora": False,
            "use_dora": False,
            "modules_to_save": None,
        }
