"""OpenAI-style content parts: which parts a message may have, and where its images are.

A message's ``content`` is a string or a list of parts. The parts understood are
``{"type": "text", "text": ...}``, ``{"type": "image_url", "image_url": {"url": ...}}``
(OpenAI's; ``image_url`` may also be the URL string itself) and ``{"type": "image",
"image": ...}`` (Hugging Face chat templates' spelling). Anything else is refused in one
line rather than dropped: a part the model never sees is a silent change of the prompt.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from forgerl.errors import ImageError

IMAGE_TYPES = ("image_url", "image")


def _parts(message: Any) -> list[Any]:
    if not isinstance(message, Mapping):
        raise ImageError(f"a chat message must be a mapping with role and content, got {type(message).__name__}")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return []
    if not isinstance(content, list):
        raise ImageError(f"message content must be a string or a list of parts, got {type(content).__name__}")
    return content


def part_reference(part: Any) -> str | None:
    """The image reference of ``part`` (a data URL, a path or a URL), or None for a text
    part; :class:`ImageError` for a part of another kind or shape."""
    if not isinstance(part, Mapping):
        raise ImageError(f"a content part must be a mapping with a type, got {type(part).__name__}")
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise ImageError("a text part needs a string 'text'")
        return None
    if kind == "image_url":
        value = part.get("image_url")
        url = value.get("url") if isinstance(value, Mapping) else value
    elif kind == "image":
        url = part.get("image", part.get("url", part.get("path")))
    else:
        raise ImageError(f"unknown content part type {kind!r} (text, image_url or image)")
    if not isinstance(url, str) or not url:
        raise ImageError(f"an {kind} part needs a non-empty URL or path string")
    return url


def image_references(prompt: str | Iterable[Any]) -> list[str]:
    """Every image reference of a prompt (a string has none), in the order of the prompt."""
    if isinstance(prompt, str):
        return []
    refs: list[str] = []
    for message in prompt:
        for part in _parts(message):
            ref = part_reference(part)
            if ref is not None:
                refs.append(ref)
    return refs


def has_images(prompt: str | Iterable[Any]) -> bool:
    """Whether a prompt has image parts, without checking the rest (cheap: no loading)."""
    if isinstance(prompt, str):
        return False
    for message in prompt:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list) and any(
            isinstance(p, Mapping) and p.get("type") in IMAGE_TYPES for p in content
        ):
            return True
    return False


def for_template(prompt: Iterable[Any]) -> list[dict[str, Any]]:
    """The chat with each image part as ``{"type": "image"}``, the spelling Hugging Face
    chat templates expand into the model's image placeholder (the pixels go to the
    processor separately, in the same order)."""
    out: list[dict[str, Any]] = []
    for message in prompt:
        parts = _parts(message)
        if not parts:
            out.append(dict(message))
            continue
        content = []
        for part in parts:
            ref = part_reference(part)
            content.append({"type": "image"} if ref is not None else {"type": "text", "text": part["text"]})
        out.append({**message, "content": content})
    return out


def text_only(prompt: Iterable[Any]) -> list[dict[str, Any]]:
    """The chat with list contents joined into strings and images left out: for a text
    model's template, when a caller has checked there are no images to lose."""
    out = []
    for message in prompt:
        parts = _parts(message)
        if parts and any(part_reference(p) is not None for p in parts):
            raise ImageError("this chat has images; a text-only rendering would drop them")
        out.append({**message, "content": "".join(p["text"] for p in parts)} if parts else dict(message))
    return out


def without_pixels(messages: Iterable[Any]) -> list[Any]:
    """``messages`` with each data URL of an image part shortened to its type and size:
    for records and logs (a sample record must not hold megabytes of base64 per image)."""
    from forgerl.images.loading import describe

    out: list[Any] = []
    for m in messages:
        content = m.get("content") if isinstance(m, Mapping) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for p in content:
            ref = part_reference(p) if isinstance(p, Mapping) and p.get("type") != "text" else None
            parts.append({"type": "image_url", "image_url": {"url": describe(ref)}} if ref else p)
        out.append({**m, "content": parts})
    return out
