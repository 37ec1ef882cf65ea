"""An environment that shows images, as a plugin a `forge run` can load
(``FORGE_PLUGINS=tests.helpers.image_env``, the repo on ``PYTHONPATH``): ``--environment
shows-images``."""

from __future__ import annotations

from forgerl.environment import Environment, Step
from forgerl.hookspecs import hookimpl

from . import images as im


class ShowsImages(Environment):
    """Opens with an image and answers each turn with another (a truncated one when the
    problem's metadata says ``bad``); ends after the third turn with reward 1. Ignores the
    problem's prompt."""

    name = "shows-images"
    scores = True

    def __init__(self, options=None) -> None:
        self.turn = 0
        self.bad = False

    def reset(self, problem):
        self.bad = bool(problem.metadata.get("bad", False))
        return im.chat(im.image_part(im.data_url(im.png(40, 24, (255, 0, 0)))), text="look")

    def step(self, text):
        self.turn += 1
        if self.turn >= 3:
            return Step(done=True, reward=1.0)
        raw = im.truncated_png() if self.bad else im.png(20 + 9 * self.turn, 30, (0, 0, 255 - 40 * self.turn))
        part = im.image_part(im.data_url(raw))
        return Step(messages=[{"role": "user", "content": [part, {"type": "text", "text": "and now?"}]}])


@hookimpl
def forge_environments():
    return [ShowsImages]
