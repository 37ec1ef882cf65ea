"""The names that tie a kind of backend to its registration hook, its config field and
its ``forge run`` flag: one table, read by the registry (:mod:`forgerl.registry.plugins`), the
config (:mod:`forgerl.configuration.config`) and the command line (:mod:`forgerl.cli`), so that they
cannot disagree. Imports nothing: ``forge --help`` reads it.
"""

from __future__ import annotations

#: kind -> the hook that registers backends of that kind (see :mod:`forgerl.hookspecs`),
#: in the order ``forge plugins list`` and the config reference show the kinds.
REGISTRATION_HOOKS: dict[str, str] = {
    "generator": "forge_generators",
    "trainer": "forge_trainers",
    "reward": "forge_rewards",
    "transport": "forge_transports",
    "scheduler": "forge_schedulers",
    "task": "forge_tasks",
    "model": "forge_models",
    "environment": "forge_environments",
    "teacher": "forge_teachers",
}

#: Every kind of backend.
KINDS: tuple[str, ...] = tuple(REGISTRATION_HOOKS)

#: RunConfig field holding one backend choice -> the kind of backend it names. Each has a
#: ``forge run`` flag of the same name (``--generator NAME`` sets ``generator.name``).
SINGLE_BACKEND_FIELDS: dict[str, str] = {
    "generator": "generator",
    "trainer": "trainer",
    "transport": "transport",
    "scheduler": "scheduler",
    "task": "task",
}

#: The named flags of ``forge run`` and ``forge config show``: the keys of
#: ``build_config(flags=...)`` and of the embedding API's ``load_config(flags=...)``.
FLAGS: tuple[str, ...] = (*SINGLE_BACKEND_FIELDS, "rewards", "model", "steps", "output", "environment")

#: The optional backend choice: ``environment.name`` is None (single-turn rollouts, no
#: environment) unless set; ``--environment NAME`` sets it.
OPTIONAL_BACKEND_FIELDS: dict[str, str] = {"environment": "environment"}
