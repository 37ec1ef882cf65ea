"""The Generator kit's checks of a generator's life beyond sampling: weight updates (when it
``receives_weights``) and ``close()``. Mixed into
:class:`~forgerl.testing.generator.GeneratorContract`, whose attributes and helpers they
use. Like every check, each runs on a new generator; where servers are shared by the class,
a generator built after an update finds them at that version and must serve version 0
anyway (the vllm generator reloads the model folder into them)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, ClassVar

import pytest

from forgerl.testing.generator_support import (
    GeneratorSite,
    child_processes,
    command_line,
    processes_left,
    push,
)
from forgerl.testing.timing import scaled
from forgerl.testing.transport_support import threads_left

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Sequence


class LifecycleChecks:
    """Weight updates and close (see the module's docstring)."""

    logprob_atol: ClassVar[float]
    update_timeout_s: ClassVar[float]
    cleanup_wait_s: ClassVar[float]

    if TYPE_CHECKING:  # provided by GeneratorContract

        def generate(self, generator: Any, requests: Sequence[Any]) -> list[list[Any]]: ...
        def requests(self, tag: str, specs: Sequence[tuple[list[int], int, Any]]) -> list[Any]: ...
        def prompts(self, site: GeneratorSite) -> list[list[int]]: ...
        def sampling(self, **kw: Any) -> Any: ...
        def largest_gap(
            self, model: Any, requests: Sequence[Any], results: Sequence[Sequence[Any]]
        ) -> float: ...

    def test_update_weights_serves_the_new_weights_and_version(self, generator_site: GeneratorSite) -> None:
        site = generator_site
        with site.open() as opened:
            gen = opened.generator
            if not type(gen).receives_weights:
                pytest.skip(
                    f"{type(gen).__name__} declares receives_weights = False: the loop never updates it"
                )
            prompts = self.prompts(site)
            previous: dict[str, Any] | None = None  # the model folder's weights
            for version in (1, 2):
                weights = site.new_weights(version)
                push(opened, version, weights, scaled(self.update_timeout_s))
                assert gen.policy_version == version, (
                    f"policy_version is {gen.policy_version} after update_weights({version}) returned"
                )
                specs = [
                    (p, 2, self.sampling(temperature=t, seed=80 + i))
                    for i, p in enumerate(prompts[1:3])
                    for t in (1.0, 0.7)
                ]
                requests = self.requests(f"v{version}", specs)
                results = self.generate(gen, requests)
                versions = {c.policy_version for cs in results for c in cs}
                assert versions == {version}, (
                    f"after update_weights({version}) completions report versions {versions}"
                )
                gap = self.largest_gap(site.reference(weights), requests, results)
                assert gap <= self.logprob_atol, (
                    f"after update_weights({version}) logprobs differ from the new weights' by {gap:.2e}: "
                    "the weights were not (all) loaded (a tied output layer left behind?)"
                )
                moved = self.largest_gap(site.reference(previous), requests, results)
                assert moved > 10 * self.logprob_atol, (
                    f"after update_weights({version}) the completions still fit the previous weights (gap {moved:.2e})"
                )
                previous = weights
            site.reference()

    def test_close_releases_everything(self, generator_site: GeneratorSite) -> None:
        site = generator_site
        threads_before = set(threading.enumerate())
        children_before = child_processes()
        with site.open() as opened:
            gen = opened.generator
            self.generate(gen, self.requests("close", [(self.prompts(site)[0], 2, self.sampling())]))
            if type(gen).receives_weights:  # a receiver made, so that its close is checked too
                push(opened, 1, site.new_weights(1), scaled(self.update_timeout_s))
            gen.close()
            # closed again by open() on the way out: close() must be idempotent
        stacks = threads_left(threads_before, self.cleanup_wait_s)
        assert not stacks, f"threads the generator started still run after close():\n{stacks}"
        left = processes_left(children_before, self.cleanup_wait_s)
        assert not left, "processes the generator started still run after close(): " + "; ".join(
            f"{pid}: {command_line(pid)}" for pid in sorted(left)
        )
