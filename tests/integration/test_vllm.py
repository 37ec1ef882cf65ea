"""The vllm generator against real vLLM servers on CPU (two replicas, a tiny model).

One pair of servers serves the whole module (start-up is the expensive part): the local
scheduler runs the plugin's server role, the test process plays the trainer (a
transformers copy of the model, the shm transport, the generator). The last test runs
``forge run`` end to end with its own servers.

The model is the built-in tiny one at hidden size 128: vLLM's CPU attention has kernels
for head sizes 32 and up, and the default tiny model's heads are 16 wide. Its embeddings
are rescaled (std 0.1) so that sampling varies (at the builder's scale every position
copies its input token).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import math
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.timing import scaled, wait_until
from tests.helpers.weight_updates import send_while_loading

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm is not installed (pip install 'forgerl[vllm]')"
    ),
]

ATOL = 1e-4  # served vs trainer logprobs, fp32 on both sides
SERVER_WAIT = 420.0  # start-up (and restart) of a vLLM server on a busy two-core machine
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from forgerl_plugins.models.tiny import TinyModel, build_tiny_model

    built = build_tiny_model(TinyModel.Options(hidden_size=128), cache_dir=tmp_path_factory.mktemp("models"))
    model = AutoModelForCausalLM.from_pretrained(built, dtype=torch.float32)
    assert model.config.tie_word_embeddings, "the tied-embedding trap needs a tied model"
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb.mul_(0.1 / emb.std())
    out = tmp_path_factory.mktemp("tiny-varied")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(built).save_pretrained(out)
    return out


@dataclass
class Cluster:
    """Servers started by the local scheduler, the generator, and the trainer's side."""

    run_dir: Path
    generator: Any
    sender: Any
    trainer: Any  # a transformers model: the weights the trainer would send
    tokenizer: Any
    weights: dict[int, dict[str, Any]] = field(default_factory=dict)
    version: int = 0

    def reference(self, version: int) -> Any:
        self.trainer.load_state_dict(self.weights[version])
        return self.trainer


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from forgerl.configuration.config import build_config
    from forgerl.interfaces import RunContext
    from forgerl.registry.plugins import build_registry
    from forgerl.registry.resolve import resolve
    from forgerl.rundirs import runs
    from forgerl.types import JobSpec
    from forgerl_plugins.generators.vllm.generator import VLLMGenerator
    from forgerl_plugins.generators.vllm.server import roles
    from forgerl_plugins.schedulers.local.scheduler import LocalScheduler
    from forgerl_plugins.transports.shm.transport import ShmTransport

    run_dir = tmp_path_factory.mktemp("vllm-run")
    registry = build_registry()
    config = resolve(
        build_config(
            flags={"model": str(model_dir), "generator": "vllm"},
            sets=[
                "generator.options.replicas=2",
                "generator.options.kv_cache_gb=0.25",
                "generator.options.health_interval=0.5",
                # Patience, not what is tested here: scaled, so a loaded machine is no "hang"
                # (at 20 s, CI at load 7-18 once lost the surviving replica while the killed
                # one restarted and took both cores).
                f"generator.options.liveness_timeout={scaled(90)}",
                f"generator.options.startup_timeout={scaled(SERVER_WAIT)}",
                f"transport.timeout={scaled(60)}",
            ],
        ),
        registry,
    )
    runs.write_config(run_dir, config)
    options = VLLMGenerator.Options.model_validate(config.generator.options)
    job = JobSpec(
        "vllm-test", str(run_dir), tuple(roles(options, context=RunContext.for_run(config, run_dir)))
    )
    scheduler = LocalScheduler(LocalScheduler.Options(stop_timeout=10))
    started = threading.Event()

    def supervise() -> None:
        # The scheduler's children die with the thread that started them: submit and
        # supervise in the same thread, for the whole module.
        handle = scheduler.submit(job)
        started.set()
        scheduler.wait(handle)

    thread = threading.Thread(target=supervise, name="vllm-test-scheduler", daemon=True)
    thread.start()
    started.wait(scaled(30))
    transport = ShmTransport(ShmTransport.Options(directory=str(run_dir / "weights")), context=None)
    ctx = RunContext.for_run(config, run_dir, model_path=model_dir)
    generator = sender = None
    try:
        generator = VLLMGenerator(options, context=ctx, transport=transport)
        sender = transport.sender()
        trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        c = Cluster(run_dir, generator, sender, trainer, AutoTokenizer.from_pretrained(model_dir))
        c.weights[0] = {k: v.clone() for k, v in trainer.state_dict().items()}
        yield c
    finally:
        if generator is not None:
            generator.close()
        if sender is not None:
            sender.close()
        scheduler.cancel(str(run_dir))
        thread.join(scaled(60))


