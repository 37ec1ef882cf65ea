"""Fixtures shared by the whole test suite."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Before anything imports torch: OpenMP threads that spin while waiting make every torch
# op many times slower when tests, servers and ranks share the two cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face folder with the tiny random Qwen2 (tied embeddings, vocab 512, ChatML
    template, eos ``<|im_end|>``), built once per test session (about 5 s)."""
    from forgerl_plugins.models import TinyModelOptions
    from forgerl_plugins.models.tiny import build_tiny_model

    return build_tiny_model(TinyModelOptions(), cache_dir=tmp_path_factory.mktemp("models"))
