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