# ---------------------------------------------------------------------------- helpers


def _prompts(tokenizer) -> list[list[int]]:
    def chat(question: str) -> list[int]:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    return [chat("What is 2 + 3?"), chat("What is 17 + 25? Think briefly, then give the final answer.")]


def _teacher_forced(model, prompt: list[int], tokens: list[int], temperature: float):
    """The trainer's side of the contract: log_softmax(logits / T) at each sampled token."""
    import torch

    t = temperature if temperature > 0 else 1.0
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / t, dim=-1).gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1)


def _gap(model, prompt: list[int], tokens: list[int], logprobs: list[float], temperature: float) -> float:
    import torch

    want = _teacher_forced(model, prompt, tokens, temperature)
    return float((torch.tensor(logprobs, dtype=torch.float32) - want).abs().max())


def _assert_text_of(tokenizer, comp) -> None:
    """A completion's text is its tokens decoded, but for the bytes of an unfinished UTF-8
    character at its end: vLLM decodes as it streams and holds those back (on this byte-level
    vocabulary half the tokens are single bytes, so a completion cut at max_tokens can end
    mid-character), where a whole decode writes U+FFFD for them."""
    decoded = tokenizer.decode(comp.token_ids, skip_special_tokens=True)
    held_back = decoded[len(comp.text) :]
    assert decoded.startswith(comp.text) and set(held_back) <= {"\ufffd"}, (comp.text, decoded)


def _generate(generator, requests):
    return asyncio.run(generator.generate(requests))


def _push(c: Cluster, version: int, scale: float = 0.02) -> None:
    """The trainer's half of a step: new weights (every tensor, the tied embedding too),
    sent through the transport while the generator loads them, as the loop does."""
    import torch

    from forgerl.types import WeightSet

    model = c.reference(c.version)
    g = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    c.weights[version] = {k: v.clone() for k, v in model.state_dict().items()}
    send_while_loading(c.generator, c.sender, WeightSet(version, model.state_dict()), join_timeout=scaled(120))
    assert c.generator.policy_version == version
    c.version = version


def _endpoint(c: Cluster, replica: int) -> dict[str, Any]:
    return json.loads((c.run_dir / "generators" / f"vllm-{replica}.json").read_text())


def _direct(c: Cluster, replica: int, prompt: list[int], temperature: float) -> dict[str, Any]:
    """A completion from one replica, bypassing the generator's balancing."""
    import httpx

    ep = _endpoint(c, replica)
    body = {
        "model": ep["model"], "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": temperature,
        "logprobs": 0, "return_token_ids": True,
    }  # fmt: skip
    resp = httpx.post(
        f"http://{ep['host']}:{ep['port']}/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {ep['api_key']}"},
        timeout=scaled(120),
    )
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def _check_each_replica(c: Cluster, version: int) -> None:
    model = c.reference(version)
    prompt = _prompts(c.tokenizer)[1]
    for replica in range(2):
        choice = _direct(c, replica, prompt, 0.7)
        gap = _gap(model, prompt, choice["token_ids"], choice["logprobs"]["token_logprobs"], 0.7)
        assert gap < ATOL, f"replica {replica} at version {version}: logprob gap {gap:.2e}"


# ------------------------------------------------------------------------------ tests


