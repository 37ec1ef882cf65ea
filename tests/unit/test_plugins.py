"""Plugin discovery, registration and failure modes, through real entry points."""

from __future__ import annotations

import sys

import pytest

from forgerl.errors import BackendUnavailable, DuplicateBackend, PluginError, UnknownBackend
from forgerl.plugins import build_registry

from .fakedist import BROKEN, COMMAND, DUPLICATE_HF, ECHO_GENERATOR, TYPO_HOOK, make_dist


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder on sys.path where fake distributions are 'installed'."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    for var in ("FORGE_DISABLE_PLUGINS", "FORGE_STRICT_PLUGINS", "FORGE_TRACE_HOOKS"):
        monkeypatch.delenv(var, raising=False)
    yield root
    for name in list(sys.modules):
        if name.startswith(("fake_", "other_")):
            del sys.modules[name]


def test_first_party_backends_come_from_entry_points():
    reg = build_registry()
    assert reg.owner("generator", "hf").distribution == "forgerl"
    assert {"hf", "vllm", "sglang"} <= set(reg.backends("generator"))
    assert {"fsdp", "torchtitan"} <= set(reg.backends("trainer"))
    assert {"shm", "nccl", "rdma"} <= set(reg.backends("transport"))
    assert {"local", "slurm", "kubernetes"} <= set(reg.backends("scheduler"))


def test_discovers_a_third_party_plugin_from_dist_info(site):
    make_dist(site, "fake-plugin", "1.2.3", {"echo": ECHO_GENERATOR})
    reg = build_registry()
    backend = reg.get("generator", "echo")
    assert backend.options_model.model_validate({"copies": 2}).copies == 2
    owner = reg.owner("generator", "echo")
    assert (owner.distribution, owner.version, owner.name) == ("fake-plugin", "1.2.3", "echo")
    assert "always_one" in reg.backends("reward")
    assert owner.hooks == ["forge_generators", "forge_rewards"]


def test_duplicate_backend_names_both_distributions(site):
    make_dist(site, "fake-dup", "0.9", {"duphf": DUPLICATE_HF})
    with pytest.raises(DuplicateBackend) as err:
        build_registry()
    msg = str(err.value)
    assert "'hf'" in msg and "forgerl 0.1.0" in msg and "fake-dup 0.9" in msg


def test_broken_plugin_is_a_warning_and_the_rest_works(site, capsys):
    make_dist(site, "fake-broken", "2.0", {"broken": BROKEN})
    make_dist(site / ".." / "site", "other-echo", "1.0", {"echo": ECHO_GENERATOR})
    reg = build_registry()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "plugin 'broken' (fake-broken 2.0) failed to load" in err[0]
    assert "definitely_not_a_module_xyz" in err[0]
    assert reg.plugins["broken"].status == "broken"
    assert "echo" in reg.backends("generator") and "hf" in reg.backends("generator")


def test_strict_mode_makes_a_broken_plugin_an_error(site, monkeypatch):
    make_dist(site, "fake-broken", "2.0", {"broken": BROKEN})
    monkeypatch.setenv("FORGE_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match="fake-broken 2.0"):
        build_registry()


def test_misspelled_hook_is_reported_not_ignored(site, capsys):
    make_dist(site, "fake-typo", "1.0", {"typo": TYPO_HOOK})
    reg = build_registry()
    assert "forge_generatorz" in capsys.readouterr().err
    assert reg.plugins["typo"].status == "broken"
    with pytest.raises(PluginError, match="forge_generatorz"):
        build_registry(strict=True)


def test_blocked_plugins(site, monkeypatch):
    make_dist(site, "fake-plugin", "1.0", {"echo": ECHO_GENERATOR})
    monkeypatch.setenv("FORGE_DISABLE_PLUGINS", "echo, vllm")
    reg = build_registry()
    assert reg.plugins["echo"].status == "blocked"
    assert reg.plugins["vllm"].status == "blocked"
    assert "echo" not in reg.backends("generator") and "vllm" not in reg.backends("generator")
    assert "hf" in reg.backends("generator")


def test_blocking_a_broken_plugin_silences_it(site, monkeypatch, capsys):
    make_dist(site, "fake-broken", "2.0", {"broken": BROKEN})
    monkeypatch.setenv("FORGE_DISABLE_PLUGINS", "broken")
    build_registry()
    assert capsys.readouterr().err == ""


def test_unknown_backend_lists_installed_ones():
    reg = build_registry()
    with pytest.raises(UnknownBackend) as err:
        reg.get("generator", "nope")
    assert str(err.value) == (
        "no generator 'nope'; installed: hf, sglang, vllm. See `forge plugins list`."
    )


def test_unavailable_backend_says_why():
    reg = build_registry()
    assert reg.get("trainer", "torchtitan").unavailable_reason() == "not implemented yet"
    with pytest.raises(BackendUnavailable, match="torchtitan.*not implemented yet"):
        reg.require("trainer", "torchtitan")


def test_missing_extra_names_the_extra(site):
    make_dist(
        site,
        "fake-needs",
        "1.0",
        {
            "needs": """
from forgerl.backends import TransportBackend
from forgerl.hookspecs import hookimpl

@hookimpl
def forge_transports():
    return [TransportBackend(name="warp", factory=None, requires=("no_such_module_q",),
                             extra="warp", extra_of="fake-needs")]
"""
        },
    )
    reg = build_registry()
    reason = reg.get("transport", "warp").unavailable_reason()
    assert reason == "needs no_such_module_q: pip install 'fake-needs[warp]'"
    assert "warp" not in reg.available("transport")


def test_trace_prints_hook_calls(site, capsys):
    build_registry(trace=True)
    err = capsys.readouterr().err
    assert "forge_generators" in err and "forge_schedulers" in err


def test_embedded_plugin_object():
    from forgerl.backends import TaskBackend
    from forgerl.hookspecs import hookimpl

    class Mine:
        forge_plugin_name = "mine"

        @hookimpl
        def forge_tasks(self):
            return [TaskBackend(name="mytask", factory=None)]

    reg = build_registry(plugins=[Mine()])
    assert reg.owner("task", "mytask").name == "mine"


def test_a_hook_returning_the_wrong_record_type_is_an_error():
    from forgerl.backends import TaskBackend
    from forgerl.hookspecs import hookimpl

    class Wrong:
        forge_plugin_name = "wrong"

        @hookimpl
        def forge_generators(self):
            return [TaskBackend(name="x", factory=None)]

    with pytest.raises(PluginError, match="expected GeneratorBackend"):
        build_registry(plugins=[Wrong()])
