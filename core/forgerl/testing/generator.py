"""The Generator kit: what the loop relies on from a generator, checked against one backend
by name, on a real model.

Each check is a test of :class:`GeneratorContract`, run on a new generator built as a run
builds it: through the registry, as its class, ``Class(options, *, context=RunContext,
transport=...)`` (:mod:`forgerl.contract`), with the shm transport. A generator whose model
runs in servers of its own (a class with a static ``roles``) gets its roles started once
per test class by the local scheduler, in the run directory its ``context`` names, as
``forge run`` starts them. What it checks:

- the backend builds into a :class:`~forgerl.interfaces.Generator` whose
  ``receives_weights`` is a bool, and ``policy_version`` starts at 0 (the weights the run
  started from), which every completion reports;
- ``generate`` returns ``requests[i].n`` completions for each request, in request order
  (each completion's logprobs fit its own request's prompt, not another's);
- every completion has as many logprobs as token ids, token ids of the vocabulary,
  logprobs finite and <= 0;
- logprobs are ``log_softmax(logits / T)`` of the sampled token (plain ``log_softmax``
  when greedy), against a teacher-forced forward pass of the model in transformers (fp32,
  within ``logprob_atol``), at T = 1, 0.7 and 0;
- finish reasons are ``stop`` (an eos token, kept, and none before it) or ``length``
  (exactly ``max_tokens`` tokens); on the kit's own model some completions do stop;
- ``max_tokens`` is respected (1 and 5); ``text`` is the decoded completion;
- the ``n`` completions of a request are independent draws (asked only where chance
  could not make them equal);
- seeded sampling repeats the same tokens whatever the batch and its order, and another
  seed draws others (when the backend claims it: ``reproducible``);
- when the generator ``receives_weights``: after ``update_weights(v)`` (weights sent
  through a real transport while it receives, as the loop does) ``policy_version`` is
  ``v``, every completion reports ``v``, and the logprobs are those of the new weights,
  no longer those of the old, for two versions in a row;
- ``close()`` (twice) releases everything: no threads and no child processes it started
  are left (servers started by the roles are the scheduler's, not the generator's).

Deadlines are scaled (:mod:`forgerl.testing.timing`) and every test runs under a hard time
limit (:attr:`GeneratorContract.hard_limits`), so a generator that hangs fails its test.

The model is, by default, the built-in ``tiny`` model (``tiny_model_options``), built
offline, with its embeddings rescaled so that sampling varies; ``model`` names a local
Hugging Face folder instead. A subclass::

    class TestMyGenerator(GeneratorContract):
        backend = "my_generator"
        options = {"batch_size": 8}

Options only known once a fixture ran (a server's address): override the class-scoped
``generator_options`` fixture; the model the kit serves is the ``generator_model`` fixture.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest

from forgerl.testing.generator_lifecycle import LifecycleChecks
from forgerl.testing.generator_support import (
    GeneratorSite,
    generate,
    logprob_gap,
    open_site,
    tiny_model,
)
from forgerl.testing.registry import backend_under_test
from forgerl.testing.timing import hard_limit, scaled

__all__ = ["GeneratorContract", "GeneratorSite"]


class GeneratorContract(LifecycleChecks):
    """Base class of a plugin's generator conformance tests (see the module's docstring)."""

    #: The generator's backend name, as ``generator.name`` in a config.
    backend: ClassVar[str] = ""
    #: Its options, as ``generator.options`` holds them (plain data).
    options: ClassVar[Mapping[str, Any]] = {}
    #: Plugin modules to load besides the installed ones (import paths).
    plugins: ClassVar[Sequence[str]] = ()
    #: A local Hugging Face folder to serve; None: the kit's tiny model.
    model: ClassVar[str | None] = None
    #: Options of the ``tiny`` model backend when ``model`` is None (e.g. a hidden size
    #: whose attention heads an engine's kernels support).
    tiny_model_options: ClassVar[Mapping[str, Any]] = {}
    #: More of the run's config, as ``--set`` lines (``transport.timeout`` is the kit's).
    settings: ClassVar[Sequence[str]] = ()
    #: Whether seeded sampling repeats the same tokens (``sampling.seed``; exact resume
    #: relies on it). False skips that check: say so in your docs.
    reproducible: ClassVar[bool] = True
    #: Largest |generator logprob - reference logprob| allowed (fp32 on both sides).
    logprob_atol: ClassVar[float] = 1e-4
    #: ``max_tokens`` of the kit's requests.
    max_tokens: ClassVar[int] = 12
    #: Seconds (scaled) one ``generate`` call may take; one weight version to arrive.
    generate_timeout_s: ClassVar[float] = 120.0
    update_timeout_s: ClassVar[float] = 60.0
    #: Seconds (scaled) the threads and processes a generator started get to end after close.
    cleanup_wait_s: ClassVar[float] = 15.0
    #: Seconds (scaled) each test may run before it fails instead of hanging the suite, by
    #: test name, else ``default_hard_limit`` (the class's model and servers, built and
    #: started before its first test, do not count).
    hard_limits: ClassVar[Mapping[str, float]] = {}
    default_hard_limit: ClassVar[float] = 300

    # ---------------------------------------------------------------- fixtures

    @pytest.fixture(scope="class")
    @classmethod
    def generator_model(cls, tmp_path_factory: pytest.TempPathFactory) -> Path:
        """The model folder the generator serves (and the kit's reference loads)."""
        if cls.model is not None:
            return Path(cls.model)
        return tiny_model(tmp_path_factory.mktemp("kit-model"), cls.tiny_model_options, cls.plugins)

    @pytest.fixture(scope="class")
    @classmethod
    def generator_options(cls) -> dict[str, Any]:
        """The generator's options; override (class scope) to add what a fixture knows."""
        return dict(cls.options)

    @pytest.fixture(scope="class")
    @classmethod
    def generator_site(
        cls,
        generator_model: Path,
        generator_options: dict[str, Any],
        tmp_path_factory: pytest.TempPathFactory,
    ) -> Iterator[GeneratorSite]:
        """The run the generators of this class belong to (servers started once)."""
        backend_under_test("generator", cls.backend, cls.plugins)  # skips when unavailable
        with open_site(
            cls.backend,
            generator_options,
            cls.plugins,
            generator_model,
            tmp_path_factory.mktemp("kit-run"),
            cls.settings,
            cls.update_timeout_s,
        ) as site:
            yield site

    @pytest.fixture(autouse=True)
    def _hard_timeout(self, request: pytest.FixtureRequest) -> Iterator[None]:
        name = getattr(request.function, "__name__", "")
        limit = max(1, int(scaled(self.hard_limits.get(name, self.default_hard_limit))))
        with hard_limit(limit, f"{request.node.nodeid} ran past its hard timeout of {limit} s"):
            yield

    # ----------------------------------------------------------------- helpers

    def generate(self, generator: Any, requests: Sequence[Any]) -> list[list[Any]]:
        return generate(generator, requests, scaled(self.generate_timeout_s))

    def requests(self, tag: str, specs: Sequence[tuple[list[int], int, Any]]) -> list[Any]:
        """Requests ``tag-0, tag-1, ...`` from (prompt, n, sampling) triples."""
        from forgerl.types import GenerationRequest

        return [GenerationRequest(f"{tag}-{i}", prompt, n, s) for i, (prompt, n, s) in enumerate(specs)]

    def prompts(self, site: GeneratorSite) -> list[list[int]]:
        """Distinct prompts: two chats and two of random tokens (varied sampling)."""
        return [
            site.chat_prompt("What is 2 + 3?"),
            site.chat_prompt("What is 17 + 25? Think briefly, then give the final answer."),
            site.random_prompt(1, 24),
            site.random_prompt(2, 40),
        ]

    def largest_gap(self, model: Any, requests: Sequence[Any], results: Sequence[Sequence[Any]]) -> float:
        """The largest |logprob - reference| over every token of ``results``."""
        return max(
            logprob_gap(model, r.prompt_token_ids, c, r.sampling.temperature)
            for r, cs in zip(requests, results)
            for c in cs
        )

    def sampling(self, **kw: Any) -> Any:
        from forgerl.types import SamplingParams

        return SamplingParams(**{"max_tokens": self.max_tokens, **kw})

    # ------------------------------------------------------------------- tests

    def test_builds_a_generator_through_the_registry(self, generator_site: GeneratorSite) -> None:
        from forgerl.interfaces import Generator

        with generator_site.open() as opened:
            gen = opened.generator
            assert isinstance(gen, Generator), (
                f"generator {self.backend!r} built a {type(gen).__name__}, not a forgerl.interfaces.Generator"
            )
            flag = getattr(type(gen), "receives_weights", None)
            assert isinstance(flag, bool), (
                f"{type(gen).__name__}.receives_weights must be a bool, got {flag!r}"
            )

    def test_policy_version_starts_at_the_initial_version(self, generator_site: GeneratorSite) -> None:
        site = generator_site
        with site.open() as opened:
            gen = opened.generator
            assert gen.policy_version == 0, f"a new generator serves version {gen.policy_version}, not 0"
            results = self.generate(gen, self.requests("v0", [(self.prompts(site)[0], 2, self.sampling())]))
            versions = {c.policy_version for cs in results for c in cs}
            assert versions == {0}, f"completions of a new generator report versions {versions}, not 0"

    def test_generate_returns_n_completions_per_request_in_order(self, generator_site: GeneratorSite) -> None:
        from forgerl.types import Completion

        site = generator_site
        prompts = self.prompts(site)
        ns = [1, 3, 2, 4]
        requests = self.requests(
            "order", [(p, n, self.sampling(seed=10 + i)) for i, (p, n) in enumerate(zip(prompts, ns))]
        )
        with site.open() as opened:
            results = self.generate(opened.generator, requests)
        assert isinstance(results, list) and len(results) == len(requests), (
            f"generate() of {len(requests)} requests returned {type(results).__name__} of "
            f"{len(results) if isinstance(results, list) else '?'} entries"
        )
        got = [len(cs) for cs in results]
        assert got == ns, f"asked for n = {ns} completions per request, got {got}"
        bad = [type(c).__name__ for cs in results for c in cs if not isinstance(c, Completion)]
        assert not bad, f"generate() returned {bad[:3]}, not forgerl.types.Completion"
        model = site.reference()
        misplaced = []
        for i, (request, completions) in enumerate(zip(requests, results)):
            for c in completions:
                own = logprob_gap(model, request.prompt_token_ids, c, 1.0)
                if own <= self.logprob_atol:
                    continue
                fits = [
                    j for j, other in enumerate(requests)
                    if j != i and logprob_gap(model, other.prompt_token_ids, c, 1.0) <= self.logprob_atol
                ]  # fmt: skip
                if fits:
                    misplaced.append(
                        f"a completion of request {i} was sampled after the prompt of request {fits[0]}"
                    )
        assert not misplaced, "completions are not in request order: " + "; ".join(misplaced)

    def test_token_ids_and_logprobs_are_aligned_and_finite(self, generator_site: GeneratorSite) -> None:
        site = generator_site
        vocab = len(site.tokenizer)
        specs = [
            (p, 2, self.sampling(temperature=t, seed=20 + i))
            for i, p in enumerate(self.prompts(site))
            for t in (1.0, 0.0)
        ]
        with site.open() as opened:
            results = self.generate(opened.generator, self.requests("aligned", specs))
        problems = []
        for i, completions in enumerate(results):
            for c in completions:
                if len(c.token_ids) != len(c.logprobs):
                    problems.append(
                        f"request {i}: {len(c.token_ids)} token ids but {len(c.logprobs)} logprobs"
                    )
                if not c.token_ids:
                    problems.append(f"request {i}: an empty completion (max_tokens {self.max_tokens})")
                odd = [
                    t
                    for t in c.token_ids
                    if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab
                ]
                if odd:
                    problems.append(f"request {i}: token ids outside the vocabulary of {vocab}: {odd[:5]}")
                wrong = [
                    x for x in c.logprobs if not isinstance(x, float) or not math.isfinite(x) or x > 1e-6
                ]
                if wrong:
                    problems.append(f"request {i}: logprobs that are not finite floats <= 0: {wrong[:5]}")
        assert not problems, "completions the loss cannot use:\n  " + "\n  ".join(problems[:20])

    def test_logprobs_are_the_log_softmax_of_logits_over_temperature(
        self, generator_site: GeneratorSite
    ) -> None:
        site = generator_site
        prompts = self.prompts(site)
        specs = [
            (p, 2, self.sampling(temperature=t, seed=30 + i))
            for i, p in enumerate(prompts[::3])
            for t in (1.0, 0.7, 0.0)
        ]
        requests = self.requests("logprobs", specs)
        with site.open() as opened:
            results = self.generate(opened.generator, requests)
        model = site.reference()
        gaps = []
        for request, completions in zip(requests, results):
            t = request.sampling.temperature
            for c in completions:
                gap = logprob_gap(model, request.prompt_token_ids, c, t)
                if not gap <= self.logprob_atol:
                    raw = logprob_gap(model, request.prompt_token_ids, c, 1.0)
                    hint = (
                        " (they are the logprobs of the logits at T = 1: divide by T)"
                        if raw <= self.logprob_atol
                        else ""
                    )
                    gaps.append(f"T={t}: gap {gap:.2e}{hint}")
        assert not gaps, (
            f"logprobs differ from log_softmax(logits / T) of the sampled tokens by more than "
            f"{self.logprob_atol:g} (the loss would train a wrong objective):\n  " + "\n  ".join(gaps[:10])
        )

    def test_finish_reasons_are_valid(self, generator_site: GeneratorSite) -> None:
        from forgerl.types import FinishReason

        site = generator_site
        eos = site.eos_ids()
        # This random model tends to repeat its last input token: after an eos, eos is likely.
        prompt = self.prompts(site)[0] + sorted(eos)[:1]
        requests = self.requests("finish", [(prompt, 32, self.sampling(temperature=1.0, seed=7))])
        with site.open() as opened:
            completions = self.generate(opened.generator, requests)[0]
        valid = set(typing.get_args(FinishReason))
        problems = []
        for c in completions:
            if c.finish_reason not in valid:
                problems.append(f"finish reason {c.finish_reason!r} is none of {sorted(valid)}")
            elif c.finish_reason == "length" and len(c.token_ids) != self.max_tokens:
                problems.append(f"'length' after {len(c.token_ids)} tokens, max_tokens {self.max_tokens}")
            elif c.finish_reason == "stop" and (not c.token_ids or c.token_ids[-1] not in eos):
                problems.append(f"'stop' without an eos token {sorted(eos)} at the end: {c.token_ids[-3:]}")
            if any(t in eos for t in c.token_ids[:-1]):
                problems.append(f"generation went on past an eos token: {c.token_ids}")
        assert not problems, "finish reasons the loop would misread:\n  " + "\n  ".join(problems[:10])
        if self.model is None:
            reasons = {c.finish_reason for c in completions}
            assert "stop" in reasons, (
                f"no completion of 32 stopped at eos (finish reasons {reasons}): eos is ignored?"
            )

    def test_max_tokens_is_respected(self, generator_site: GeneratorSite) -> None:
        site = generator_site
        specs = [
            (p, 2, self.sampling(max_tokens=m, temperature=1.0, seed=40 + m))
            for m in (1, 5)
            for p in self.prompts(site)[2:]
        ]
        requests = self.requests("max", specs)
        with site.open() as opened:
            results = self.generate(opened.generator, requests)
        over = [
            f"max_tokens {r.sampling.max_tokens}: {len(c.token_ids)} tokens"
            for r, cs in zip(requests, results)
            for c in cs
            if not 1 <= len(c.token_ids) <= r.sampling.max_tokens
        ]
        assert not over, "completions longer than max_tokens (or empty): " + "; ".join(over[:10])

    def test_text_is_the_decoded_completion(self, generator_site: GeneratorSite) -> None:
        site = generator_site
        specs = [
            (p, 2, self.sampling(temperature=1.0, seed=50 + i)) for i, p in enumerate(self.prompts(site))
        ]
        with site.open() as opened:
            results = self.generate(opened.generator, self.requests("text", specs))
        wrong = []
        for cs in results:
            for c in cs:
                decoded = site.tokenizer.decode(c.token_ids, skip_special_tokens=True)
                # A streaming decoder holds back the bytes of an unfinished UTF-8 character
                # at the end, where a whole decode writes U+FFFD for them.
                held_back = decoded[len(c.text) :]
                if not (
                    isinstance(c.text, str) and decoded.startswith(c.text) and set(held_back) <= {"\ufffd"}
                ):
                    wrong.append(f"text {c.text!r}, decoded tokens {decoded!r}")
        assert not wrong, "rewards score the text: it must be the decoded tokens:\n  " + "\n  ".join(
            wrong[:5]
        )

    def test_the_n_completions_are_independent_draws(self, generator_site: GeneratorSite) -> None:
        site = generator_site
        specs = [
            (p, 4, self.sampling(temperature=1.5, seed=60 + i)) for i, p in enumerate(self.prompts(site))
        ]
        requests = self.requests("draws", specs)
        with site.open() as opened:
            results = self.generate(opened.generator, requests)
        shown = 0
        for request, cs in zip(requests, results):
            # Independent draws repeat the first one with probability p^(n-1), p its chance.
            repeat = math.exp((request.n - 1) * sum(cs[0].logprobs))
            if repeat < 1e-6:
                shown += 1
                samples = {tuple(c.token_ids) for c in cs}
                assert len(samples) > 1, (
                    f"{request.request_id}: the {request.n} completions are equal (chance {repeat:.1e}): "
                    "a GRPO group needs n independent draws"
                )
        if not shown:
            pytest.skip(
                "every request was likely to repeat its first completion: nothing shown on this model"
            )

    def test_seeded_sampling_is_reproducible(self, generator_site: GeneratorSite) -> None:
        if not self.reproducible:
            pytest.skip(f"{type(self).__name__}.reproducible is False")
        site = generator_site
        prompts = self.prompts(site)

        def draw(gen: Any, tag: str, order: list[int], seed: int = 70) -> dict[int, list[Any]]:
            specs = [(prompts[i], 3, self.sampling(temperature=1.5, seed=seed + i)) for i in order]
            return dict(zip(order, self.generate(gen, self.requests(tag, specs))))

        def tokens(drawn: dict[int, list[Any]]) -> dict[int, list[tuple[int, ...]]]:
            return {i: [tuple(c.token_ids) for c in cs] for i, cs in drawn.items()}

        with site.open() as opened:
            gen = opened.generator
            first = draw(gen, "a", [0, 1, 2, 3])
            again = draw(gen, "b", [3, 2, 1, 0])
            alone = draw(gen, "c", [2])
            other = draw(gen, "d", [2], seed=999)
        assert tokens(again) == tokens(first), (
            "the same seeded requests, batched in another order, sampled other tokens"
        )
        assert tokens(alone)[2] == tokens(first)[2], (
            "a seeded request sampled other tokens alone than in a batch"
        )
        # Independent draws of another seed repeat all three with the chance of each.
        chance = math.prod(math.exp(sum(c.logprobs)) for c in first[2])
        if chance < 1e-6:
            assert tokens(other)[2] != tokens(first)[2], (
                f"another seed sampled the same tokens (chance {chance:.1e})"
            )
