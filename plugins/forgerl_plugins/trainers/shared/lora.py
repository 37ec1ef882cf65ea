"""LoRA on a Hugging Face causal LM, with PEFT (``pip install 'forgerl[lora]'``).

PEFT wraps each matching ``nn.Linear`` in place (the base weight stays where it was, A and
B sit beside it), so the model keeps its module tree and a trainer shards it as before:
FSDP2's ``fully_shard`` on each decoder layer takes the layer's frozen base weights and
its trainable A and B into one unit (FSDP2 allows frozen and trainable parameters in one
unit; it reduces gradients only for those that have them). The adapter is applied before
sharding, so its parameters are sharded with their layer.

* Only A and B require gradients; the optimizer is built over those alone. A trainer
  draws A from the run's seed and the layer's name (:func:`fresh_a`), so ``fsdp`` and
  ``torchtitan`` start from the same adapter.
* The KL reference is the same model with the adapter switched off
  (:func:`adapter_off`): the base weights are not copied.
* The adapter is exported under the names of PEFT's ``adapter_model.safetensors``
  (:func:`exported_names`), which vLLM's LoRA loader reads.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from forgerl.errors import BackendUnavailable, ConfigError
from forgerl_plugins.models.vision import in_vision_tower

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from forgerl.adapters import LoraOptions

#: PEFT's name for the one adapter a trainer trains (it appears in parameter names).
ADAPTER = "default"


def target_names(model: Any, lora: LoraOptions) -> list[str]:
    """The full names of the linear layers of ``model`` that ``lora`` targets; ConfigError
    when none matches, or a match is not a linear layer or is the output layer."""
    import torch

    head = model.get_output_embeddings()
    found, refused = [], []
    for name, module in model.named_modules():
        # A vision-language model's vision encoder stays frozen: the adapter is the
        # language model's (docs/vision.md).
        if not name or not lora.targets(name) or in_vision_tower(name):
            continue
        if module is head or not isinstance(module, torch.nn.Linear):
            refused.append(name)
        else:
            found.append(name)
    if refused and not found:
        raise ConfigError(
            f"trainer.options.lora.target_modules {lora.target_modules} match only {refused[:3]}, which are not "
            "linear layers inside the model (or are its output layer): name projections such as q_proj, v_proj"
        )
    if not found:
        sample = sorted({n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ConfigError(
            f"trainer.options.lora.target_modules {lora.target_modules} match no linear layer of the model; "
            f"its linear layers are named {sample}"
        )
    return found


def apply_lora(model: Any, lora: LoraOptions) -> tuple[Any, list[str]]:
    """``model`` with a fresh adapter (B = 0) on the layers ``lora`` targets, only the
    adapter trainable; and the names of those layers."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise BackendUnavailable(
            f"trainer.options.lora needs PEFT ({exc}): pip install 'forgerl[lora]'"
        ) from exc
    names = target_names(model, lora)
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.lora_alpha,
        lora_dropout=lora.dropout,
        # Full names: PEFT matches an entry by suffix, so these match exactly these layers.
        target_modules=names,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config, adapter_name=ADAPTER), names


def fresh_a(module: str, shape: tuple[int, int], seed: int) -> torch.Tensor:
    """A fresh adapter's A for the layer whose Hugging Face name is ``module``: Kaiming
    uniform with ``a = sqrt(5)`` as PEFT draws it (bound ``1 / sqrt(in)``), from a generator
    seeded by the run's ``seed`` and the name. Every trainer (whatever its module names
    and order) and every rank start from the same adapter for the same seed."""
    import zlib

    import torch

    generator = torch.Generator().manual_seed(((seed & 0xFFFFFFFF) << 32) | zlib.crc32(module.encode()))
    bound = 1 / math.sqrt(shape[1])
    return (torch.rand(shape, generator=generator, dtype=torch.float32) * 2 - 1) * bound


def seed_adapter(model: Any, names: list[str], seed: int) -> None:
    """Set each A of the PEFT ``model`` (from :func:`apply_lora`, not yet sharded) on the
    layers ``names`` to :func:`fresh_a`'s (B stays zero)."""
    import torch

    base = model.get_base_model()
    with torch.no_grad():
        for name in names:
            weight = base.get_submodule(name).lora_A[ADAPTER].weight
            weight.copy_(fresh_a(name, tuple(weight.shape), seed))


@contextlib.contextmanager
def adapter_off(model: Any) -> Iterator[None]:
    """Within it, ``model`` computes as its base model (every adapter layer skipped): a
    PeftModel (``fsdp``) or a model PEFT's layers were injected into (``torchtitan``)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)  # trainable again (PEFT froze A and B while off)


@contextlib.contextmanager
def adapter_dropout(model: Any, dropout: float) -> Iterator[None]:
    """Within it, the adapter's dropout layers drop (the model stays in eval mode
    otherwise: the trainer's logprobs are those of the policy the generator samples)."""
    if dropout <= 0:
        yield
        return
    layers = [m for n, m in model.named_modules() if n.endswith(f"lora_dropout.{ADAPTER}")]
    for m in layers:
        m.train()
    try:
        yield
    finally:
        for m in layers:
            m.eval()


def exported_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's tensors of a (trainable-only) model state dict under the names of
    PEFT's ``adapter_model.safetensors``: ``...q_proj.lora_A.default.weight`` becomes
    ``...q_proj.lora_A.weight`` (the ``base_model.model.`` prefix stays)."""
    out = {}
    marker = f".{ADAPTER}."
    for name, tensor in state.items():
        if ".lora_A." not in name and ".lora_B." not in name:
            raise ValueError(f"{name!r} is trainable but not a LoRA A or B matrix")
        out[name.replace(marker, ".", 1)] = tensor
    return out