def test_completions_carry_token_ids_and_the_trainers_logprobs(cluster: Cluster):
    from forgerl.types import GenerationRequest, SamplingParams

    c = cluster
    prompts = _prompts(c.tokenizer)
    eos = c.tokenizer.convert_tokens_to_ids("<|im_end|>")
    cases = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7),  # the contract divides by T
        SamplingParams(max_tokens=MAX_TOKENS, temperature=2.0),  # vLLM's hottest: n draws differ
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
    ]
    # Seeded, as the loop's requests are: the same tokens on every run whatever the batching
    # (unseeded, what was drawn depended on which requests shared an engine step). vLLM seeds
    # the n completions of a request with seed, seed + 1, ...: 10 apart, no overlap.
    asked = [(i, j, p, s) for i, s in enumerate(cases) for j, p in enumerate([*prompts, prompts[0] + [eos]])]
    requests = [
        GenerationRequest(f"r{i}-{j}", p, 3, replace(s, seed=1000 + 10 * k))
        for k, (i, j, p, s) in enumerate(asked)
    ]
    results = _generate(c.generator, requests)
    assert [len(cs) for cs in results] == [3] * len(requests)
    model = c.reference(0)
    for request, completions in zip(requests, results):
        for comp in completions:
            assert comp.token_ids and comp.policy_version == 0
            assert comp.finish_reason in ("stop", "length"), comp.finish_reason
            if comp.finish_reason == "length":
                assert len(comp.token_ids) == MAX_TOKENS
            else:
                assert comp.token_ids[-1] == eos and eos not in comp.token_ids[:-1], comp.token_ids
            _assert_text_of(c.tokenizer, comp)
            t = request.sampling.temperature
            gap = _gap(model, list(request.prompt_token_ids), comp.token_ids, comp.logprobs, t)
            assert gap < ATOL, f"{request.request_id}: logprob gap {gap:.2e} at T={t}"
    greedy = [cs for r, cs in zip(requests, results) if r.sampling.temperature == 0]
    assert all(len({tuple(x.token_ids) for x in cs}) == 1 for cs in greedy)
    # The n completions are n independent draws (not one draw repeated, nor n draws from one
    # seed). Asked only where chance cannot make them equal: with the first completion
    # drawn, independent draws repeat it with probability p^(n-1), p = exp(sum of its
    # logprobs) (the sampling distribution itself: its logprobs equal the trainer's, above).
    # At T = 1 and 0.7 this tiny model is so peaked that three draws of 16 tokens were equal
    # half the time (p ~ 0.9), so "some request's draws differed" failed by chance; at
    # T = 2 after a chat prompt p is below 1e-8.
    unlikely = 0
    for request, completions in zip(requests, results):
        if request.sampling.temperature > 0:
            repeat = math.exp((request.n - 1) * sum(completions[0].logprobs))
            if repeat < 1e-6:
                unlikely += 1
                samples = [tuple(x.token_ids) for x in completions]
                assert len(set(samples)) > 1, (
                    f"{request.request_id}: {request.n} draws equal (chance {repeat:.1e}): {samples[0]}"
                )
    assert unlikely, "no sampled request was unlikely to repeat its first completion: nothing shown"
    served = [r["dispatched"] for r in c.generator.replica_info()]
    assert all(n > 0 for n in served), f"requests per replica: {served} (no balancing?)"


def test_seeded_sampling_repeats_whatever_the_batch_or_replica(cluster: Cluster):
    """A seeded request samples the same tokens every time: alone or batched with others,
    on either replica. Prompts of hundreds of tokens: on vLLM's CPU build a seeded request
    whose prompt was prefilled in chunks killed the engine, so the plugin turns chunked
    prefill off there."""
    import random

    from forgerl.types import GenerationRequest, SamplingParams

    c = cluster
    rng = random.Random(7)
    vocab = len(c.tokenizer)
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randrange(300, 700))] for _ in range(4)]
    # On random prompts the tiny model is nearly certain at T = 1 (p ~ 0.99); T = 2 makes
    # the n samples of a request differ, so equal results mean the seeds did it.
    hot = 2.0  # (vLLM's largest)

    def batch(tag: str, order: list[int]) -> dict[int, list[tuple[int, ...]]]:
        requests = [
            GenerationRequest(
                f"{tag}-{i}", prompts[i], 4, SamplingParams(max_tokens=12, temperature=hot, seed=50 + i)
            )
            for i in order
        ]
        return {i: [tuple(x.token_ids) for x in cs] for i, cs in zip(order, _generate(c.generator, requests))}

    first = batch("a", [0, 1, 2, 3])
    again = batch("b", [3, 2, 1, 0])  # another batch composition, balanced across both replicas
    alone = {i: batch(f"c{i}", [i])[i] for i in (0, 3)}
    assert again == first
    assert all(alone[i] == first[i] for i in alone)
    assert any(len(set(samples)) > 1 for samples in first.values()), (
        "the n samples of a request never differed"
    )
    reseeded = _generate(
        c.generator,
        [GenerationRequest("d", prompts[0], 4, SamplingParams(max_tokens=12, temperature=hot, seed=999))],
    )[0]
    assert [tuple(x.token_ids) for x in reseeded] != first[0], "another seed sampled the same tokens"


