"""A plugin written against an earlier forgerl, run against this one.

``forgerl-files`` 0.1.0 (tests/helpers/old_plugins/forgerl_files) is a third-party transport
written from the docs of 2026-12-06: it reads the run's transport timeout from
``context.config``, which the plugin API replaced by the run's facts. Installed as pip
would install it (a dist-info with its entry point), it passes the transport kit and runs
a real training run, warning in one line that names the plugin, what it used and what
replaces it; where the old name cannot work (a context without a run config) it is refused
in one line instead of failing deep in a trainer rank with an AttributeError.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from forgerl.deprecation import ForgeDeprecationWarning
from forgerl.errors import PluginAPIError

from ..helpers.old_plugins import install
from ..helpers.timing import scaled

LABEL = "plugin 'files' (forgerl-files 0.1.0)"


@pytest.fixture
def old_site(site: Path):
    """forgerl-files 0.1.0 installed in the test's site folder (on sys.path)."""
    from forgerl.testing import registry

    install("forgerl_files", site)
    registry._registry.cache_clear()  # the kits' registry must see this site's plugin
    yield site
    registry._registry.cache_clear()
    for name in [m for m in sys.modules if m.split(".")[0] == "forgerl_files"]:
        del sys.modules[name]


def run_context(tmp_path: Path, **config):
    from forgerl.configuration.config import RunConfig
    from forgerl.interfaces import RunContext

    return RunContext.for_run(RunConfig.model_validate(config), tmp_path)


def test_the_old_transport_builds_in_a_run_and_warns_naming_the_replacement(old_site: Path, tmp_path: Path):
    """Built in a run (a context from RunContext.for_run), the old transport reads the run's
    config as it did, and the warning names the plugin, the module, the old name and the
    fact that replaces it; the value it reads is the run's."""
    from forgerl.registry.plugins import build_registry

    registry = build_registry(strict=True)
    assert registry.owner("transport", "files").label == LABEL
    context = run_context(tmp_path, transport={"name": "files", "timeout": 7})
    with pytest.warns(ForgeDeprecationWarning) as caught:
        transport = registry.require("transport", "files").build({}, context=context)
    try:
        [warning] = [w for w in caught if issubclass(w.category, ForgeDeprecationWarning)]
        message = str(warning.message)
        assert message.startswith(f"{LABEL} uses RunContext.config (in forgerl_files.transport)"), message
        assert "context.transport_timeout" in message and "CHANGELOG.md" in message, message
        assert "\n" not in message
        assert Path(warning.filename).name == "transport.py"  # points at the plugin's line
        assert transport.timeout == 7.0
    finally:
        transport.close()


def test_the_old_transport_still_passes_the_transport_kit(old_site: Path, tmp_path: Path):
    """The kit's in-process case, as the plugin's own conformance test runs it (the kit
    builds outside a run, context=None): the old plugin passes, with no warning."""
    from forgerl.testing import TransportCase, TransportContract

    directory = tmp_path / "weights"
    directory.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ForgeDeprecationWarning)
        TransportContract().test_nothing_blocks_forever(
            TransportCase("files", {"directory": str(directory)}, confirms_delivery=False)
        )


def test_the_old_transport_in_a_context_without_a_run_config_is_refused_in_one_line(
    old_site: Path, tmp_path: Path
):
    """A context built by hand has no config to give: the plugin's read is refused with one
    line naming it, the old name and the replacement (exit status 2 at the command line),
    not an AttributeError with a traceback."""
    from forgerl.interfaces import RunContext
    from forgerl.registry.plugins import build_registry

    record = build_registry(strict=True).require("transport", "files")
    with pytest.raises(PluginAPIError) as refused:
        record.build({}, context=RunContext(run_dir=tmp_path))
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"{LABEL} uses RunContext.config (in forgerl_files.transport)"), message
    assert "RunContext.for_run" in message and "context.transport_timeout" in message, message
    assert refused.value.user_fixable
    # An AttributeError too: a plugin's getattr(context, "config", None) still falls back.
    assert getattr(RunContext(run_dir=tmp_path), "config", None) is None


