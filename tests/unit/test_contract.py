"""The build contract (forgerl.contract): every kind is built with its validated options
model and named runtime arguments, and a plugin written for another calling convention is
refused in one line before its factory runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict

from forgerl.backends import (
    GeneratorBackend,
    ModelBackend,
    RewardBackend,
    SchedulerBackend,
    TaskBackend,
    TrainerBackend,
    TransportBackend,
)
from forgerl.configuration.config import RunConfig
from forgerl.contract import SIGNATURES
from forgerl.errors import BackendContractError
from forgerl.hookspecs import hookimpl
from forgerl.interfaces import Reward, RunContext, Scheduler, TransportReceiver
from forgerl.registry.plugins import build_registry

from .fakedist import make_dist


class Opts(BaseModel):
    model_config = ConfigDict(extra="forbid")
    size: int = 1


class Recorder:
    """An embedded plugin with one backend of every kind; each factory records its call."""

    forge_plugin_name = "recorder"

    def __init__(self):
        self.calls: dict[str, tuple[object, dict]] = {}

    def _factory(self, kind):
        def factory(options, **runtime):
            self.calls[kind] = (options, runtime)
            return {"model": Path("/model"), "roles": []}.get(kind, object())

        return factory

    @hookimpl
    def forge_generators(self):
        return [GeneratorBackend("g", self._factory("generator"), Opts, roles=self._factory("roles"))]

    @hookimpl
    def forge_trainers(self):
        return [TrainerBackend("t", self._factory("trainer"), Opts)]

    @hookimpl
    def forge_transports(self):
        return [TransportBackend("x", self._factory("transport"), Opts)]

    @hookimpl
    def forge_tasks(self):
        return [TaskBackend("k", self._factory("task"), Opts)]

    @hookimpl
    def forge_rewards(self):
        return [RewardBackend("r", self._factory("reward"), Opts)]

    @hookimpl
    def forge_schedulers(self):
        return [SchedulerBackend("s", self._factory("scheduler"), Opts)]

    @hookimpl
    def forge_models(self):
        return [ModelBackend("m", self._factory("model"), Opts)]


def test_every_kind_gets_its_options_model_and_its_named_runtime_arguments(tmp_path):
    plugin = Recorder()
    reg = build_registry(plugins=[plugin], entry_points=False)
    ctx = RunContext.for_run(RunConfig(), tmp_path)
    transport = object()
    reg.require("generator", "g").build({"size": 2}, context=ctx, transport=transport)
    assert reg.require("generator", "g").server_roles({"size": 2}, context=ctx) == []
    reg.require("trainer", "t").build({"size": 2}, context=ctx)
    reg.require("transport", "x").build({"size": 2}, context=None)
    reg.require("task", "k").build({"size": 2}, seed=7)
    reg.require("reward", "r").build({"size": 2})
    reg.require("scheduler", "s").build({"size": 2})
    assert reg.require("model", "m").build({"size": 2}, cache_dir=tmp_path) == Path("/model")

    runtime = {kind: rt for kind, (_, rt) in plugin.calls.items()}
    assert runtime == {
        "generator": {"context": ctx, "transport": transport},
        "roles": {"context": ctx},
        "trainer": {"context": ctx},
        "transport": {"context": None},
        "task": {"seed": 7},
        "reward": {},
        "scheduler": {},
        "model": {"cache_dir": tmp_path},
    }
    # The validated model, never the dict it came from.
    assert all(type(options) is Opts and options.size == 2 for options, _ in plugin.calls.values())


def test_a_validated_options_model_is_passed_through_as_is(tmp_path):
    plugin = Recorder()
    reg = build_registry(plugins=[plugin], entry_points=False)
    options = Opts(size=3)
    reg.require("trainer", "t").build(options, context=RunContext.for_run(RunConfig(), tmp_path))
    assert plugin.calls["trainer"][0] is options  # validated once, not dumped and validated again


OLD_CONVENTION = """
from forgerl.backends import GeneratorBackend, TransportBackend
from forgerl.hookspecs import hookimpl

CALLED = []


class OldGenerator:
    def __init__(self, options, ctx):  # forgerl < contract v1: the transport was in ctx.extras
        CALLED.append("generator")


def old_transport(options, ctx=None):
    CALLED.append("transport")


def old_roles(options, ctx):
    CALLED.append("roles")
    return []


@hookimpl
def forge_generators():
    return [GeneratorBackend(name="old", factory="fake_old_old:OldGenerator", roles="fake_old_old:old_roles")]


@hookimpl
def forge_transports():
    return [TransportBackend(name="old", factory=old_transport)]
