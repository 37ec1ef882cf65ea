"""A plugin of deliberately broken generators, each the ``hf`` generator breaking one rule the
Generator kit of :mod:`forgerl.testing` checks: the kit's tests show that each check can fail.

Loaded by import path (``plugins = ("tests.helpers.kit_fake_generators",)``); the classes
are built on first use (importing this module imports neither torch nor transformers).
"""

from __future__ import annotations

import subprocess
import sys
import threading
from dataclasses import replace
from typing import Any

from forgerl.backends import GeneratorBackend
from forgerl.hookspecs import hookimpl

#: Set at teardown: the thread the leaking generator starts ends with it.
LEAK_STOP = threading.Event()
#: The processes the process-leaking generator starts (killed at teardown).
CHILDREN: list[subprocess.Popen] = []


def _make(kind: str) -> type:
    from forgerl_plugins.generators.hf.generator import HFGenerator

    class Broken(HFGenerator):
        async def generate(self, requests):
            requests = list(requests)
            if kind == "raw_logprobs":  # samples, and reports logprobs, at T = 1 whatever T is asked
                requests = [
                    replace(r, sampling=replace(r.sampling, temperature=1.0))
                    if r.sampling.temperature > 0
                    else r
                    for r in requests
                ]
            if kind == "shifted":  # request i is sampled after the prompt of request i + 1
                prompts = [r.prompt_token_ids for r in requests]
                requests = [
                    replace(r, prompt_token_ids=prompts[(i + 1) % len(prompts)])
                    for i, r in enumerate(requests)
                ]
            if kind == "too_long":  # three tokens beyond max_tokens
                requests = [
                    replace(r, sampling=replace(r.sampling, max_tokens=r.sampling.max_tokens + 3))
                    for r in requests
                ]
            if kind == "unseeded":
                requests = [replace(r, sampling=replace(r.sampling, seed=None)) for r in requests]
            results = await super().generate(requests)
            if kind == "one_draw":  # the first completion n times
                results = [[cs[0]] * len(cs) for cs in results]
            if kind == "positive_logprobs":
                for cs in results:
                    for c in cs:
                        c.logprobs = [x + 0.5 for x in c.logprobs]
            if kind == "no_text":
                for cs in results:
                    for c in cs:
                        c.text = ""
            return results

        def update_weights(self, version: int) -> None:
            if kind == "stuck_version":  # loads the weights, keeps reporting the old version
                before = self._version
                super().update_weights(version)
                self._version = before
            elif kind == "ignores_weights":  # takes the version number, not the weights
                dict(self._get_receiver().receive(version, timeout=self.ctx.transport_timeout))
                self._version = int(version)
            else:
                super().update_weights(version)

    if kind == "leaks_thread":

        class Leaking(Broken):
            def __init__(self, *args: Any, **kw: Any) -> None:
                super().__init__(*args, **kw)
                threading.Thread(target=LEAK_STOP.wait, name="kit-fake-leak", daemon=True).start()

        return Leaking
    if kind == "leaks_process":

        class LeavesAChild(Broken):
            def __init__(self, *args: Any, **kw: Any) -> None:
                super().__init__(*args, **kw)
                code = "import sys; sys.stdin.read()  # kit-fake-child"
                CHILDREN.append(subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE))

        return LeavesAChild
    return Broken


KINDS = (
    "raw_logprobs",
    "shifted",
    "too_long",
    "unseeded",
    "one_draw",
    "positive_logprobs",
    "no_text",
    "stuck_version",
    "ignores_weights",
    "leaks_thread",
    "leaks_process",
)


def _factory(kind: str):
    def build(options, *, context, transport):
        return _make(kind)(options, context=context, transport=transport)

    return build


@hookimpl
def forge_generators():
    return [
        GeneratorBackend(
            name=f"kit_gen_{kind}",
            factory=_factory(kind),
            options="forgerl_plugins.generators.hf.generator:HFGenerator.Options",
        )
        for kind in KINDS
    ]