def test_run_context_extras_is_refused_naming_the_transport_build_argument(tmp_path: Path):
    from forgerl.interfaces import RunContext

    with pytest.raises(PluginAPIError, match=r"uses RunContext\.extras .*build argument `transport`"):
        RunContext(run_dir=tmp_path).extras  # noqa: B018 - the read is the test
    with pytest.raises(AttributeError, match="no attribute 'no_such_fact'"):
        RunContext(run_dir=tmp_path).no_such_fact  # noqa: B018


def test_the_contract_protocols_of_earlier_plugins_still_import_with_a_warning():
    """`from forgerl.contract import TransportFactory` (the per-kind Protocols, gone from
    the contract) imports again, a Protocol usable in annotations, and warns naming the
    replacement."""
    import forgerl.contract

    with pytest.warns(ForgeDeprecationWarning, match=r"uses forgerl\.contract\.TransportFactory .*CONTRACT"):
        from forgerl.contract import TransportFactory
    assert TransportFactory.__name__ == "TransportFactory"
    assert getattr(TransportFactory, "_is_protocol", False)
    with pytest.raises(AttributeError):
        forgerl.contract.NoSuchName  # noqa: B018 - the read is the test


def test_a_runs_processes_copy_deprecation_warnings_into_its_events(tmp_path: Path, monkeypatch):
    """What makes `forge run` print a warning raised in a trainer rank: the rank copies each
    deprecation warning it shows into the run's events (once, however often it is set up),
    and nothing else."""
    from forgerl import events

    shown: list[str] = []  # what the process shows as before (the rank's log)
    monkeypatch.setattr(warnings, "showwarning", lambda message, *where: shown.append(str(message)))
    events.forward_warnings(ForgeDeprecationWarning, run_dir=tmp_path)
    events.forward_warnings(ForgeDeprecationWarning, run_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("plugin 'x' (x 1.0) uses RunContext.config", ForgeDeprecationWarning, stacklevel=1)
        warnings.warn("not a deprecation", UserWarning, stacklevel=1)
    rows = [json.loads(line) for line in (tmp_path / events.EVENTS_FILE).read_text().splitlines()]
    assert [(r["message"], r["state"]) for r in rows] == [("plugin 'x' (x 1.0) uses RunContext.config", "warning")]
    assert shown == ["plugin 'x' (x 1.0) uses RunContext.config", "not a deprecation"]


@pytest.mark.integration
def test_a_run_with_the_old_transport_completes_and_says_what_to_change(tmp_path: Path):
    """The 2026-12-06 plugin in a real run (the hf generator receives every version through
    it, in the trainer's process): the run completes, and `forge run` itself prints the
    deprecation line (it happens in trainer rank 0, whose stderr goes to a log file)."""
    site = install("forgerl_files", tmp_path / "site")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *sys.path])}
    for var in ("FORGE_DISABLE_PLUGINS", "FORGE_STRICT_PLUGINS", "FORGE_PLUGINS"):
        env.pop(var, None)
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "forgerl.cli", "run", "--model", "tiny", "--generator", "hf", "--transport", "files",
         "--reward", "format", "--set", "rewards.0.options.pattern=\\d", "--steps", "2",
         "--set", "loop.prompts_per_step=2", "--set", "loop.group_size=2", "--set", "loop.sampling.max_tokens=8",
         "--set", "loop.eval_size=2", "--set", "loop.eval_at_start=false", "--output", str(out)],
        capture_output=True, text=True, timeout=scaled(300), env=env, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "AttributeError" not in done.stderr
    said = [line for line in done.stderr.splitlines() if "RunContext.config" in line]
    assert len(said) == 1, done.stderr
    assert f"{LABEL} uses RunContext.config (in forgerl_files.transport)" in said[0]
    assert "context.transport_timeout" in said[0]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["status"], summary["policy_version"]) == ("completed", 2)
