"""``LoraOptions``: which modules an adapter targets, its scale, and the PEFT config it
is exported with."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from forgerl.adapters import LoraOptions


def test_patterns_match_a_modules_last_name_or_its_full_name() -> None:
    lora = LoraOptions(target_modules=["q_proj", "model.layers.1.mlp.*_proj"])
    assert lora.targets("model.layers.0.self_attn.q_proj")
    assert lora.targets("model.layers.1.mlp.up_proj")
    assert not lora.targets("model.layers.0.mlp.up_proj"), "the full-name pattern names layer 1 only"
    assert not lora.targets("model.layers.0.self_attn.q_proj_extra")
    assert LoraOptions().targets("model.layers.3.mlp.down_proj"), "the default targets every block projection"
    assert not LoraOptions().targets("lm_head")


def test_scale_and_peft_config() -> None:
    assert LoraOptions(rank=16).scale == 1.0
    lora = LoraOptions(rank=8, alpha=32)
    assert lora.scale == 4.0
    config = lora.peft_config(["b.v_proj", "a.q_proj"])
    assert (config["r"], config["lora_alpha"], config["bias"]) == (8, 32, "none")
    assert config["target_modules"] == ["a.q_proj", "b.v_proj"]


@pytest.mark.parametrize(
    "bad", [{"rank": 0}, {"rank": 513}, {"alpha": 0}, {"dropout": 1.0}, {"target_modules": []},
            {"target_modules": [" "]}, {"rank": True}, {"bogus": 1}],
)
def test_bad_options_are_refused(bad: dict) -> None:
    with pytest.raises(ValidationError):
        LoraOptions(**bad)


# ----------------------------------------------------------- where the adapter leads


def _config(*sets: str, generator: str = "vllm"):
    from forgerl.configuration.config import build_config
    from forgerl.registry.plugins import build_registry
    from forgerl.registry.resolve import resolve

    registry = build_registry()
    return resolve(build_config(flags={"generator": generator}, sets=sets), registry), registry


def test_the_run_context_carries_the_trainers_adapter(tmp_path) -> None:
    from forgerl.interfaces import RunContext

    config, _ = _config("trainer.options.lora.rank=16")
    adapter = RunContext.for_run(config, tmp_path).adapter
    assert adapter is not None and adapter.rank == 16
    assert RunContext.for_run(_config()[0], tmp_path).adapter is None, "full fine-tuning: no adapter"


@pytest.mark.parametrize("generator", ["vllm", "hf"])
def test_a_lora_trainer_needs_a_generator_that_serves_adapters(monkeypatch, generator: str) -> None:
    from forgerl.errors import ConfigError
    from forgerl.runloop.preflight import check_adapter_served

    config, registry = _config("trainer.options.lora.rank=8", generator=generator)
    check_adapter_served(config, registry)  # it does
    check_adapter_served(_config(generator=generator)[0], registry)  # full fine-tuning: any generator
    # One that does not say it does (a third-party generator, by default) is refused.
    factory = registry.require("generator", generator).load_factory()
    monkeypatch.setattr(factory, "serves_adapters", False)
    with pytest.raises(ConfigError, match=f"{generator} generator cannot serve"):
        check_adapter_served(config, registry)


@pytest.mark.parametrize("rank, served", [(1, "1"), (8, "8"), (9, "16"), (300, "320"), (512, "512")])
def test_vllm_starts_with_lora_on_for_the_adapters_rank(tmp_path, rank: int, served: str) -> None:
    from forgerl_plugins.generators.vllm import server
    from forgerl_plugins.generators.vllm.generator import VLLMGenerator

    options = VLLMGenerator.Options()
    text = " ".join(server.server_command(options, tmp_path, "float32", 1, LoraOptions(rank=rank)))
    assert f"--enable-lora --max-loras 1 --max-cpu-loras 1 --max-lora-rank {served}" in text
    assert "--enable-lora" not in server.server_command(options, tmp_path, "float32", 1)
    assert server.server_env(options, "key", LoraOptions())["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in server.server_env(options, "key")


def test_sglang_refuses_the_keep_update_policy_with_an_adapter(tmp_path) -> None:
    """Its version 0 is the base model: a request started there would go on without the
    adapter after the update (vllm serves an all-zero adapter at version 0 instead)."""
    from forgerl.errors import ConfigError
    from forgerl.interfaces import RunContext
    from forgerl_plugins.generators.sglang.generator import SGLangGenerator
    from forgerl_plugins.transports.shm.transport import ShmTransport

    config, _ = _config("trainer.options.lora.rank=8", generator="sglang")
    transport = ShmTransport(ShmTransport.Options(directory=str(tmp_path / "weights")), context=None)
    with pytest.raises(ConfigError, match="keep does not work with a LoRA adapter"):
        SGLangGenerator(
            SGLangGenerator.Options(update_policy="keep"), context=RunContext.for_run(config, tmp_path), transport=transport
        )
