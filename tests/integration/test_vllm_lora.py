"""LoRA end to end on a real vLLM CPU server: the ``fsdp`` trainer trains an adapter, its
export (the adapter's tensors alone) crosses the shm or the nccl transport (gloo on CPU),
the server's workers load it in place under one name, and the generator samples with it.

One server of its own (the session's shared one runs without ``--enable-lora``, which is
fixed when vLLM starts), started as a run starts it, with the run's config saying
``trainer.options.lora``: the server role derives its LoRA flags from that. Both
transports use that one server: its workers build a receiver for whichever transport a
load names, so the second transport costs no second start.
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.timing import scaled
from tests.helpers.weight_updates import send_while_loading

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed"),
]

ATOL = 1e-4  # served vs trainer logprobs, fp32 on both sides
RANK = 8
MAX_TOKENS = 12
SERVER_WAIT = 420.0
OPTIONS = {
    "replicas": 1,
    "kv_cache_gb": 0.25,
    "health_interval": 0.5,
    "liveness_timeout": scaled(60),
    "startup_timeout": scaled(SERVER_WAIT),
}
SETTINGS = [f"trainer.options.lora.rank={RANK}", "trainer.options.lora.alpha=16"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from forgerl.testing.generator_support import tiny_model

    # Heads 32 wide: vLLM's CPU attention has no kernels for narrower ones.
    return tiny_model(tmp_path_factory.mktemp("lora-model"), {"hidden_size": 128})


@pytest.fixture(scope="module")
def site(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from forgerl.testing.generator_support import open_site

    with open_site("vllm", OPTIONS, (), model_dir, tmp_path_factory.mktemp("lora-run"), SETTINGS) as s:
        yield s


def _push(opened: Any, tensors: dict[str, Any], version: int) -> None:
    """The trainer's half of an update: ``tensors`` sent while the generator loads them."""
    from forgerl.types import WeightSet

    send_while_loading(opened.generator, opened.sender, WeightSet(version, tensors), join_timeout=scaled(180))


def _gap(model: Any, prompt: list[int], completion: Any, temperature: float) -> float:
    """The largest difference between the served logprobs and ``model``'s (teacher-forced)."""
    import torch

    tokens = list(completion.token_ids)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    want = torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1)
    return float((torch.tensor(completion.logprobs) - want).abs().max())


@pytest.mark.parametrize("transport", ["shm", "nccl"])
def test_the_generator_samples_with_each_adapter_version(
    site: Any, model_dir: Path, tmp_path: Path, transport: str
) -> None:
    import torch

    from forgerl.types import GenerationRequest, SamplingParams
    from forgerl_plugins.trainers.shared.lora import adapter_off
    from tests.helpers import trainer_worker as worker

    assert site.context().adapter is not None and site.context().adapter.rank == RANK
    trainer = worker.make_trainer(model_dir, tmp_path, 2, lora={"rank": RANK, "alpha": 16})
    prompts = [site.chat_prompt("What is 2 + 3?"), site.random_prompt(seed=3, length=9)]
    try:
        with site.open(transport) as opened:
            assert type(opened.transport).name == transport
            for version in (1, 2):
                # A trained adapter, made large enough that sampling with it or without
                # it (or with the last version's) is told apart by orders of magnitude.
                # Seeds of this transport's own: a worker still holding the other test's
                # adapter fails the check too.
                g = torch.Generator().manual_seed(version + 100 * (transport == "nccl"))
                with torch.no_grad():
                    for p in trainer.model.parameters():
                        if p.requires_grad:
                            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
                exported = trainer.export_weights(version)
                assert exported is not None
                adapter_bytes = sum(t.numel() * t.element_size() for t in exported.tensors.values())
                _push(opened, dict(exported.tensors), version)
                loads = opened.generator._replicas[0].last_load
                assert loads and all(x["ok"] for x in loads), loads
                # Only the adapter moved: its bytes, not the model's.
                assert loads[0]["bytes"] == adapter_bytes, (loads[0]["bytes"], adapter_bytes)

                requests = [
                    GenerationRequest(f"lora-v{version}-{i}", p, 2, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0))
                    for i, p in enumerate(prompts)
                ]
                results = asyncio.run(opened.generator.generate(requests))
                with_adapter, without = [], []
                for request, completions in zip(requests, results):
                    prompt = list(request.prompt_token_ids)
                    for comp in completions:
                        assert comp.policy_version == version
                        with_adapter.append(_gap(trainer.model, prompt, comp, 1.0))
                        with adapter_off(trainer.model):
                            without.append(_gap(trainer.model, prompt, comp, 1.0))
                assert max(with_adapter) < ATOL, f"version {version}: served logprobs {max(with_adapter):.2e} from the trainer's"
                # The check above can fail: without the adapter the logprobs are far off.
                assert min(without) > 100 * ATOL, f"version {version}: the adapter changes nothing ({min(without):.2e})"
    finally:
        trainer.close()


