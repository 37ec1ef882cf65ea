"""Which Hugging Face configs the torchtitan trainer can express, decided from config.json
alone (no torch, no TorchTitan): anything else is refused with one line naming it."""

from __future__ import annotations

import json

import pytest

from forgerl_plugins.trainers.torchtitan.models import (
    UnsupportedModel,
    model_spec,
    rope_parameters,
    unsupported_reason,
)

LLAMA = {
    "model_type": "llama", "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 512,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
}


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_the_supported_families_are_accepted(model_type):
    assert unsupported_reason({**LLAMA, "model_type": model_type}) is None


def test_llama3_rope_scaling_is_accepted_in_either_config_layout():
    scaled = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    assert unsupported_reason({**LLAMA, "rope_parameters": scaled}) is None
    # transformers 4: rope_theta beside rope_scaling, whose kind is "type" in older files.
    old = {**LLAMA, "rope_parameters": None, "rope_theta": 500000.0, "rope_scaling": {"type": "llama3", "factor": 8.0}}
    assert unsupported_reason(old) is None
    assert rope_parameters(old)["rope_theta"] == 500000.0 and rope_parameters(old)["rope_type"] == "llama3"
    assert rope_parameters({})["rope_type"] == "default" and rope_parameters({})["rope_theta"] == 10000.0


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"model_type": "gemma2"}, "model_type 'gemma2'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"num_attention_heads": 3, "num_key_value_heads": 2}, "3 attention heads over 2 key/value heads"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling 'yarn'"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"model_type": "qwen2", "use_sliding_window": True}, "sliding-window"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "sliding-window"),
        ({"model_type": "qwen3", "num_experts": 8}, "mixture-of-experts"),
        ({"hidden_size": None}, "hidden_size None"),
    ],
)
def test_what_it_cannot_express_is_named(change, named):
    reason = unsupported_reason({**LLAMA, **change})
    assert reason is not None and named in reason, reason


def test_refusal_is_one_user_fixable_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "hidden_act": "relu"}))
    with pytest.raises(UnsupportedModel) as err:
        model_spec(tmp_path)
    assert err.value.user_fixable and "\n" not in str(err.value)
    assert str(err.value) == (
        f"the torchtitan trainer cannot express the model in {tmp_path}: hidden_act 'relu' (SwiGLU feed-forward needs silu)"
    )


def test_a_torch_it_was_not_released_for_is_one_line_naming_both_versions():
    pytest.importorskip("torch")
    from forgerl_plugins.trainers.torchtitan.trainer import torch_mismatch

    # What TorchTitan 0.3.0 raised on a GPU machine with torch 2.11.
    error = ImportError("cannot import name 'DataParallelMeshDims' from 'torch.distributed.fsdp'")
    line = torch_mismatch(error)
    assert "\n" not in line
    assert "DataParallelMeshDims" in line and "torch==2.13.0" in line
    import torch

    assert f"torch {torch.__version__}" in line
