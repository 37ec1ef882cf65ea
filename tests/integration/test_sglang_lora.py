"""LoRA through the sglang generator against the SGLang test double (CPU): the server starts
with a LoRA pool sized from the run's ``trainer.options.lora``, each adapter version the
``fsdp`` trainer exports crosses the shm transport into a staged folder, the generator
swaps it in by name (``/unload_lora_adapter``, ``/load_lora_adapter``) and samples with it
(``lora_path`` in every ``/generate``). The double applies an adapter only to the
generations that name it, so served logprobs equal to the trainer's (adapter applied) show
both the load and the naming. tests/gpu/test_sglang_cuda.py runs this test against real
SGLang servers.
"""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any

import pytest

from ..helpers.timing import scaled
from .test_sglang_double import PLUGIN, _calls, _options

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed"),
]

RANK = 8
SETTINGS = (f"trainer.options.lora.rank={RANK}", "trainer.options.lora.alpha=16")
#: fp32 on both sides (the double samples with transformers on the CPU).
ATOL = 1e-4


@pytest.fixture(scope="module")
def lora_site(tmp_path_factory):
    """One replica of the double, started as a LoRA run starts it; and the logprob tolerance."""
    from forgerl.testing.generator_support import open_site, tiny_model

    model = tiny_model(tmp_path_factory.mktemp("model"), {}, ())
    run = tmp_path_factory.mktemp("run")
    with open_site("sglang_double", _options(), (PLUGIN,), model, run, SETTINGS) as site:
        yield site, ATOL


def _sample(opened: Any, site: Any, tag: str) -> list[tuple[list[int], Any]]:
    from forgerl.types import GenerationRequest, SamplingParams

    prompts = [site.chat_prompt("What is 2 + 3?"), site.random_prompt(seed=3, length=9)]
    requests = [
        GenerationRequest(f"{tag}-{i}", p, 2, SamplingParams(max_tokens=12, temperature=1.0, seed=i))
        for i, p in enumerate(prompts)
    ]
    results = asyncio.run(opened.generator.generate(requests))
    return [(list(r.prompt_token_ids), c) for r, cs in zip(requests, results) for c in cs]


def _adapter_calls_of_the_last_update(generator: Any) -> list[dict] | None:
    """The admin calls replica 0 got after its last pause (None on real SGLang)."""
    calls = _calls(generator, 0)
    if calls is None:
        return None
    last_pause = max(i for i, c in enumerate(calls) if c["path"] == "/pause_generation")
    return calls[last_pause + 1 :]


def test_each_adapter_version_is_loaded_by_name_and_sampled_with(lora_site: Any, tmp_path) -> None:
    import torch

    from forgerl.adapters import ADAPTER_NAME
    from forgerl.testing.generator_support import logprob_gap, push
    from forgerl_plugins.trainers.shared.lora import adapter_off
    from tests.helpers import trainer_worker as worker

    site, atol = lora_site
    trainer = worker.make_trainer(site.model_dir, tmp_path, 2, lora={"rank": RANK, "alpha": 16})
    try:
        with site.open() as opened:
            for prompt, c in _sample(opened, site, "base"):
                assert c.policy_version == 0
                assert logprob_gap(site.reference(), prompt, c, 1.0) < atol, "version 0 is not the base model"
            for version in (1, 2):
                # An adapter large enough that sampling with it, without it, or with the last
                # version's is told apart by orders of magnitude.
                g = torch.Generator().manual_seed(version)
                with torch.no_grad():
                    for p in trainer.model.parameters():
                        if p.requires_grad:
                            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
                exported = trainer.export_weights(version)
                assert exported is not None
                push(opened, version, exported.tensors, scaled(60))
                calls = _adapter_calls_of_the_last_update(opened.generator)
                if calls is not None:
                    assert [c["path"] for c in calls[:3]] == [
                        "/unload_lora_adapter", "/load_lora_adapter", "/update_weight_version",
                    ], calls  # fmt: skip
                    assert calls[0]["lora_name"] == calls[1]["lora_name"] == ADAPTER_NAME
                    assert calls[2]["new_version"] == str(version)
                for prompt, c in _sample(opened, site, f"v{version}"):
                    assert c.policy_version == version
                    gap = logprob_gap(trainer.model, prompt, c, 1.0)
                    assert gap < atol, f"version {version}: served logprobs {gap:.2e} from the trainer's"
                    with adapter_off(trainer.model):
                        # The check above can fail: without the adapter the logprobs are far off.
                        assert logprob_gap(trainer.model, prompt, c, 1.0) > 100 * atol
        # A new generator (version 0) takes the server, which holds version 2, back to the
        # base model before it samples: the adapter is unloaded.
        with site.open() as opened:
            for prompt, c in _sample(opened, site, "again"):
                assert c.policy_version == 0
                assert logprob_gap(site.reference(), prompt, c, 1.0) < atol, "the adapter outlived version 0"
            calls = _adapter_calls_of_the_last_update(opened.generator)
            if calls is not None:
                assert calls[0] == {"path": "/unload_lora_adapter", "lora_name": ADAPTER_NAME}, calls
    finally:
        trainer.close()
