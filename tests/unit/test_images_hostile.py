"""Image references as an attacker would write them: each is refused in one line, before
any large allocation, and nothing is fetched from the network. About 1 s (Pillow only)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("PIL")

from forgerl.errors import ImageError, UserError
from forgerl.images import ImageLimits, has_images, image_references
from forgerl.images.loading import load_image, load_images
from forgerl.images.parts import for_template, text_only
from tests.helpers import images as im

LIMITS = ImageLimits(max_images=2, max_pixels=256 * 256, max_total_pixels=300 * 256, max_bytes=64 * 1024)


def _refused(ref: str, match: str, **kw) -> str:
    with pytest.raises(ImageError, match=match) as info:
        load_image(ref, LIMITS, **kw)
    message = str(info.value)
    assert "\n" not in message, f"not one line: {message!r}"
    assert len(message) < 400, f"an error must not echo a whole data URL: {len(message)} chars"
    return message


def test_a_good_png_as_data_url_and_as_path(tmp_path: Path) -> None:
    raw = im.png(40, 24)
    image = load_image(im.data_url(raw), LIMITS)
    assert (image.mode, image.size) == ("RGB", (40, 24))
    (tmp_path / "a.png").write_bytes(raw)
    assert load_image("a.png", LIMITS, base_dir=tmp_path).size == (40, 24)
    assert load_image(f"file://{tmp_path / 'a.png'}", LIMITS).size == (40, 24)


def test_truncated_file_is_refused(tmp_path: Path) -> None:
    _refused(im.data_url(im.truncated_png()), "truncated|unreadable")
    (tmp_path / "t.png").write_bytes(im.truncated_png())
    _refused(str(tmp_path / "t.png"), "truncated|unreadable")


def test_zero_by_zero_is_refused() -> None:
    _refused(im.data_url(im.png_header_only(0, 0)), "empty|unreadable|not an image")


def test_decompression_bomb_is_refused_from_its_header() -> None:
    raw = im.png_header_only(20000, 20000)
    assert len(raw) < 1000, "the bomb must be small for the test to mean something"
    _refused(im.data_url(raw), "over the limit|decompression bomb")
    # Just over our limit, far under Pillow's own guard: our limit is the one that holds.
    _refused(im.data_url(im.png_header_only(257, 256)), "over the limit of 65536 pixels")


def test_not_an_image_is_refused(tmp_path: Path) -> None:
    _refused(im.data_url(b"#!/bin/sh\nrm -rf /\n", "image/png"), "not an image")
    _refused("data:image/png;base64,@@@not base64@@@", "bad base64")
    (tmp_path / "x.png").write_text("hello")
    _refused(str(tmp_path / "x.png"), "not an image")


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:9/a.png", "https://example.com/cat.png", "ftp://host/a.png", "s3://bucket/a.png"]
)
def test_network_urls_are_refused_without_a_connection(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    def no_network(*a, **k):
        raise AssertionError("an image reference opened a socket")

    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    _refused(url, "not fetched")


def test_special_files_and_folders_are_refused(tmp_path: Path) -> None:
    if os.path.exists("/dev/zero"):
        _refused("/dev/zero", "not a regular file")
    _refused(str(tmp_path), "not a regular file")
    _refused(str(tmp_path / "missing.png"), "cannot read")


def test_paths_are_refused_where_only_data_urls_are_allowed(tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(im.png())
    _refused(str(tmp_path / "a.png"), "only data URLs", allow_paths=False)
    assert load_image(im.data_url(im.png()), LIMITS, allow_paths=False).size == (40, 24)


def test_oversized_encodings_are_refused_before_decoding(tmp_path: Path) -> None:
    big = im.data_url(b"\0" * (LIMITS.max_bytes + 10))
    _refused(big, "larger than the limit")
    (tmp_path / "big.png").write_bytes(b"\0" * (LIMITS.max_bytes + 1))
    _refused(str(tmp_path / "big.png"), "over the limit")


def test_count_and_total_pixels_per_problem() -> None:
    small = im.data_url(im.png(200, 200))
    with pytest.raises(ImageError, match="3 images, over the limit of 2"):
        load_images([small] * 3, LIMITS)
    with pytest.raises(ImageError, match="pixels together"):
        load_images([small, small], LIMITS)
    assert len(load_images([small], LIMITS)) == 1


def test_content_parts_are_checked_and_never_dropped() -> None:
    url = im.data_url(im.png())
    prompt = im.chat(im.image_part(url), {"type": "image", "image": "a.png"})
    assert has_images(prompt) and image_references(prompt) == [url, "a.png"]
    assert for_template(prompt)[0]["content"][:2] == [{"type": "image"}, {"type": "image"}]
    assert not has_images("plain") and image_references("plain") == []
    with pytest.raises(ImageError, match="would drop them"):
        text_only(prompt)
    assert text_only(im.chat())[0]["content"] == "what colour is the square?"
    with pytest.raises(ImageError, match="unknown content part type 'input_audio'"):
        image_references([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}])
    with pytest.raises(ImageError, match="non-empty URL"):
        image_references([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_image_errors_are_one_line_user_errors() -> None:
    assert issubclass(ImageError, UserError), "the CLI prints a UserError as one line, exit status 2"
    with pytest.raises(ValueError, match="max_pixels"):
        ImageLimits(max_pixels=0)


def test_records_keep_no_pixels() -> None:
    from forgerl.images.parts import without_pixels

    url = im.data_url(im.png(300, 300))
    [message] = without_pixels(im.chat(im.image_part(url), {"type": "image", "image": "a.png"}))
    shortened = message["content"][0]["image_url"]["url"]
    assert shortened.startswith("data:image/png;base64,...") and len(shortened) < 80, shortened
    assert message["content"][1]["image_url"]["url"] == "a.png"
    assert message["content"][2] == {"type": "text", "text": "what colour is the square?"}


def test_the_run_config_sets_the_limits() -> None:
    from pydantic import ValidationError

    from forgerl.configuration.config import RunConfig

    config = RunConfig.model_validate({"images": {"max_images": 1, "max_pixels": 100}})
    limits = config.images.limits()
    assert (limits.max_images, limits.max_pixels) == (1, 100)
    with pytest.raises(ImageError, match="2 images, over the limit of 1"):
        load_images([im.data_url(im.png(5, 5))] * 2, limits)
    with pytest.raises(ValidationError):
        RunConfig.model_validate({"images": {"max_images": 0}})
