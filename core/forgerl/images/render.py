"""A chat with images → prompt token ids and :class:`~forgerl.types.ImageInputs`, by the
model's own processor, once per prompt.

The processor (a ``transformers`` ``ProcessorMixin``, duck-typed here) applies the chat
template, expands each image placeholder into the model's image tokens and prepares the
pixels. Doing it once, where the prompt is made, is what makes images token-exact: the
generator samples after these ids and the trainer scores these ids with these pixels.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from forgerl.errors import ImageError
from forgerl.images.limits import ImageLimits
from forgerl.images.loading import load_images
from forgerl.images.parts import for_template, image_references
from forgerl.types import ImageInputs


def render_chat(
    processor: Any,
    messages: Sequence[Any],
    limits: ImageLimits,
    *,
    base_dir: Path | None = None,
    allow_paths: bool = True,
    add_generation_prompt: bool = True,
) -> tuple[list[int], ImageInputs | None]:
    """Token ids of ``messages`` under the processor's chat template, with their images
    (None when there are none). :class:`ImageError` for a bad or refused image."""
    refs = image_references(messages)
    images = load_images(refs, limits, base_dir=base_dir, allow_paths=allow_paths)
    text = processor.apply_chat_template(
        for_template(messages), add_generation_prompt=add_generation_prompt, tokenize=False
    )
    return encode(processor, text, images)


def encode(processor: Any, text: str, images: Sequence[Any]) -> tuple[list[int], ImageInputs | None]:
    """``text`` (with one image placeholder per image) and ``images`` through the processor."""
    # The template writes any special tokens the model wants (as for text chats).
    if not images:
        enc = processor(text=text, return_tensors="pt", add_special_tokens=False)
        return [int(t) for t in enc["input_ids"][0]], None
    try:
        enc = processor(text=text, images=list(images), return_tensors="pt", add_special_tokens=False)
    except (ValueError, TypeError) as exc:
        # The processor counts placeholders against images: a template that drops an
        # image part, or text that spells the placeholder itself, ends here.
        raise ImageError(f"the model's processor refused this prompt's images: {' '.join(str(exc).split())}") from None
    features = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
    unexpanded = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    return [int(t) for t in enc["input_ids"][0]], ImageInputs(
        images=tuple(images), features=features, unexpanded_ids=tuple(int(t) for t in unexpanded)
    )


def is_vision_folder(path: str | Path) -> bool:
    """Whether a model folder holds a vision-language model (its config has a vision part)."""
    import json

    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "vision_config" in config


def load_processor(model_path: str | Path) -> Any | None:
    """The model's processor when it is a vision-language model; None for a text model
    (whose tokenizer is all the loop needs)."""
    if not is_vision_folder(model_path):
        return None
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(model_path)  # type: ignore[no-untyped-call]  # unannotated in transformers
