"""Plugin discovery, registration and failure modes, through real entry points."""

from __future__ import annotations

import importlib.util
from importlib import metadata

import pytest

from forgerl.errors import BackendUnavailable, DuplicateBackend, PluginError, UnknownBackend
from forgerl.registry.plugins import build_registry

from .fakedist import (
    BROKEN,
    CLASHING_REWARD,
    DUPLICATE_HF,
    ECHO_GENERATOR,
    LAZY_BROKEN_IMPL,
    LAZY_IMPL_MODULE,
    RAISING_REGISTRATION,
    STEP_END_TYPO,
    TYPO_HOOK,
    WRONG_RECORD,
    make_dist,
)

#: The installed forgerl, as messages name its built-in plugins ("forgerl 0.3.0").
FORGERL = f"forgerl {metadata.version('forgerl')}"


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
    reg = build_registry()  # a clash does not break everything else
    with pytest.raises(DuplicateBackend) as err:
        reg.get("generator", "hf")
    msg = str(err.value)
    assert "'hf'" in msg and FORGERL in msg and "fake-dup 0.9" in msg
    assert err.value.user_fixable


def test_a_clash_with_a_built_in_backend_suggests_disabling_the_newcomer(site, capsys):
    # "aaa" sorts (and registers) before forgerl's `rewards` plugin: the fix must still
    # disable the third-party plugin, never the built-in one with every other reward.
    make_dist(site, "fake-clash", "2.0", {"aaa": CLASHING_REWARD})
    reg = build_registry()
    assert capsys.readouterr().err == ""  # reported where the name is used, not on every command
    with pytest.raises(DuplicateBackend) as err:
        reg.require("reward", "math_answer")
    msg = str(err.value)
    assert f"plugin 'rewards' ({FORGERL})" in msg and "plugin 'aaa' (fake-clash 2.0)" in msg
    assert "FORGE_DISABLE_PLUGINS=aaa" in msg and "FORGE_DISABLE_PLUGINS=rewards" not in msg
    assert "math_answer" not in reg.available("reward")
    # Everything else of both plugins still works.
    assert reg.require("reward", "format").name == "format"
    assert reg.require("task", "own_task").provider == "plugin 'aaa' (fake-clash 2.0)"
    assert {p.name for p in reg.clash("reward", "math_answer").providers} == {"aaa", "rewards"}
    # Following the advice resolves it.
    fixed = build_registry(disabled=["aaa"])
    assert fixed.require("reward", "math_answer").provider == f"plugin 'rewards' ({FORGERL})"


def test_a_clash_between_two_third_party_plugins_offers_either(site):
    make_dist(site, "fake-one", "1.0", {"one": ECHO_GENERATOR})
    make_dist(site, "fake-two", "1.0", {"two": ECHO_GENERATOR})
    reg = build_registry()
    with pytest.raises(DuplicateBackend) as err:
        reg.get("generator", "echo")
    assert "FORGE_DISABLE_PLUGINS=one or FORGE_DISABLE_PLUGINS=two" in str(err.value)
    assert "hf" in reg.available("generator")


def test_strict_mode_makes_a_clash_an_error(site):
    make_dist(site, "fake-clash", "2.0", {"aaa": CLASHING_REWARD})
    with pytest.raises(DuplicateBackend, match="FORGE_DISABLE_PLUGINS=aaa"):
        build_registry(strict=True)


def test_a_plugin_named_like_a_built_in_one_is_skipped(site, capsys):
    make_dist(site, "fake-samename", "1.0", {"rewards": ECHO_GENERATOR})
    reg = build_registry()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fake-samename 1.0" in err[0] and FORGERL in err[0], err
    assert reg.owner("reward", "math_answer").distribution == "forgerl"
    assert "echo" not in reg.backends("generator")
    shadowed = [i for i in reg.plugins.values() if i.distribution == "fake-samename"]
    assert [(i.name, i.status) for i in shadowed] == [("rewards", "broken")]


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
    with pytest.raises(PluginError, match="fake-broken 2.0") as err:
        build_registry()
    assert err.value.user_fixable  # one line and exit 2 in the CLI, like any user error


