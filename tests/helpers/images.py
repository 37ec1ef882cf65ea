"""Images for the vision tests, made in memory: small PNGs, data URLs, and the hostile
files an attacker would hand a run (truncated, empty, a decompression bomb, not an image)."""

from __future__ import annotations

import base64
import io
import struct
import zlib


def png(width: int = 40, height: int = 24, colour: tuple[int, int, int] = (255, 0, 0)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buf, "PNG")
    return buf.getvalue()


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` × ``height`` with a few bytes of (all-zero,
    highly compressible) pixel data: what a decompression bomb looks like to a reader."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    # A handful of zero rows, compressed: a real bomb would hold all of them (~1 MB of zlib
    # per 1 GB of pixels); the header alone is what must be refused.
    pixels = zlib.compress(b"\x00" * (1 + 3 * min(width, 64)) * 4)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", pixels) + _chunk(b"IEND", b"")


def truncated_png() -> bytes:
    raw = png(64, 64, (0, 128, 255))
    return raw[: len(raw) // 2]


def chat(*parts: dict, text: str = "what colour is the square?") -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}
