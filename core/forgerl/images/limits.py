"""How much image a prompt may carry, and the error for one that cannot be used."""

from __future__ import annotations

from dataclasses import dataclass

from forgerl.errors import ImageError

__all__ = ["ImageError", "ImageLimits"]


@dataclass(frozen=True)
class ImageLimits:
    """Bounds checked before any pixel is decoded.

    ``max_pixels`` bounds each image (width × height, read from its header: a
    20000 × 20000 PNG of a few kilobytes is refused before it costs 1.2 GB to decode) and
    ``max_total_pixels`` all the images of one problem or conversation together.
    ``max_bytes`` bounds an image's encoded size (a data URL or a file).
    """

    max_images: int = 8
    max_pixels: int = 4096 * 4096
    max_total_pixels: int = 4 * 4096 * 4096
    max_bytes: int = 32 * 2**20

    def __post_init__(self) -> None:
        for name in ("max_images", "max_pixels", "max_total_pixels", "max_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ImageLimits.{name} must be a positive integer, got {value!r}")
