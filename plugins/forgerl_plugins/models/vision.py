"""What the built-in backends share about vision-language models: loading one, telling its
vision tower from its language model, and feeding a prompt's image features to it.

A folder is a VLM when its config has a ``vision_config`` (Idefics3/SmolVLM, Qwen2-VL,
LLaVA...); it loads with ``AutoModelForImageTextToText`` and its processor with
``AutoProcessor``. Text folders load as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forgerl.images.render import is_vision_folder

__all__ = ["freeze_vision_tower", "image_kwargs", "in_vision_tower", "is_vision_folder", "load_model", "placeholder_ids", "placeholder_ids_in", "text_config"]

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from forgerl.types import ImageInputs

# Module names of vision encoders in transformers' VLMs (Idefics3/SmolVLM: vision_model,
# Qwen2-VL: visual, LLaVA-likes: vision_tower). The connector (Idefics3's ``connector``,
# LLaVA's ``multi_modal_projector``) is not among them: it trains with the language model.
VISION_TOWER_NAMES = ("vision_model", "visual", "vision_tower")


def load_model(path: str | Path, dtype: Any) -> Any:
    """The model in ``path``: a causal LM, or a VLM with its generation head."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if is_vision_folder(path) else AutoModelForCausalLM
    return auto.from_pretrained(path, dtype=dtype)


def text_config(model: Any) -> Any:
    """The language model's config (a VLM's ``text_config``; a causal LM's own)."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def in_vision_tower(name: str) -> bool:
    """Whether a parameter or module name lies inside a vision encoder."""
    return any(part in VISION_TOWER_NAMES for part in name.split("."))


def freeze_vision_tower(model: Any) -> int:
    """Stop gradients to the vision encoder; the number of parameters frozen. The images
    are the environment's input here, and a random or pretrained encoder trained on a
    handful of RL rewards mostly drifts: off by default (docs/vision.md)."""
    frozen = 0
    for name, param in model.named_parameters():
        if in_vision_tower(name) and param.requires_grad:
            param.requires_grad_(False)
            frozen += param.numel()
    return frozen


def image_kwargs(images: ImageInputs, device: torch.device, dtype: torch.dtype, repeat: int = 1) -> dict[str, Any]:
    """The model's keyword arguments for one prompt's image ``features``, ``repeat`` times
    along the batch (the sequences sampled from one prompt), floats in ``dtype``.

    Concatenating along the first dimension is right for both layouts transformers uses:
    a batch of per-prompt image stacks (Idefics3: ``[1, images, C, H, W]``) and flat
    patches with a grid per image (Qwen2-VL).
    """
    import torch

    out: dict[str, Any] = {}
    features: Mapping[str, Any] = images.features
    for name, value in features.items():
        if not isinstance(value, torch.Tensor):
            value = torch.as_tensor(value)
        if value.is_floating_point():
            value = value.to(dtype)
        if repeat > 1:
            value = torch.cat([value] * repeat)
        out[name] = value.to(device)
    return out


def placeholder_ids(model: Any) -> frozenset[int]:
    """The token ids a VLM's processor expands images into (empty for a text model).

    A random or weak policy can *sample* one. The generator ends the sequence there (the
    token kept, with its logprob, like an eos), and the trainer feeds that last token as a
    plain token: the model would otherwise look for pixels for it (docs/vision.md).
    """
    config = model.config
    ids = set()
    for name in ("image_token_id", "image_token_index", "video_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            ids.add(value)
    return frozenset(ids)


def placeholder_ids_in(path: str | Path) -> frozenset[int]:
    """:func:`placeholder_ids` of the model in ``path``, from its config.json (no torch)."""
    import json

    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return frozenset()
    if not isinstance(config, dict) or "vision_config" not in config:
        return frozenset()
    return frozenset(
        v for k in ("image_token_id", "image_token_index", "video_token_id") if isinstance(v := config.get(k), int)
    )
