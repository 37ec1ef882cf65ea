"""An image reference → a decoded RGB image, within limits, or one line saying why not.

References are data URLs (``data:image/png;base64,...``), local paths (relative ones from
``base_dir``, the folder of the dataset that names them) and ``file://`` URLs of local
paths. Network URLs are refused: a run never fetches from the network, and a prompt that
did would not be reproducible. Everything is checked before the pixels are decoded, in
the order the checks are cheap: the reference's kind, its encoded size, the dimensions in
its header (a decompression bomb is a small file with a huge header), then the decode
itself (truncated or corrupt data).

Pillow is imported here, on the first image: core imports without it.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import stat
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from forgerl.errors import ImageError
from forgerl.images.limits import ImageLimits

if TYPE_CHECKING:  # pragma: no cover
    from PIL.Image import Image

NETWORK_SCHEMES = ("http", "https", "ftp", "ftps", "ws", "wss", "s3", "gs", "hf")


def describe(ref: str) -> str:
    """A reference as an error message names it: data URLs by their type and size."""
    if ref.startswith("data:"):
        head, _, data = ref.partition(",")
        return f"{head[:60]},... ({len(data)} chars)"
    return ref if len(ref) <= 200 else ref[:200] + "..."


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def read_reference(ref: str, limits: ImageLimits, *, base_dir: Path | None = None, allow_paths: bool = True) -> bytes:
    """The encoded bytes ``ref`` points to. ``allow_paths=False`` (a reference from outside
    the run, such as the agent endpoint's clients) accepts data URLs only."""
    if ref.startswith("data:"):
        return _data_url(ref, limits)
    scheme = urllib.parse.urlsplit(ref).scheme.lower()
    # One letter is a Windows drive ("C:\\..."), not a scheme.
    if scheme in NETWORK_SCHEMES or (len(scheme) > 1 and scheme != "file"):
        raise ImageError(
            f"image {describe(ref)}: {scheme}:// references are not fetched (no network); "
            "inline the image as a data URL or give a local file path"
        )
    if not allow_paths:
        raise ImageError(f"image {describe(ref)}: only data URLs are accepted here, not file paths")
    path = Path(urllib.parse.unquote(urllib.parse.urlsplit(ref).path) if scheme == "file" else ref)
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    return _file(path, ref, limits)


def _data_url(ref: str, limits: ImageLimits) -> bytes:
    head, comma, data = ref.partition(",")
    if not comma:
        raise ImageError(f"image {describe(ref)}: a data URL needs a comma before its data")
    # Refuse by the encoded length first: decoding a 1 GB string to find it too big is the cost avoided.
    if len(data) > limits.max_bytes * 4 // 3 + 4:
        raise ImageError(f"image {describe(ref)}: larger than the limit of {limits.max_bytes} bytes")
    if head.endswith(";base64"):
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ImageError(f"image {describe(ref)}: bad base64 ({_one_line(exc)})") from None
    else:
        raw = urllib.parse.unquote_to_bytes(data)
    if len(raw) > limits.max_bytes:
        raise ImageError(f"image {describe(ref)}: larger than the limit of {limits.max_bytes} bytes")
    return raw


def _file(path: Path, ref: str, limits: ImageLimits) -> bytes:
    try:
        info = os.stat(path)
    except OSError as exc:
        raise ImageError(f"image {describe(ref)}: cannot read it ({_one_line(exc)})") from None
    # Only regular files: /dev/zero or a FIFO would be read forever, a folder not at all.
    if not stat.S_ISREG(info.st_mode):
        raise ImageError(f"image {describe(ref)}: not a regular file")
    if info.st_size > limits.max_bytes:
        raise ImageError(f"image {describe(ref)}: {info.st_size} bytes, over the limit of {limits.max_bytes}")
    try:
        with open(path, "rb") as f:
            return f.read(limits.max_bytes + 1)
    except OSError as exc:
        raise ImageError(f"image {describe(ref)}: cannot read it ({_one_line(exc)})") from None


def decode(raw: bytes, ref: str, limits: ImageLimits) -> Image:
    """``raw`` decoded to an RGB image (the first frame of an animation)."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(raw))
    except UnidentifiedImageError:
        raise ImageError(f"image {describe(ref)}: not an image Pillow can read") from None
    except Image.DecompressionBombError as exc:
        raise ImageError(f"image {describe(ref)}: {_one_line(exc)}") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise ImageError(f"image {describe(ref)}: unreadable ({_one_line(exc)})") from None
    width, height = image.size
    if width < 1 or height < 1:
        raise ImageError(f"image {describe(ref)}: empty ({width}x{height})")
    if width * height > limits.max_pixels:
        raise ImageError(
            f"image {describe(ref)}: {width}x{height} is over the limit of {limits.max_pixels} pixels"
        )
    try:
        image.load()
        rgb = image.convert("RGB")
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as exc:
        raise ImageError(f"image {describe(ref)}: truncated or corrupt ({_one_line(exc)})") from None
    finally:
        image.close()
    return rgb


def load_image(ref: str, limits: ImageLimits, *, base_dir: Path | None = None, allow_paths: bool = True) -> Image:
    """One reference, read and decoded within ``limits``; :class:`ImageError` otherwise."""
    return decode(read_reference(ref, limits, base_dir=base_dir, allow_paths=allow_paths), ref, limits)


def load_images(
    refs: Sequence[str], limits: ImageLimits, *, base_dir: Path | None = None, allow_paths: bool = True
) -> list[Image]:
    """Every image of one problem or conversation, within the per-problem limits too."""
    if len(refs) > limits.max_images:
        raise ImageError(f"{len(refs)} images, over the limit of {limits.max_images} per problem")
    images = []
    total = 0
    for ref in refs:
        image = load_image(ref, limits, base_dir=base_dir, allow_paths=allow_paths)
        total += image.width * image.height
        if total > limits.max_total_pixels:
            raise ImageError(
                f"the images of this problem have over {limits.max_total_pixels} pixels together"
            )
        images.append(image)
    return images
