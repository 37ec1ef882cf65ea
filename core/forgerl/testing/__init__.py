"""``forgerl.testing``: conformance kits a plugin runs against its own backend.

Each kit is a pytest test class. A plugin's test module subclasses it, names the backend
(the name it registers) and its options, and pytest runs every check of the contract of
that kind against it::

    # tests/test_conformance.py of a plugin
    from forgerl.testing import (
        EnvironmentContract, GeneratorContract, RewardContract, TaskContract, TransportContract,
    )

    class TestMyReward(RewardContract):
        backend = "my_reward"
        options = {"strict": True}       # what a run's config would hold

    class TestMyTask(TaskContract):
        backend = "my_task"

    class TestMyTransport(TransportContract):
        backend = "my_transport"
        confirms_delivery = True         # its send waits for every receiver

    class TestMyGenerator(GeneratorContract):
        backend = "my_generator"         # checked on the built-in tiny model by default

    class TestMyEnvironment(EnvironmentContract):
        backend = "my_environment"
        turns = ("<answer>42</answer>",) # what the environment is meant to receive

Backends are built the way a run builds them, through the public build contract
(``build_registry().require(kind, name).build(options, ...)``, :mod:`forgerl.contract`),
so the plugin must be installed, or named in the class's ``plugins`` (import paths of
plugin modules, like ``FORGE_PLUGINS``).

Importing this package imports neither pytest nor torch: each kit is imported on first use
(:class:`TransportContract`, :class:`TrainerContract` and :class:`GeneratorContract` need
torch when their tests run, the others never do; the generator kit also needs transformers,
and :class:`EnvironmentContract` its tokenizer classes).
Deadlines in the kits stretch with ``FORGE_TEST_TIMEOUT_SCALE`` (:mod:`forgerl.testing.timing`).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

_KITS = {
    "RewardContract": "forgerl.testing.reward",
    "TaskContract": "forgerl.testing.task",
    "TransportContract": "forgerl.testing.transport",
    "TransportCase": "forgerl.testing.transport",
    "TrainerContract": "forgerl.testing.trainer",
    "SchedulerContract": "forgerl.testing.scheduler",
    "GeneratorContract": "forgerl.testing.generator",
    "EnvironmentContract": "forgerl.testing.environment",
}

__all__ = list(_KITS)  # the kits' names, listed once in _KITS

_pytest = sys.modules.get("pytest")
if _pytest is not None:
    # Under pytest, a failed check of a kit shows its values like a test's own assert does
    # (the kits are imported after this line, so pytest can rewrite their asserts).
    _pytest.register_assert_rewrite(
        "forgerl.testing.reward",
        "forgerl.testing.task",
        "forgerl.testing.transport",
        "forgerl.testing.trainer",
        "forgerl.testing.scheduler",
        "forgerl.testing.generator",
        "forgerl.testing.generator_lifecycle",
        "forgerl.testing.environment",
    )


def __getattr__(name: str) -> Any:
    if name in _KITS:
        return getattr(importlib.import_module(_KITS[name]), name)
    raise AttributeError(f"module 'forgerl.testing' has no attribute {name!r}")