def test_served_logprobs_equal_the_trainers_after_each_of_three_updates(cluster: Cluster):
    """Each of the three ways a version gets in: read and reloaded under the pause (1);
    staged, its linear layers packed before the pause and swapped in (2, ``prepack_updates``);
    staged and reloaded under the pause, after a swap (3)."""
    from forgerl.types import GenerationRequest, SamplingParams

    c = cluster
    engine = c.generator.engine
    prompts = _prompts(c.tokenizer)
    for version, staging in ((1, None), (2, "prepack"), (3, "reload")):
        engine.stage_updates, engine.prepack_updates = staging is not None, staging == "prepack"
        try:
            _push(c, version)
        finally:
            engine.stage_updates, engine.prepack_updates = False, True
        loads = [w for ws in c.generator.updater.last_update["workers"].values() for w in ws]
        assert loads and all(w["staged"] == (staging is not None) for w in loads), loads
        # Packed ahead for real (a fallback to the reload would pass the checks below too).
        assert all(w["prepacked"] == (staging == "prepack") and not w["prepack_fallback"] for w in loads), loads
        requests = [
            GenerationRequest(
                f"v{version}-{j}-{t}", p, 4, SamplingParams(max_tokens=MAX_TOKENS, temperature=t)
            )
            for j, p in enumerate(prompts)
            for t in (1.0, 0.7)
        ]
        results = _generate(c.generator, requests)
        model = c.reference(version)
        for request, completions in zip(requests, results):
            for comp in completions:
                assert comp.policy_version == version
                t = request.sampling.temperature
                gap = _gap(model, list(request.prompt_token_ids), comp.token_ids, comp.logprobs, t)
                # A stale tied lm_head (CPU trap) shows up here as gaps of order 1.
                assert gap < ATOL, f"version {version}, {request.request_id}: logprob gap {gap:.2e}"
        _check_each_replica(c, version)
    assert c.generator.health().healthy_replicas == 2


@contextlib.contextmanager
def _requests_held_until(gen, release_after: Callable[[str, int], bool]):
    """Hold every completion request the generator sends after it has chosen a replica and
    noted that replica's weight version, until ``release_after(path, calls)`` says so for
    a step of an update: ``"update"`` as a replica's update begins, ``"before /pause"``
    and ``"/pause"`` around an admin call (``calls``: calls of that path so far, this one
    included; counted per path, since one replica may be done loading before the other's
    pause returns).
    Yields the list of held requests (grows as they arrive) and the release event. Timing is fixed by
    events: requests are in flight, not yet at the server, when the update starts."""
    held: list[str] = []
    release = asyncio.Event()
    calls: dict[str, int] = {}
    complete, admin, update = gen.engine.client.complete, gen.engine.client.admin, gen.updater.update_replica

    async def held_complete(r, body):
        if not release.is_set():
            held.append(r.url)
            await release.wait()
        return await complete(r, body)

    async def watched_admin(r, path, params=None):
        if release_after("before " + path, calls.get(path, 0) + 1):
            release.set()
        await admin(r, path, params)
        calls[path] = calls.get(path, 0) + 1
        if release_after(path, calls[path]):
            release.set()

    async def watched_update(r, version, policy=None):
        if release_after("update", 0):
            release.set()
        await (update(r, version) if policy is None else update(r, version, policy))

    gen.engine.client.complete, gen.engine.client.admin = held_complete, watched_admin
    gen.updater.update_replica = watched_update
    try:
        yield held, release
    finally:
        gen._io.loop.call_soon_threadsafe(release.set)
        del gen.engine.client.complete, gen.engine.client.admin, gen.updater.update_replica


