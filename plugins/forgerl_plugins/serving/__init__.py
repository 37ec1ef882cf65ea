"""What forgerl's served engines share: the ``vllm`` and ``sglang`` generators' replicas
and the ``reward_model`` reward's vLLM server. Each runs as a server role
(:mod:`forgerl.server_role` calls its backend's ``serve``), one launcher process beside
its engine's server:

* :mod:`.launcher`: free port, health, a first request, the endpoint file in the run
  directory, the liveness watch and the exit status;
* :mod:`.liveness`: the watch that kills a hung server;
* :mod:`.require_key`: the ASGI guard that makes every path of a server need the run's key;
* :mod:`.vllm_auth`: that guard as vLLM's ``--middleware`` (imported in vLLM's API server);
* :mod:`.vllm_server`: the parts of vLLM's OpenAI server command both vLLM users share.

Not a plugin: it registers no backend. Nothing here imports an engine or torch.
"""
