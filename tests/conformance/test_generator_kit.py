"""The built-in generators pass the Generator kit of forgerl.testing (forgerl/testing/generator.py),
run as a third-party generator runs it: by naming the backend.

``hf`` runs in this process on the kit's tiny model. ``vllm`` runs in the server its role
starts (with the local scheduler, as ``forge run`` does): the session's shared one
(tests/helpers/shared_vllm.py), started once; vLLM's CPU attention kernels need heads at
least 32 wide, hence a hidden size of 128 (4 heads of 32).
"""

from __future__ import annotations

import importlib.util

import pytest

from forgerl.testing import GeneratorContract

from ..helpers.shared_vllm import TINY_MODEL_OPTIONS, VLLM_OPTIONS

pytestmark = pytest.mark.integration


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
    tiny_model_options = TINY_MODEL_OPTIONS
    options = VLLM_OPTIONS

    @pytest.fixture(scope="class")
    @classmethod
    def generator_site(cls, shared_vllm):
        # The session's server (tests/helpers/shared_vllm.py), which OpenAI-compatible
        # clients use too: the same role, model and options as the kit's own would be.
        return shared_vllm.site()