def test_keep_carries_requests_from_the_zero_adapter_onto_the_next_version(
    site: Any, model_dir: Path, tmp_path: Path
) -> None:
    """Version 0 is an all-zero adapter every request names: its logprobs are the base
    model's. Under ``keep`` requests started at version 0 are frozen mid-way, the adapter
    of version 1 replaces it in place, and they go on with it from the next token: each
    token is labelled with the version that sampled it and has that version's logprob
    (had the requests named the base model at version 0, their tokens after the update
    would be sampled without the adapter: the base model's logprobs, which differ from
    version 1's by more than 100 times the tolerance at each boundary)."""
    import httpx
    import torch

    from forgerl.types import GenerationRequest, SamplingParams
    from forgerl_plugins.generators.vllm.adapter import ADAPTER_ID
    from forgerl_plugins.trainers.shared.lora import adapter_off
    from tests.helpers import trainer_worker as worker

    trainer = worker.make_trainer(model_dir, tmp_path, 2, lora={"rank": RANK, "alpha": 16})
    prompts = [site.chat_prompt("What is 2 + 3?"), site.random_prompt(seed=5, length=9)]
    try:
        with site.open("shm") as opened:
            gen = opened.generator
            # The server holds the last test's adapter: the new generator brings it back
            # to version 0 (the zero adapter) before it serves.
            short = [GenerationRequest(f"zero-{i}", p, 2, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0))
                     for i, p in enumerate(prompts)]  # fmt: skip
            r = gen._replicas[0]
            for request, completions in zip(short, asyncio.run(gen.generate(short))):
                for comp in completions:
                    assert comp.policy_version == 0
                    with adapter_off(trainer.model):
                        gap = _gap(trainer.model, list(request.prompt_token_ids), comp, 1.0)
                    assert gap < ATOL, f"version 0: served logprobs {gap:.2e} from the base model's"
            held = httpx.post(r.url + "/collective_rpc", json={"method": "forge_adapters"}, headers=r.headers,
                              timeout=scaled(60)).json()["results"]  # fmt: skip
            assert held == [[ADAPTER_ID]], f"version 0: the workers hold adapters {held}, not the zero one"

            room = (r.max_model_len or 1024) - max(len(p) for p in prompts) - 8
            long = [GenerationRequest(f"keep-{i}", p, 2, SamplingParams(max_tokens=min(room, 400), temperature=1.0))
                    for i, p in enumerate(prompts)]  # fmt: skip
            pause = gen.engine.pause

            async def pause_once_sampling(replica: Any, policy: str) -> None:
                # The update waits until every choice of the long requests has sampled a
                # token (the workers' own counts); hundreds are left to sample after it.
                # A re-sync's pause (abort: the watcher bringing the replica back to the
                # generator's version) goes through at once: it must not wait for requests
                # that cannot be sent while it holds the replica.
                if policy != "keep":
                    await pause(replica, policy)
                    return
                deadline = asyncio.get_running_loop().time() + scaled(120)
                while True:
                    counts = await gen.engine.sampled_so_far(replica, list(replica.flights))
                    if len(counts) == len(long) and all(len(c) == 2 and min(c.values()) > 0 for c in counts.values()):
                        break
                    assert asyncio.get_running_loop().time() < deadline, f"the requests never sampled: {counts}"
                    await asyncio.sleep(0.01)
                await pause(replica, policy)

            gen.updater.policy = "keep"
            gen.engine.pause = pause_once_sampling  # type: ignore[method-assign]
            results: list[Any] = []
            runner = threading.Thread(target=lambda: results.append(asyncio.run(gen.generate(long))))
            runner.start()
            g = torch.Generator().manual_seed(7)
            with torch.no_grad():
                for p in trainer.model.parameters():
                    if p.requires_grad:
                        p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            exported = trainer.export_weights(1)
            assert exported is not None
            deadline = time.monotonic() + scaled(60)
            while not r.flights:  # in flight before the update begins
                assert time.monotonic() < deadline, (
                    f"the requests never reached the replica (generating: {runner.is_alive()}): {gen.replica_info()}"
                )
                time.sleep(0.02)
            _push(opened, dict(exported.tensors), 1)
            runner.join(scaled(300))
            assert results, "generation did not finish"
            crossed, apart = 0, []
            for request, completions in zip(long, results[0]):
                prompt = list(request.prompt_token_ids)
                for comp in completions:
                    assert comp.policy_version == 0  # its oldest token's
                    versions = comp.versions or [0] * len(comp.token_ids)
                    boundary = versions.index(1) if 1 in versions else len(versions)
                    assert versions == [0] * boundary + [1] * (len(versions) - boundary), versions
                    crossed += 0 < boundary < len(versions)
                    served = torch.tensor(comp.logprobs)
                    with torch.no_grad():
                        logits = trainer.model(input_ids=torch.tensor([prompt + list(comp.token_ids)])).logits
                        new = torch.log_softmax(logits[0, len(prompt) - 1 : -1].float(), -1)
                        with adapter_off(trainer.model):
                            logits = trainer.model(input_ids=torch.tensor([prompt + list(comp.token_ids)])).logits
                        old = torch.log_softmax(logits[0, len(prompt) - 1 : -1].float(), -1)
                    index = torch.tensor(comp.token_ids).unsqueeze(-1)
                    old_lp, new_lp = old.gather(-1, index).squeeze(-1), new.gather(-1, index).squeeze(-1)
                    for name, want, part in (("0 (zero adapter)", old_lp, slice(0, boundary)),
                                             ("1", new_lp, slice(boundary, None))):  # fmt: skip
                        if len(served[part]):
                            gap = float((served[part] - want[part]).abs().max())
                            assert gap < ATOL, f"{request.request_id}: version {name}'s tokens {part}: gap {gap:.2e}"
                    if 0 < boundary < len(versions):
                        # What makes the checks above fail for a boundary one token off, and
                        # for tokens after the update sampled without the adapter.
                        at = float((old_lp[boundary] - new_lp[boundary]).abs())
                        after = float((old_lp[boundary:] - new_lp[boundary:]).abs().max())
                        apart.append((at, after))
            assert crossed, "no completion ran across the update: the pause did not find them sampling"
            assert min(at for at, _ in apart) > ATOL, f"versions 0 and 1 agree at a boundary: {apart}"
            assert min(after for _, after in apart) > 100 * ATOL, f"the adapter changes little after the update: {apart}"
    finally:
        trainer.close()
