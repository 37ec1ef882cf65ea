"""A checkpoint keeps token ids, not pixels: restored samples get their images rendered
again, and one whose images cannot be had back is left out, never trained on ids without
pixels. Fakes only, well under 1 s."""

from __future__ import annotations

from types import SimpleNamespace

from forgerl.errors import ImageError
from forgerl.rollouts.rollout import RolloutBatch
from forgerl.runloop.loop import Loop
from forgerl.types import Completion, Episode, ImageInputs, Problem

URL = "data:image/png;base64,AAAA"


def _episode(pid: str, prompt, ids, messages=None) -> Episode:
    return Episode(Problem(pid, prompt), 0, ids, Completion([5], [-1.0], "stop", 0), reward=0.0, messages=messages)


class _Tokenizing:
    def render(self, problem):
        if problem.id == "gone":
            raise ImageError("image x.png: cannot read it (No such file or directory)")
        ids = [1, 4, 4, 2] if problem.id != "changed" else [1, 4, 2]
        return ids, ImageInputs(images=("pixels",), features={})


def test_restored_image_samples_get_their_images_or_are_left_out() -> None:
    image_prompt = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": URL}}]}]
    batch = RolloutBatch(index=3, episodes=[
        _episode("text", "plain", [1, 2]),
        _episode("ok", image_prompt, [1, 4, 4, 2]),
        _episode("gone", image_prompt, [1, 4, 4, 2]),
        _episode("changed", image_prompt, [1, 4, 4, 2]),
        _episode("env", "plain", [1, 2], messages=image_prompt),
    ], policy_version=1, task_state={})  # fmt: skip
    restored = Loop._with_images(SimpleNamespace(tokenizing=_Tokenizing()), batch)  # type: ignore[arg-type]
    assert [e.problem.id for e in restored.episodes] == ["text", "ok"]
    assert restored.episodes[0].images is None and restored.episodes[1].images.images == ("pixels",)
