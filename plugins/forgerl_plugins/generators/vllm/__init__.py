"""``vllm``: vLLM's OpenAI-compatible servers, many replicas.

The scheduler starts ``replicas`` server processes beside the trainer (see
:meth:`.generator.VLLMGenerator.roles`); trainer rank 0 talks to them over
HTTP (:mod:`.generator`) and loads new weights into them through the run's transport
(:mod:`.worker_extension`, inside vLLM's workers). :class:`.generator.VLLMGenerator` holds the
backend's name, options and checks; nothing it imports at its top level imports vLLM or httpx.
"""

from __future__ import annotations

from forgerl.hookspecs import hookimpl


@hookimpl
def forge_generators():
    return ["forgerl_plugins.generators.vllm.generator:VLLMGenerator"]
