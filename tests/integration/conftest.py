"""Variants of the tiny model the trainer tests (test_trainers.py, test_fsdp_trainer.py,
test_torchtitan_trainer.py) train, each built once per session."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest


def _with_random_biases(source: Path, folder: Path) -> Path:
    """``source``'s model with random q/k/v biases (the tiny Qwen2's own are zero): the
    q/k bias permutation between Hugging Face's and TorchTitan's RoPE layouts, and the
    biases' tensor-parallel sharding, show only with biases that are not."""
    import torch
    from transformers import AutoModelForCausalLM

    shutil.copytree(source, folder, dirs_exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    model.save_pretrained(folder)
    return folder


def _tiny(tmp_path_factory: pytest.TempPathFactory, **options) -> Path:
    from forgerl_plugins.models.tiny import TinyModel, build_tiny_model

    return build_tiny_model(TinyModel.Options(**options), cache_dir=tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def biased_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _with_random_biases(tiny_model_dir, tmp_path_factory.mktemp("biased"))


@pytest.fixture(scope="session")
def wide_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 heads over 2 key/value heads, with biases: what tensor parallelism over 2 ranks splits."""
    return _with_random_biases(_tiny(tmp_path_factory, hidden_size=128), tmp_path_factory.mktemp("wide"))


@pytest.fixture(scope="session")
def llama_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny(tmp_path_factory, architecture="llama")


@pytest.fixture(scope="session")
def qwen3_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3 (q/k norms, explicit head_dim) with the tiny model's tokenizer;
    its norm weights are perturbed so that the q/k norms do something."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = tmp_path_factory.mktemp("qwen3")
    shutil.copytree(tiny_model_dir, folder, dirs_exist_ok=True)
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    tiny = json.loads((tiny_model_dir / "config.json").read_text())
    config = Qwen3Config(
        vocab_size=tiny["vocab_size"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=1024,
        tie_word_embeddings=True, eos_token_id=tiny["eos_token_id"], pad_token_id=tiny["pad_token_id"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0.0, 0.1, generator=gen)
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn(param.shape, generator=gen) * 0.1)
    model.save_pretrained(folder)
    return folder