"""


@pytest.fixture
def old_plugin(tmp_path, monkeypatch):
    site = make_dist(tmp_path / "site", "fake-old", "1.0", {"old": OLD_CONVENTION})
    monkeypatch.syspath_prepend(str(site))
    for var in ("FORGE_DISABLE_PLUGINS", "FORGE_STRICT_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    yield build_registry()
    sys.modules.pop("fake_old_old", None)


def _one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert err.value.user_fixable and "\n" not in message, message
    return message


def test_a_factory_of_the_old_calling_convention_is_refused_before_it_runs(old_plugin, tmp_path):
    ctx = RunContext.for_run(RunConfig(), tmp_path)
    with pytest.raises(BackendContractError) as err:
        old_plugin.require("generator", "old").build({}, context=ctx, transport=object())
    message = _one_line(err)
    assert message.startswith(
        "generator 'old' of plugin 'old' (fake-old 1.0): fake_old_old:OldGenerator(options, ctx)"
    )
    assert SIGNATURES["generator"] in message and "upgrade it" in message

    with pytest.raises(BackendContractError) as err:
        old_plugin.require("generator", "old").server_roles({}, context=ctx)
    assert SIGNATURES["generator roles"] in _one_line(err)

    with pytest.raises(BackendContractError) as err:
        old_plugin.require("transport", "old").build({}, context=None)
    message = _one_line(err)
    assert "old_transport(options, ctx=None)" in message and SIGNATURES["transport"] in message
    assert sys.modules["fake_old_old"].CALLED == []


def test_a_task_whose_seed_parameter_is_named_seed_still_fits():
    """``factory(options, seed)`` written positionally takes ``seed=`` as well: no break."""

    class Plugin:
        forge_plugin_name = "positional-seed"
        seeds: list[int] = []

        @hookimpl
        def forge_tasks(self):
            return [TaskBackend("positional", lambda options, seed: self.seeds.append(seed))]

    plugin = Plugin()
    build_registry(plugins=[plugin], entry_points=False).require("task", "positional").build({}, seed=5)
    assert plugin.seeds == [5]


def test_a_reward_that_implements_neither_score_nor_ascore_is_refused_when_built():
    class Silent(Reward):
        def __init__(self, options):
            pass

    class Plugin:
        forge_plugin_name = "silent"

        @hookimpl
        def forge_rewards(self):
            return [RewardBackend("silent", Silent)]

    with pytest.raises(BackendContractError) as err:
        build_registry(plugins=[Plugin()], entry_points=False).require("reward", "silent").build({})
    assert "Silent implements neither score nor ascore" in _one_line(err)


def test_what_the_loop_and_the_cli_call_is_required_of_every_backend():
    """A scheduler without ``wait`` (``forge run`` waits on every scheduler) or a receiver
    without ``latest_version`` (a restarted worker asks it) cannot be instantiated."""

    class NoWait(Scheduler):
        def submit(self, job): ...
        def status(self, job_id): ...
        def cancel(self, job_id): ...

    class NoLatest(TransportReceiver):
        def receive(self, version, timeout=None): ...

    for cls, method in ((NoWait, "wait"), (NoLatest, "latest_version")):
        with pytest.raises(TypeError, match=method):
            cls()
    assert Scheduler.supports_logs is False  # logs are a capability a scheduler declares


def test_the_plugin_guide_shows_the_contract_as_written_in_one_place():
    """docs/plugins.md's table is generated from forgerl.contract.CONTRACT, which the
    records' build and the error messages use: the three cannot drift apart."""
    from pathlib import Path

    from forgerl.contract import contract_table

    guide = (Path(__file__).resolve().parents[2] / "docs" / "plugins.md").read_text()
    assert contract_table() in guide, (
        "docs/plugins.md's contract table is stale: replace it with the output of "
        "`python -c 'from forgerl.contract import contract_table; print(contract_table())'`"
    )


def test_a_backend_is_built_with_exactly_its_kinds_runtime_arguments():
    from forgerl.registry.plugins import build_registry

    task = build_registry().require("task", "arithmetic")
    assert task.build({}, seed=3).seed == 3
    with pytest.raises(TypeError, match=r"a task is built with \['seed'\], not \['context', 'seed'\]"):
        task.build({}, seed=3, context=None)


def test_a_transport_describes_itself_to_another_process(tmp_path):
    """What a generator ships to its worker processes: the transport's name and validated
    options, typed and versioned; the other side builds the same transport from it."""
    import json

    from forgerl.errors import TransportError
    from forgerl_plugins.transports.shm.transport import ShmTransport

    registry = build_registry()
    transport = registry.require("transport", "shm").build({"directory": str(tmp_path / "w")}, context=None)
    described = json.loads(json.dumps(transport.describe()))  # it crosses as JSON
    assert described["format"] == "forgerl.transport" and described["version"] == 1 and described["name"] == "shm"
    again = registry.transport_from(described)
    assert isinstance(again, ShmTransport) and again.options == transport.options
    with pytest.raises(TransportError, match="version 2; this forgerl reads 'forgerl.transport' version 1"):
        registry.transport_from({**described, "version": 2})
    by_hand = ShmTransport(ShmTransport.Options(directory=str(tmp_path / "h")), context=None)
    assert by_hand.describe()["options"]["directory"] == str(tmp_path / "h")  # from its class and options

    class Anonymous(ShmTransport):  # no name of its own: cannot say which backend it is
        pass

    nameless = Anonymous(ShmTransport.Options(directory=str(tmp_path / "a")), context=None)
    with pytest.raises(TransportError, match="was not built through the registry"):
        nameless.describe()
    for t in (transport, again, by_hand, nameless):
        t.close()