@pytest.mark.parametrize(
    "policy, when",
    [
        # Drained first: requests sent before the update finish on the weights they started with.
        ("wait", "in flight at the update"),
        # Aborted while they may be running, and resubmitted whole.
        ("abort", "racing the pause"),
        # Sent before the update but reaching the servers only once both are paused: vLLM
        # queues them and runs them after the resume, on the new weights. Labelling them
        # with the version noted at dispatch was the bug (gaps of order 1 under load).
        ("abort", "arriving while paused"),
    ],
)
def test_requests_in_flight_during_an_update(cluster: Cluster, policy: str, when: str):
    from forgerl.types import GenerationRequest, SamplingParams

    c = cluster
    gen = c.generator
    before = c.version
    sampling = SamplingParams(max_tokens=64, temperature=1.0)
    prompts = _prompts(c.tokenizer)
    requests = [GenerationRequest(f"{policy}-{i}", prompts[i % 2], 2, sampling) for i in range(4)]
    release_after = {
        "in flight at the update": lambda path, calls: path == "update",
        "racing the pause": lambda path, calls: path == "before /pause",
        "arriving while paused": lambda path, calls: path == "/pause" and calls == 2,  # both replicas paused
    }[when]
    results: list[Any] = []
    worker = threading.Thread(target=lambda: results.append(_generate(gen, requests)))
    gen.updater.policy = policy
    try:
        with _requests_held_until(gen, release_after) as (held, released):
            worker.start()
            wait_until(lambda: len(held) == len(requests), 60, "every request to be sent to a replica")
            _push(c, before + 1)
            assert released.is_set(), f"the update never reached the point {when!r}"
        worker.join(scaled(300))
    finally:
        gen.updater.policy = "wait"
    assert results, "generation did not finish"
    versions = [comp.policy_version for cs in results[0] for comp in cs]
    # wait: drained on the old weights; abort: every request that overlapped the update is
    # resubmitted, whether the server aborted it, queued it or had just finished it.
    assert set(versions) == ({before} if policy == "wait" else {before + 1}), versions
    for request, completions in zip(requests, results[0]):
        for comp in completions:
            assert comp.finish_reason in ("stop", "length")
            model = c.reference(comp.policy_version)
            gap = _gap(model, list(request.prompt_token_ids), comp.token_ids, comp.logprobs, 1.0)
            assert gap < ATOL, f"{policy}, {when}: completion of version {comp.policy_version}: gap {gap:.2e}"


def _generation_tokens(c: Cluster, replica: int) -> float:
    """The tokens replica ``replica`` has sampled (vLLM's counter; prompts not counted)."""
    import httpx

    ep = _endpoint(c, replica)
    text = httpx.get(
        f"http://{ep['host']}:{ep['port']}/metrics",
        headers={"Authorization": f"Bearer {ep['api_key']}"},
        timeout=scaled(10),
    ).text
    counts = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("vllm:generation_tokens_total")]  # fmt: skip
    assert counts, "vLLM's /metrics has no vllm:generation_tokens_total"
    return sum(counts)


