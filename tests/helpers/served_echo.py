"""Test-only plugin: a generator and a reward that declare server roles whose ``serve``
records what ``forgerl.server_role`` gave it, for tests of that entry
(tests/unit/test_server_role.py).

Loaded with ``FORGE_PLUGINS=tests.helpers.served_echo``. Each ``serve`` writes
``<run_dir>/served/<role>-<replica>.json`` (its options' class and values, the context's
facts, the role and the replica) and returns the options' ``exit_status``. Neither
backend is built by these tests: only their roles run, so the generator refuses to
generate and the reward to score, each saying so.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic import Field

from forgerl.errors import GeneratorError, RewardError
from forgerl.hookspecs import hookimpl
from forgerl.interfaces import Generator, Reward, RunContext
from forgerl.options import OptionsModel
from forgerl.rundirs.runs import server_role_command
from forgerl.types import RoleSpec

PLUGIN = __name__


def record(options: OptionsModel, context: RunContext, role: str, replica: int) -> dict[str, Any]:
    """What ``serve`` was called with, written where the test reads it."""
    seen = {
        "options_class": type(options).__qualname__,
        "options": options.model_dump(mode="json"),
        "model_path": None if context.model_path is None else str(context.model_path),
        "model_name": context.model_name,
        "max_staleness": context.max_staleness,
        "run_dir": str(context.run_dir),
        "role": role,
        "replica": replica,
        "pid": os.getpid(),
    }
    path = Path(context.run_dir) / "served" / f"{role}-{replica}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(seen))
    return seen


class ServedEchoGenerator(Generator):
    name = "served_echo"
    description = "test-only: a server role that records what forgerl.server_role gave it"

    class Options(OptionsModel):
        replicas: int = Field(1, ge=1)
        exit_status: int = Field(0, ge=0, le=255)

    @staticmethod
    def roles(options: ServedEchoGenerator.Options, *, context: RunContext) -> list[RoleSpec]:
        return [RoleSpec(name="echo", command=server_role_command(context.run_dir, "echo"), replicas=options.replicas)]

    @staticmethod
    def serve(options: ServedEchoGenerator.Options, *, context: RunContext, role: str, replica: int) -> int:
        record(options, context, role, replica)
        return options.exit_status

    def __init__(self, options: Options, *, context: RunContext, transport: Any) -> None:
        self.options = options

    async def generate(self, requests):
        raise GeneratorError("served_echo only has a server role; it generates nothing")

    def update_weights(self, version: int) -> None:
        raise GeneratorError("served_echo only has a server role; it loads no weights")

    def policy_version(self) -> int:
        return 0


class ServedEchoReward(Reward):
    name = "served_echo"
    description = "test-only: a server role that records what forgerl.server_role gave it"

    class Options(OptionsModel):
        server: str = Field("echo-reward", description="The role's name.")
        label: int = 0
        exit_status: int = Field(0, ge=0, le=255)

    @staticmethod
    def roles(options: ServedEchoReward.Options, *, context: RunContext) -> list[RoleSpec]:
        return [RoleSpec(name=options.server, command=server_role_command(context.run_dir, options.server))]

    @staticmethod
    def serve(options: ServedEchoReward.Options, *, context: RunContext, role: str, replica: int) -> int:
        record(options, context, role, replica)
        return options.exit_status

    def __init__(self, options: Options) -> None:
        self.options = options

    def score(self, sample):
        raise RewardError("served_echo only has a server role; it scores nothing")


@hookimpl
def forge_generators():
    return [ServedEchoGenerator]


@hookimpl
def forge_rewards():
    return [ServedEchoReward]
