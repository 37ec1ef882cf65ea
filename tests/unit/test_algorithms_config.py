"""AlgorithmConfig: presets, overrides, refusals, and the docs table."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from forgerl.algorithms import PRESET_KEYS, PRESETS, AlgorithmConfig
from tests.helpers.timing import scaled

DOCS = Path(__file__).resolve().parents[2] / "docs" / "algorithms.md"

# The documented settings, written out by hand (not derived from PRESETS) so that a
# change to a preset has to be made, and reviewed, in two places.
EXPECTED = {
    "grpo": dict(std_normalize="group", filter_zero_variance=False, clip_low=0.2, clip_high=0.2,
                 sequence_level_ratio=False, kl_coef=0.0, kl_estimator="k3", loss_agg="seq_mean_token_mean",
                 overlong="none", overlong_buffer=0, overlong_penalty=1.0),
    "dr_grpo": dict(std_normalize="none", filter_zero_variance=False, clip_low=0.2, clip_high=0.2,
                    sequence_level_ratio=False, kl_coef=0.0, kl_estimator="k3", loss_agg="constant_norm",
                    overlong="none", overlong_buffer=0, overlong_penalty=1.0),
    "dapo": dict(std_normalize="group", filter_zero_variance=True, clip_low=0.2, clip_high=0.28,
                 sequence_level_ratio=False, kl_coef=0.0, kl_estimator="k3", loss_agg="token_mean",
                 overlong="soft_penalty", overlong_buffer=4096, overlong_penalty=1.0),
    "gspo": dict(std_normalize="group", filter_zero_variance=False, clip_low=3e-4, clip_high=4e-4,
                 sequence_level_ratio=True, kl_coef=0.0, kl_estimator="k3", loss_agg="seq_mean_token_mean",
                 overlong="none", overlong_buffer=0, overlong_penalty=1.0),
}
NEEDS = {"dr_grpo": {"loss_norm_constant": 1024}}  # constant_norm needs its constant

# For each preset key, a valid value that differs from every preset's value.
OTHER = dict(std_normalize="batch", filter_zero_variance=None, clip_low=0.1, clip_high=0.5,
             sequence_level_ratio=None, kl_coef=0.01, kl_estimator="k1", loss_agg="seq_mean_token_sum",
             overlong="mask", overlong_buffer=128, overlong_penalty=0.5)


def make(**kw) -> AlgorithmConfig:
    return AlgorithmConfig(**{**NEEDS.get(kw.get("preset", "grpo"), {}), **kw})


@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_preset_gives_documented_settings(preset):
    cfg = make(preset=preset)
    assert {k: getattr(cfg, k) for k in EXPECTED[preset]} == EXPECTED[preset]
    # System keys are never touched by a preset.
    assert (cfg.std_eps, cfg.dual_clip, cfg.ratio, cfg.tis_cap) == (1e-6, None, "auto", None)


def test_presets_cover_exactly_the_preset_keys():
    assert set(PRESETS) == set(EXPECTED)
    for name, values in PRESETS.items():
        assert set(values) == set(PRESET_KEYS), name
    # Field defaults are the grpo preset, so AlgorithmConfig() and preset=grpo agree.
    fields = AlgorithmConfig.model_fields
    assert {k: fields[k].default for k in PRESET_KEYS} == EXPECTED["grpo"]
    assert AlgorithmConfig() == AlgorithmConfig(preset="grpo")


@pytest.mark.parametrize("preset", sorted(EXPECTED))
@pytest.mark.parametrize("key", PRESET_KEYS)
def test_explicit_key_wins_over_preset(preset, key):
    value = OTHER[key]
    if value is None:  # booleans: flip
        value = not EXPECTED[preset][key]
    cfg = make(preset=preset, **{key: value})
    assert getattr(cfg, key) == value
    for other in PRESET_KEYS:
        if other != key:
            assert getattr(cfg, other) == EXPECTED[preset][other], other
    assert cfg.explicit_overrides() == {key: value}


def test_explicit_value_equal_to_grpo_default_still_wins():
    # 0.2 is the field default; written explicitly it must beat dapo's 0.28.
    assert AlgorithmConfig(preset="dapo", clip_high=0.2).clip_high == 0.2
    assert AlgorithmConfig(preset="dapo", loss_agg="seq_mean_token_mean").loss_agg == "seq_mean_token_mean"
    assert AlgorithmConfig(preset="dapo", clip_high=0.3).clip_high == 0.3
    assert AlgorithmConfig.model_validate({"preset": "gspo", "clip_low": 0.001}).clip_low == 0.001


def test_dict_and_json_round_trip():
    cfg = AlgorithmConfig.model_validate({"preset": "dapo", "clip_high": 0.3, "kl_coef": 0.04})
    assert AlgorithmConfig.model_validate(cfg.model_dump()) == cfg
    assert AlgorithmConfig.model_validate_json(cfg.model_dump_json()) == cfg


@pytest.mark.parametrize("bad", [{"clip_hgh": 0.3}, {"beta": 0.04}, {"preset": "dapo", "unknown": 1}])
def test_unknown_keys_refused(bad):
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        AlgorithmConfig(**bad)


@pytest.mark.parametrize(
    "bad",
    [
        {"preset": "ppo"},
        {"clip_low": -0.01}, {"clip_low": 1.0},
        {"clip_high": -0.01}, {"clip_high": 11.0},
        {"dual_clip": 1.0}, {"dual_clip": 0.5},
        {"ratio": "old", "tis_cap": 0.5},
        {"kl_coef": -0.001},
        {"kl_estimator": "k4"},
        {"std_eps": 0.0}, {"std_eps": 2.0},
        {"std_normalize": "global"},
        {"loss_agg": "sum"},
        {"loss_agg": "constant_norm", "loss_norm_constant": 0},
        {"overlong": "drop"}, {"overlong_buffer": -1}, {"overlong_penalty": -1.0},
        {"ratio": "sampler"},
    ],
)
def test_out_of_range_values_refused(bad):
    with pytest.raises(ValidationError):
        AlgorithmConfig(**bad)


def test_constant_norm_needs_its_constant():
    with pytest.raises(ValidationError, match="loss_norm_constant"):
        AlgorithmConfig(loss_agg="constant_norm")
    with pytest.raises(ValidationError, match="loss_norm_constant"):
        AlgorithmConfig(preset="dr_grpo")
    assert AlgorithmConfig(preset="dr_grpo", loss_norm_constant=512).loss_norm_constant == 512


def test_the_auto_ratio_follows_the_trainers_precision():
    # bf16 autocast puts the trainer's logprobs a few percent from an fp32 sampler's: the
    # ratio is then taken against the trainer's own, or the clip would fire on rounding.
    assert AlgorithmConfig().effective_ratio(trainer_bf16=True) == "old"
    assert AlgorithmConfig().effective_ratio(trainer_bf16=False) == "behaviour"
    assert AlgorithmConfig().effective_ratio() == "behaviour"  # policy_loss called directly
    for explicit in ("old", "behaviour"):
        for bf16 in (True, False):
            assert AlgorithmConfig(ratio=explicit).effective_ratio(trainer_bf16=bf16) == explicit


def test_tis_needs_old_ratio():
    with pytest.raises(ValidationError, match="ratio='old'"):
        AlgorithmConfig(tis_cap=2.0)
    assert AlgorithmConfig(ratio="old", tis_cap=2.0).tis_cap == 2.0


def test_frozen():
    cfg = AlgorithmConfig()
    with pytest.raises(ValidationError):
        cfg.clip_high = 0.3  # type: ignore[misc]


def _parse_cell(cell: str):
    v = cell.strip().strip("`")
    if v in ("true", "false"):
        return v == "true"
    try:
        return int(v)
    except ValueError:
        pass
    try:
        return float(v)
    except ValueError:
        return v


def test_docs_presets_table_matches_code():
    text = DOCS.read_text()
    after = text.split("<!-- presets-table", 1)[1].split("\n", 1)[1]
    lines = [ln for ln in after.splitlines()]
    table = []
    for ln in lines:
        if not ln.startswith("|"):
            break
        table.append([c.strip() for c in ln.strip("|").split("|")])
    header, rows = table[0], table[2:]
    presets = [h.strip("`") for h in header[1:]]
    assert set(presets) == set(PRESETS)
    documented = {r[0].strip("`"): r[1:] for r in rows}
    assert set(documented) == set(PRESET_KEYS)
    for key, cells in documented.items():
        for preset, cell in zip(presets, cells):
            assert _parse_cell(cell) == PRESETS[preset][key], (key, preset, cell)


def test_config_imports_without_torch():
    # Configs are validated where torch may be absent: the algorithms package must
    # import torch only when a torch function is used.
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from forgerl.algorithms import AlgorithmConfig\n"
        "print(AlgorithmConfig(preset='gspo').clip_low)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env,
                         timeout=scaled(60))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0.0003"


def test_lazy_exports_resolve():
    import forgerl.algorithms as alg

    for name in alg.__all__:
        assert getattr(alg, name) is not None, name
    with pytest.raises(AttributeError):
        alg.no_such_function  # noqa: B018
    assert re.search(r"policy_loss", " ".join(dir(alg)))
