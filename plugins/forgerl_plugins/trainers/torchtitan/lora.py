"""LoRA on a TorchTitan model, with PEFT: the ``torchtitan`` trainer's counterpart of
:mod:`..shared.lora` (which works on Hugging Face models).

TorchTitan's decoder names its projections its own way (``attention.qkv_linear.wq``,
``feed_forward.w1``, ...), while users name targets as Hugging Face does (``q_proj``,
``gate_proj``) and generators load adapters under Hugging Face names. The model's
state-dict adapter already maps each weight between the two (``from_hf_map``), so here
each TorchTitan linear layer gets the Hugging Face name of its module, the patterns of
``trainer.options.lora`` are matched against that, and PEFT's ``inject_adapter_in_model``
wraps the matching layers of the model (still on the meta device, before FSDP2 shards
each decoder layer: a layer's frozen weight and its A and B land in one unit).

The Llama adapter permutes q and k rows (Hugging Face's rotate-half layout against
TorchTitan's interleaved pairs); B maps a layer's input to its output rows, so B's rows
are permuted as the weight's are, and A (input side) is left as it is.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from forgerl.errors import BackendUnavailable, ConfigError
from forgerl_plugins.trainers.shared.lora import ADAPTER, fresh_a

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from forgerl.adapters import LoraOptions

#: What PEFT puts before a module's Hugging Face name in ``adapter_model.safetensors``.
PEFT_PREFIX = "base_model.model."


def hf_module_name(state_dict_adapter: Any, name: str) -> str | None:
    """The Hugging Face name of the decoder layer's linear module TorchTitan names
    ``name`` (``layers.0.attention.qkv_linear.wq`` -> ``model.layers.0.self_attn.q_proj``),
    from the adapter's weight-name map; None for a name outside it."""
    match = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if match is None:
        return None
    to_hf = {tt: hf for hf, tt in state_dict_adapter.from_hf_map.items() if tt is not None}
    hf = to_hf.get(f"layers.{{}}.{match.group(2)}.weight")
    return None if hf is None else hf.format(match.group(1)).removesuffix(".weight")


def hf_module_names(model: Any, state_dict_adapter: Any) -> dict[str, str]:
    """Each linear layer of ``model``'s decoder layers (TorchTitan name) -> the Hugging
    Face name of the same module (:func:`hf_module_name`)."""
    import torch

    names = {}
    for name, module in model.named_modules():
        hf = hf_module_name(state_dict_adapter, name) if isinstance(module, torch.nn.Linear) else None
        if hf is not None:
            names[name] = hf
    return names


def target_names(model: Any, state_dict_adapter: Any, lora: LoraOptions) -> dict[str, str]:
    """The decoder linear layers ``lora`` targets (by their Hugging Face names):
    TorchTitan name -> Hugging Face name; ConfigError when none matches."""
    names = hf_module_names(model, state_dict_adapter)
    found = {tt: hf for tt, hf in names.items() if lora.targets(hf)}
    if not found:
        sample = sorted({hf.rpartition(".")[2] for hf in names.values()})
        raise ConfigError(
            f"trainer.options.lora.target_modules {lora.target_modules} match no linear layer of the model's "
            f"decoder layers; they are named {sample} (the torchtitan trainer adapts those alone)"
        )
    return found


def inject(model: Any, targets: dict[str, str], lora: LoraOptions) -> None:
    """Wrap the ``targets`` layers of ``model`` in PEFT LoRA layers, in place; only A and
    B stay trainable. Their values are set later (:func:`initial_state`): the model may
    still be on the meta device."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as exc:
        raise BackendUnavailable(f"trainer.options.lora needs PEFT ({exc}): pip install 'forgerl[lora]'") from exc
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.lora_alpha,
        lora_dropout=lora.dropout,
        # Full names: PEFT matches an entry by suffix, so these match exactly these layers.
        target_modules=sorted(targets),
        bias="none",
    )
    inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_A." in name or ".lora_B." in name)


def base_weight_names(weights: dict[str, Any], targets: dict[str, str]) -> dict[str, Any]:
    """TorchTitan state-dict entries renamed for a model whose ``targets`` PEFT wrapped:
    a wrapped layer's own weight (and bias) now sits in its ``base_layer``."""
    out = {}
    for key, value in weights.items():
        module, _, leaf = key.rpartition(".")
        out[f"{module}.base_layer.{leaf}" if module in targets else key] = value
    return out


def initial_state(model: Any, targets: dict[str, str], seed: int) -> dict[str, torch.Tensor]:
    """A fresh adapter as full CPU tensors under ``model``'s parameter names: B zero (the
    adapter starts as the base model), A as the ``fsdp`` trainer draws it for the same
    Hugging Face layer and seed (:func:`..shared.lora.fresh_a`), on every rank alike."""
    import torch

    state = {}
    for name, hf in targets.items():
        layer = model.get_submodule(name)
        a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
        state[f"{name}.lora_A.{ADAPTER}.weight"] = fresh_a(hf, tuple(a.shape), seed).to(a.dtype)
        state[f"{name}.lora_B.{ADAPTER}.weight"] = torch.zeros(tuple(b.shape), dtype=b.dtype)
    return state


def exported(
    state: dict[str, torch.Tensor], targets: dict[str, str], permute_rows: Any | None, suffix: str = ".weight"
) -> dict[str, torch.Tensor]:
    """The adapter's tensors of a (trainable-only) TorchTitan state dict under the names
    of PEFT's ``adapter_model.safetensors`` for the Hugging Face model
    (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), as the ``fsdp``
    trainer exports them. ``permute_rows(module, tensor)`` gives B's rows in Hugging
    Face's layout (None: the layouts agree). ``suffix`` ``.default.weight`` gives the
    names of PEFT's model parameters instead (as an ``fsdp`` checkpoint holds them)."""
    out = {}
    for key, tensor in state.items():
        match = re.fullmatch(rf"(.+)\.(lora_[AB])\.{ADAPTER}\.weight", key)
        if match is None or match.group(1) not in targets:
            raise ValueError(f"{key!r} is trainable but not a LoRA A or B matrix of a targeted layer")
        module, which = match.groups()
        if which == "lora_B" and permute_rows is not None:
            tensor = permute_rows(module, tensor)
        out[f"{PEFT_PREFIX}{targets[module]}.{which}{suffix}"] = tensor
    return out
