"""What forgerl's served engines share: the ``vllm`` and ``sglang`` generators' replicas,
the ``reward_model`` reward's vLLM server and the distillation teacher's. Each runs as a server role
(:mod:`forgerl.server_role` calls its backend's ``serve``), one launcher process beside
its engine's server:

* :mod:`.launcher`: free port, health, a first request, the endpoint file in the run
  directory, the liveness watch and the exit status;
* :mod:`.liveness`: the watch that kills a hung server;
* :mod:`.require_key`: the ASGI guard that makes every path of a server need the run's key;
* :mod:`.vllm_auth`: that guard as vLLM's ``--middleware`` (imported in vLLM's API server);
* :mod:`.vllm_server`: the parts of vLLM's OpenAI server command both vLLM users share;
* :mod:`.roles`: the role of a model a backend serves for itself (the reward model, the
  distillation teacher): its name and RoleSpec;
* :mod:`.role_client`: how such a backend finds, waits for and follows its server (or one
  at a URL) and posts to it.

Not a plugin: it registers no backend. Nothing here imports an engine or torch.
"""
