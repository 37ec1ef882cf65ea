"""Images in prompts and messages (vision-language models).

A chat message's ``content`` may be a list of OpenAI-style parts instead of a string::

    [{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}},
     {"type": "text", "text": "What colour is the square?"}]

:mod:`.parts` finds and checks those parts; :mod:`.loading` turns an image reference (a
data URL or a local file path; never the network) into a decoded RGB image within the
run's :class:`ImageLimits`, or one line saying why not. Pillow is imported only there,
only when an image is loaded: core imports without it.
"""

from __future__ import annotations

from forgerl.images.limits import ImageError, ImageLimits
from forgerl.images.parts import has_images, image_references, text_only

__all__ = ["ImageError", "ImageLimits", "has_images", "image_references", "text_only"]
