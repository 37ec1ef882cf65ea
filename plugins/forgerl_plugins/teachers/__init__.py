"""Built-in distillation teachers (kind ``teacher``, docs/distillation.md).

``model``: a causal language model scores the student's sampled tokens, in the trainer's
process (:mod:`.local`), through a vLLM server the run starts as one of its roles
(:mod:`.server`, :mod:`.client`), or through any OpenAI-compatible server at a URL that
returns prompt logprobs. The class is :class:`.model.ModelTeacher`.

Registered by the ``rewards`` plugin (:mod:`forgerl_plugins.rewards`, whose served reward
model this teacher's serving mirrors): a package of its own would need an entry point of
its own, which only a reinstall of forgerl adds.
"""