def test_keep_continues_requests_across_an_update_with_per_token_versions(cluster: Cluster):
    """Update policy keep: the servers pause with long completions half-way, load the new
    weights and go on. Each completion is sent once, comes back whole, and says per token
    which weights sampled it; the trainer's logprobs match the served ones per token
    under that token's version, so the boundary is exact (one token off would show the
    other version's gap, of order 1e-2 here)."""
    from forgerl.types import GenerationRequest, SamplingParams

    c = cluster
    gen = c.generator
    before = c.version
    prompts = _prompts(c.tokenizer)
    room = 1024 - max(len(p) for p in prompts) - 8  # the tiny model's 1024 positions
    requests = [
        GenerationRequest(f"keep-{i}", prompts[i % 2], 2, SamplingParams(max_tokens=room, temperature=1.0))
        for i in range(4)
    ]
    baseline = {i: _generation_tokens(c, i) for i in range(2)}
    dispatched = sum(info["dispatched"] for info in gen.replica_info())
    admin = gen.engine.client.admin

    async def pause_once_generating(r, path, params=None):
        if path == "/pause":  # the update waits until this replica's requests are sampling
            deadline = asyncio.get_running_loop().time() + scaled(120)
            while await asyncio.to_thread(_generation_tokens, c, r.index) < baseline[r.index] + 12:
                assert asyncio.get_running_loop().time() < deadline, f"replica {r.index} never sampled"
                await asyncio.sleep(0.05)
        return await admin(r, path, params)

    results: list[Any] = []
    worker = threading.Thread(target=lambda: results.append(_generate(gen, requests)))
    gen.updater.policy = "keep"
    gen.engine.client.admin = pause_once_generating
    try:
        worker.start()
        wait_until(
            lambda: all(info["outstanding"] > 0 for info in gen.replica_info()), 60, "requests on both replicas"
        )
        _push(c, before + 1)
        worker.join(scaled(300))
    finally:
        gen.updater.policy = "wait"
        del gen.engine.client.admin
    assert results, "generation did not finish"
    # Continued, not resubmitted: one dispatch per request.
    assert sum(info["dispatched"] for info in gen.replica_info()) - dispatched == len(requests)
    import torch

    crossed = 0
    for request, completions in zip(requests, results[0]):
        assert len(completions) == request.n
        for comp in completions:
            assert comp.finish_reason in ("stop", "length")
            assert comp.policy_version == before  # the oldest token's: staleness counts from it
            versions = comp.versions or [before] * len(comp.token_ids)
            assert len(versions) == len(comp.token_ids) == len(comp.logprobs)
            boundary = versions.index(before + 1) if before + 1 in versions else len(versions)
            assert versions == [before] * boundary + [before + 1] * (len(versions) - boundary), versions
            crossed += 0 < boundary < len(versions)
            prompt, served = list(request.prompt_token_ids), torch.tensor(comp.logprobs)
            for version, part in ((before, slice(0, boundary)), (before + 1, slice(boundary, None))):
                want = _teacher_forced(c.reference(version), prompt, comp.token_ids, 1.0)
                if len(served[part]):
                    gap = float((served[part] - want[part]).abs().max())
                    assert gap < ATOL, f"{request.request_id}: gap {gap:.2e} of version {version}'s tokens {part}"
    assert crossed, "no completion ran across the update: the pause did not find them sampling"


def test_a_killed_replica_fails_over_restarts_and_rejoins_at_the_current_weights(cluster: Cluster):
    from forgerl.types import GenerationRequest, SamplingParams

    c = cluster
    gen = c.generator
    version = c.version
    assert version > 0, "runs after the update tests: the restarted replica must be re-synced"
    old = _endpoint(c, 1)
    os.kill(old["pid"], signal.SIGKILL)
    prompts = _prompts(c.tokenizer)
    requests = [
        GenerationRequest(f"k{i}", prompts[i % 2], 2, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0))
        for i in range(8)
    ]
    results = _generate(gen, requests)  # replica 1 is dead: everything lands on replica 0
    assert all(comp.policy_version == version for cs in results for comp in cs)
    model = c.reference(version)
    for request, completions in zip(requests, results):
        for comp in completions:
            assert _gap(model, list(request.prompt_token_ids), comp.token_ids, comp.logprobs, 1.0) < ATOL

    def restarted() -> dict[str, Any] | None:
        info = gen.replica_info()[1]
        return info if info["instance"] not in (None, old["instance"]) and info["serving"] else None

    try:
        info = wait_until(restarted, SERVER_WAIT, "replica 1 to come back", interval=1)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {gen.health().detail}") from None
    assert info["version"] == version
    events = (c.run_dir / "logs" / "scheduler.log").read_text()
    assert "restarting vllm-1" in events, events[-2000:]
    # Both replicas must be back in service before each is asked directly (a replica the
    # launcher replaced meanwhile comes back re-synced to the same version).
    wait_until(
        lambda: all(r["serving"] for r in gen.replica_info()), SERVER_WAIT, "both replicas in service", interval=1
    )
    _check_each_replica(c, version)  # the restarted server holds the current weights