def test_misspelled_hook_is_reported_not_ignored(site, capsys):
    make_dist(site, "fake-typo", "1.0", {"typo": TYPO_HOOK})
    reg = build_registry()
    err = capsys.readouterr().err
    assert "forge_generatorz (did you mean forge_generators?)" in err, err
    assert reg.plugins["typo"].status == "broken"
    with pytest.raises(PluginError, match="forge_generatorz"):
        build_registry(strict=True)


def test_misspelled_event_hook_suggests_the_real_one(site, capsys):
    make_dist(site, "fake-steps", "1.0", {"steps": STEP_END_TYPO})
    reg = build_registry()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "plugin 'steps' (fake-steps 1.0) implements an unknown hook forge_step_ends" in err[0]
    assert "did you mean forge_step_end?" in err[0]
    assert reg.plugins["steps"].error and "did you mean forge_step_end?" in reg.plugins["steps"].error


def test_unknown_hook_without_a_close_name_lists_the_hooks():
    from forgerl.hookspecs import hookimpl

    class Odd:
        forge_plugin_name = "odd"

        @hookimpl
        def forge_zzzzzzzz_qqq(self):
            pass

    with pytest.raises(PluginError) as err:
        build_registry(plugins=[Odd()])  # passed in explicitly: an error, not a warning
    assert "did you mean" not in str(err.value)
    assert "the hooks are: forge_commands," in str(err.value) and "forge_step_end" in str(err.value)


def test_a_registration_hook_that_raises_drops_that_plugin_only(site, capsys):
    make_dist(site, "fake-raising", "1.0", {"raising": RAISING_REGISTRATION})
    reg = build_registry()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "plugin 'raising' (fake-raising 1.0) failed in forge_generators" in err[0], err
    assert "cannot find my config" in err[0]
    assert reg.plugins["raising"].status == "broken"
    assert "hf" in reg.available("generator")
    reg.hooks.run_end(summary={"status": "completed"}, run_dir=site)  # its forge_run_end is gone too
    with pytest.raises(PluginError, match="cannot find my config"):
        build_registry(strict=True)


def test_a_third_party_hook_returning_the_wrong_record_type_is_skipped(site, capsys):
    make_dist(site, "fake-wrong", "1.0", {"wrong": WRONG_RECORD})
    reg = build_registry()
    err = capsys.readouterr().err
    assert "plugin 'wrong' (fake-wrong 1.0) registers something wrong" in err
    assert "expected GeneratorBackend" in err
    assert "x" not in reg.backends("task")


def test_blocked_plugins(site, monkeypatch, capsys):
    make_dist(site, "fake-plugin", "1.0", {"echo": ECHO_GENERATOR})
    monkeypatch.setenv("FORGE_DISABLE_PLUGINS", "echo, vllm")
    reg = build_registry()
    assert capsys.readouterr().err == ""
    assert reg.plugins["echo"].status == "blocked"
    assert reg.plugins["vllm"].status == "blocked"
    assert "echo" not in reg.backends("generator") and "vllm" not in reg.backends("generator")
    assert "hf" in reg.backends("generator")


def test_disabled_names_that_match_no_plugin_are_a_warning(site, monkeypatch, capsys):
    make_dist(site, "fake-plugin", "1.0", {"echo": ECHO_GENERATOR})
    monkeypatch.setenv("FORGE_DISABLE_PLUGINS", "echo,vlm,math_answer,nothing_like_it")
    reg = build_registry()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    line = err[0]
    assert line.startswith("forge: warning: FORGE_DISABLE_PLUGINS names no installed plugin: ")
    assert "'vlm' (did you mean 'vllm'?)" in line
    assert f"'math_answer' (a backend of plugin 'rewards' ({FORGERL}))" in line
    assert "'nothing_like_it'" in line and "'echo'" not in line.split(";")[0]
    assert "the plugins are: " in line and "echo" in line.split("the plugins are: ")[1]
    assert reg.plugins["echo"].status == "blocked"


