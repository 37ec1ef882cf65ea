"""The sglang generator, end to end on CPU, against the SGLang test double
(tests/helpers/sglang_double.py): the real role, launcher, client, weight updates and
failover; a double instead of SGLang (no CPU build exists).

What this proves: the plugin's command line, payloads and answers fit the double's
SGLang-shaped API (its request models use SGLang's field names and refuse others); the
generator passes the Generator kit against it (the double samples with the model in
transformers, so logprobs, versions and weight updates are checked for real); the
transport's engine receivers deliver whole versions (shm: a staged folder; nccl: a group
built as SGLang builds it, over gloo). What it cannot prove: that SGLang itself answers
the same way. tests/gpu/test_sglang_cuda.py runs against real SGLang servers.
"""

from __future__ import annotations

import pytest

from forgerl.testing import GeneratorContract

from ..helpers.sglang_double_plugin import DOUBLE_COMMAND
from ..helpers.timing import scaled

pytestmark = pytest.mark.integration

PLUGIN = "tests.helpers.sglang_double_plugin"


def _options(**more):
    return {
        "replicas": 1,
        "launch_command": DOUBLE_COMMAND,
        "send_seed": True,  # the double honours sampling_seed (SGLang: with sampling_backend pytorch)
        "health_interval": 0.5,
        "liveness_timeout": scaled(60),
        "startup_timeout": scaled(240),
        **more,
    }


class TestSGLangGeneratorOverShm(GeneratorContract):
    backend = "sglang_double"
    plugins = (PLUGIN,)
    options = _options()


class TestSGLangGeneratorOverNcclAbortPolicy(GeneratorContract):
    backend = "sglang_double"
    plugins = (PLUGIN,)
    options = _options(update_policy="abort")
    settings = ("transport.name=nccl", "transport.options={}")
