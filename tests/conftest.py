"""Fixtures shared by the whole test suite."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .helpers.requires import require_mooncake

# Before anything imports torch: OpenMP threads that spin while waiting make every torch
# op many times slower when tests, servers and ranks share the two cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face folder with the tiny random Qwen2 (tied embeddings, vocab 512, ChatML
    template, eos ``<|im_end|>``), built once per test session (about 5 s)."""
    from forgerl_plugins.models.tiny import TinyModel, build_tiny_model

    return build_tiny_model(TinyModel.Options(), cache_dir=tmp_path_factory.mktemp("models"))


#: The built-in transports the transport suites (tests/conformance, tests/faults) run a
#: test against through ``name``. A module that applies to fewer narrows it:
#: ``pytestmark = pytest.mark.parametrize("name", ["nccl", "rdma"], indirect=True)``.
TRANSPORTS = ["shm", "nccl", "rdma"]


@pytest.fixture(params=TRANSPORTS)
def name(request: pytest.FixtureRequest) -> str:
    """The transport under test; rdma's tests skip (or fail, under FORGE_REQUIRE_RDMA=1)
    without Mooncake."""
    if request.param == "rdma":
        require_mooncake()
    return request.param