def test_blocking_a_broken_plugin_silences_it(site, monkeypatch, capsys):
    make_dist(site, "fake-broken", "2.0", {"broken": BROKEN})
    monkeypatch.setenv("FORGE_DISABLE_PLUGINS", "broken")
    build_registry()
    assert capsys.readouterr().err == ""


def test_unknown_backend_lists_installed_ones():
    reg = build_registry()
    with pytest.raises(UnknownBackend) as err:
        reg.get("generator", "nope")
    # Other generators may be installed too (the contrib example's, once a test has
    # pip-installed it): the built-ins are listed, sorted, in one line.
    message = str(err.value)
    head, sep, tail = message.partition("; installed: ")
    assert head == "no generator 'nope'" and sep, message
    names, sep, rest = tail.partition(". ")
    assert rest == "See `forge plugins list`." and sep, message
    listed = names.split(", ")
    assert {"hf", "sglang", "vllm"} <= set(listed) and listed == sorted(listed), message


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed here")
def test_unavailable_backend_says_why_and_how_to_install_it():
    reg = build_registry()
    why = reg.get("generator", "sglang").unavailable_reason()
    assert why == "needs sglang: pip install 'forgerl[sglang]' (SGLang 0.5.23; CUDA GPUs only)"
    with pytest.raises(BackendUnavailable, match=r"sglang.*pip install 'forgerl\[sglang\]'"):
        reg.require("generator", "sglang")


def test_an_unimplemented_backend_says_so():
    from forgerl.backends import GeneratorBackend

    record = GeneratorBackend(name="later", factory=None, implemented=False)
    assert record.unavailable_reason() == "not implemented yet"


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


def test_a_backend_whose_module_fails_to_import_names_plugin_and_backend(site):
    from forgerl.errors import BackendLoadError

    make_dist(site, "fake-lazy", "1.0", {"lazy": LAZY_BROKEN_IMPL})
    (site / "fake_lazy_impl.py").write_text(LAZY_IMPL_MODULE)
    reg = build_registry()  # registration imports nothing of the implementation
    backend = reg.require("generator", "lazy")
    with pytest.raises(BackendLoadError) as err:
        backend.build({}, context=None, transport=None)
    msg = str(err.value)
    assert err.value.user_fixable and "\n" not in msg
    assert msg.startswith("generator 'lazy' of plugin 'lazy' (fake-lazy 1.0) cannot be loaded: ")
    assert "'fake_lazy_impl:LazyGenerator'" in msg and "No module named 'no_such_dependency_q'" in msg
    assert msg.index("no_such_dependency_q") < msg.index("fake_lazy_impl:")  # the cause first
    assert f"{site / 'fake_lazy_impl.py'}:3" in msg  # the line the plugin's author must look at
    with pytest.raises(BackendLoadError, match="generator 'lazy_opts' of plugin 'lazy'.*options model"):
        reg.get("generator", "lazy_opts").validate_options({})


def test_config_schema_leaves_out_a_third_party_options_model_that_fails_to_import(site, capsys):
    from forgerl.registry.configdoc import json_schema, render_markdown

    make_dist(site, "fake-lazy", "1.0", {"lazy": LAZY_BROKEN_IMPL})
    (site / "fake_lazy_impl.py").write_text(LAZY_IMPL_MODULE)
    make_dist(site, "fake-plugin", "1.2.3", {"echo": ECHO_GENERATOR})
    reg = build_registry()
    schema = json_schema(reg)
    markdown = render_markdown(reg)
    warnings = capsys.readouterr().err.strip().splitlines()
    assert len(warnings) == 2 and all("'lazy_opts' of plugin 'lazy' (fake-lazy 1.0)" in w for w in warnings)
    assert "EchoOptions" in schema["$defs"] and "### generator `echo` (fake-plugin 1.2.3)" in markdown


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
