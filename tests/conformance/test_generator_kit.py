"""The built-in generators pass the Generator kit of forgerl.testing (forgerl/testing/generator.py),
run as a third-party generator runs it: by naming the backend.

``hf`` runs in this process on the kit's tiny model. ``vllm`` runs in servers its roles
start (the kit starts them once for the class with the local scheduler, as ``forge run``
does); vLLM's CPU attention kernels need heads at least 32 wide, hence a hidden size of
128 (4 heads of 32).
"""

from __future__ import annotations

import importlib.util

import pytest

from forgerl.testing import GeneratorContract

from ..helpers.timing import scaled

pytestmark = pytest.mark.integration

SERVER_WAIT_S = 420.0  # start-up (and resync) of a vLLM server on a busy two-core machine


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # Two cores shared with other test runs: intra-op threads on 64-wide matrices only contend.
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class TestHFGenerator(GeneratorContract):
    backend = "hf"
    options = {"batch_size": 8}


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (pip install 'forgerl[vllm]')")
class TestVLLMGenerator(GeneratorContract):
    backend = "vllm"
    tiny_model_options = {"hidden_size": 128}
    options = {
        "replicas": 1,
        "kv_cache_gb": 0.25,
        "health_interval": 0.5,
        # Patience, not what is tested here: scaled, so a loaded machine is no "hang".
        "liveness_timeout": scaled(60),
        "startup_timeout": scaled(SERVER_WAIT_S),
    }
