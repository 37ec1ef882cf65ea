"""The ``algorithm`` block of the run config: which GRPO variant, and every knob of it.

This module must import without torch (the CLI validates configs on machines that
have none), so it only uses pydantic.

Presets
-------
``preset`` names a published variant. A preset fills in *defaults* for the keys in
:data:`PRESET_KEYS`; any key the user writes explicitly wins over the preset, so
``AlgorithmConfig(preset="dapo", clip_high=0.3)`` is DAPO with a wider upper clip.
Keys outside :data:`PRESET_KEYS` (``std_eps``, ``dual_clip``, ``ratio``, ``tis_cap``,
``loss_norm_constant``) describe the system, not the algorithm, and no preset touches
them. The formulas behind every key are in ``docs/algorithms.md``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from forgerl.options import OptionsModel

PresetName = Literal["grpo", "dr_grpo", "dapo", "gspo"]

#: Every preset sets exactly these keys, so switching presets never leaves a knob of
#: the previous variant behind.
PRESET_KEYS: tuple[str, ...] = (
    "std_normalize",
    "filter_zero_variance",
    "clip_low",
    "clip_high",
    "sequence_level_ratio",
    "kl_coef",
    "kl_estimator",
    "loss_agg",
    "overlong",
    "overlong_buffer",
    "overlong_penalty",
)

#: The settings each preset stands for (see docs/algorithms.md for the papers). This table
#: is the only place a preset's values live: run configs read it too (see
#: :func:`fill_length_defaults`). An ``overlong_buffer`` of 0 means the preset has no
#: soft-overlong ramp of its own.
PRESETS: dict[str, dict[str, Any]] = {
    # DeepSeekMath (Shao et al., 2024): group mean/std advantages, PPO clip 0.2, per-
    # sequence token mean. The paper used a k3 KL penalty with beta = 0.04; we keep
    # kl_coef = 0 so that no reference model is loaded by default (set kl_coef: 0.04 to
    # reproduce the paper).
    "grpo": {
        "std_normalize": "group",
        "filter_zero_variance": False,
        "clip_low": 0.2,
        "clip_high": 0.2,
        "sequence_level_ratio": False,
        "kl_coef": 0.0,
        "kl_estimator": "k3",
        "loss_agg": "seq_mean_token_mean",
        "overlong": "none",
        "overlong_buffer": 0,
        "overlong_penalty": 1.0,
    },
    # Dr. GRPO (Liu et al., 2025, "Understanding R1-Zero-Like Training"): drop the std
    # division (question-difficulty bias) and the 1/|o_i| length normaliser (length
    # bias); sum tokens and divide by a constant (the max completion length), no KL.
    "dr_grpo": {
        "std_normalize": "none",
        "filter_zero_variance": False,
        "clip_low": 0.2,
        "clip_high": 0.2,
        "sequence_level_ratio": False,
        "kl_coef": 0.0,
        "kl_estimator": "k3",
        "loss_agg": "constant_norm",
        "overlong": "none",
        "overlong_buffer": 0,
        "overlong_penalty": 1.0,
    },
    # DAPO (Yu et al., 2025): clip-higher (0.2 / 0.28), dynamic sampling (drop groups
    # whose rewards are all equal), token-level loss, soft overlong punishment with a
    # 4096-token buffer, no KL.
    "dapo": {
        "std_normalize": "group",
        "filter_zero_variance": True,
        "clip_low": 0.2,
        "clip_high": 0.28,
        "sequence_level_ratio": False,
        "kl_coef": 0.0,
        "kl_estimator": "k3",
        "loss_agg": "token_mean",
        "overlong": "soft_penalty",
        "overlong_buffer": 4096,
        "overlong_penalty": 1.0,
    },
    # GSPO (Zheng et al., 2025): one length-normalised importance ratio per sequence,
    # clipped to the much narrower range [1 - 3e-4, 1 + 4e-4], no KL.
    "gspo": {
        "std_normalize": "group",
        "filter_zero_variance": False,
        "clip_low": 3e-4,
        "clip_high": 4e-4,
        "sequence_level_ratio": True,
        "kl_coef": 0.0,
        "kl_estimator": "k3",
        "loss_agg": "seq_mean_token_mean",
        "overlong": "none",
        "overlong_buffer": 0,
        "overlong_penalty": 1.0,
    },
}

_GRPO = PRESETS["grpo"]


def fill_length_defaults(algorithm: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """``algorithm`` (a block as the user wrote it) with the knobs measured in tokens
    filled in from the run's completion length where neither the user nor the preset
    gives a value: Dr. GRPO's constant normaliser (``loss_norm_constant``, the max
    completion length; no preset sets it) and the soft-overlong ramp (``overlong_buffer``,
    a quarter of it) when soft_penalty is on under a preset without a ramp of its own.
    What the user wrote wins, then the preset's value (DAPO's 4096), then the derived one.
    """
    name = algorithm.get("preset", "grpo")
    if not isinstance(name, str) or name not in PRESETS:
        return algorithm  # the Literal on `preset` reports the bad name
    preset = PRESETS[name]
    effective = {**preset, **algorithm}
    filled = dict(algorithm)
    if effective["loss_agg"] == "constant_norm":
        filled.setdefault("loss_norm_constant", max_tokens)
    if effective["overlong"] == "soft_penalty" and not preset["overlong_buffer"]:
        filled.setdefault("overlong_buffer", max(1, max_tokens // 4))
    return filled


class AlgorithmConfig(OptionsModel):
    """GRPO-family policy-gradient settings (the ``algorithm:`` block of a run config).

    Field defaults equal the ``grpo`` preset; a different ``preset`` replaces them for
    every key the user did not write. The model is frozen: build a new one (or use
    ``model_copy(update=...)``, which skips validation) rather than mutating.
    """

    # Floats finite and no booleans for numbers (OptionsModel): a NaN clip or an infinite
    # KL weight would poison every step.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    preset: PresetName = Field(
        "grpo",
        description="Published variant whose settings fill in every key not given explicitly.",
    )

    # ------------------------------------------------------------------ advantages
    std_normalize: Literal["group", "batch", "none"] = Field(
        _GRPO["std_normalize"],
        description=(
            "Divide the group-centred reward by the std of its group ('group', GRPO), "
            "of the whole batch ('batch', Lite PPO), or not at all ('none', Dr. GRPO)."
        ),
    )
    std_eps: float = Field(
        1e-6, gt=0.0, le=1.0,
        description="Added to the std before dividing, so zero-variance groups give 0, not NaN.",
    )
    filter_zero_variance: bool = Field(
        _GRPO["filter_zero_variance"],
        description="Drop groups whose rewards are all equal (DAPO dynamic sampling); they carry no signal.",
    )

    # ----------------------------------------------------------------- policy loss
    clip_low: float = Field(
        _GRPO["clip_low"], ge=0.0, lt=1.0,
        description="eps_low: the ratio is clipped below at 1 - clip_low.",
    )
    clip_high: float = Field(
        _GRPO["clip_high"], ge=0.0, le=10.0,
        description="eps_high: the ratio is clipped above at 1 + clip_high (DAPO clip-higher).",
    )
    dual_clip: float | None = Field(
        None, gt=1.0,
        description="Dual-clip constant c > 1: for negative advantages the objective is bounded below by c * A.",
    )
    ratio: Literal["auto", "behaviour", "old"] = Field(
        "auto",
        description=(
            "Denominator of the importance ratio: the sampler's logprobs returned by the "
            "generator ('behaviour', no extra forward pass), or the trainer's own logprobs "
            "before the update ('old'). 'auto': 'old' when the trainer computes in bf16 "
            "autocast (its logprobs then differ from an fp32 sampler's by a few percent per "
            "token, and the clip would fire on rounding, not on policy change), else 'behaviour'."
        ),
    )
    tis_cap: float | None = Field(
        None, ge=1.0,
        description=(
            "Truncated importance sampling: with ratio='old', weight each token by "
            "min(exp(old - behaviour), tis_cap) (detached) to correct the trainer/sampler mismatch."
        ),
    )
    sequence_level_ratio: bool = Field(
        _GRPO["sequence_level_ratio"],
        description="GSPO: one ratio per sequence, the geometric mean of its token ratios.",
    )

    # -------------------------------------------------------------------------- KL
    kl_coef: float = Field(
        _GRPO["kl_coef"], ge=0.0,
        description="Weight of the KL penalty to the reference model; 0 disables it and no reference model is loaded.",
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        _GRPO["kl_estimator"],
        description="Per-token KL estimator (Schulman, 'Approximating KL divergence').",
    )

    # ----------------------------------------------------------------- aggregation
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant_norm"] = Field(
        _GRPO["loss_agg"],
        description="How per-token losses become one scalar (see docs/algorithms.md).",
    )
    loss_norm_constant: int | None = Field(
        None, ge=1,
        description="Dr. GRPO's constant normaliser (e.g. the max completion length); required by loss_agg='constant_norm'.",
    )

    # -------------------------------------------------------------------- overlong
    overlong: Literal["none", "mask", "soft_penalty"] = Field(
        _GRPO["overlong"],
        description=(
            "Truncated completions: keep them ('none'), drop them from the loss ('mask', "
            "DAPO overlong filtering), or penalise length inside a buffer before the limit "
            "('soft_penalty', DAPO soft overlong punishment)."
        ),
    )
    overlong_buffer: int = Field(
        _GRPO["overlong_buffer"], ge=0,
        description="L_cache: length of the soft-penalty ramp that ends at the max completion length.",
    )
    overlong_penalty: float = Field(
        _GRPO["overlong_penalty"], ge=0.0,
        description="Size of the soft overlong penalty at (and beyond) the max completion length.",
    )

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        # Fill in the preset only for keys the user did not write: explicit wins.
        if not isinstance(data, dict):
            return data
        name = data.get("preset", "grpo")
        if not isinstance(name, str) or name not in PRESETS:
            return data  # the Literal on `preset` reports the bad name
        return {**PRESETS[name], **data}

    @model_validator(mode="after")
    def _check_consistency(self) -> AlgorithmConfig:
        if self.loss_agg == "constant_norm" and self.loss_norm_constant is None:
            raise ValueError(
                "loss_agg='constant_norm' (Dr. GRPO) needs loss_norm_constant, "
                "e.g. the max completion length (sampling max_tokens)"
            )
        if self.tis_cap is not None and self.ratio != "old":
            raise ValueError(
                "tis_cap corrects the ratio against recomputed old logprobs; it needs "
                "ratio='old' (with ratio='behaviour' the ratio already uses the sampler's logprobs)"
            )
        return self

    def effective_ratio(self, trainer_bf16: bool = False) -> Literal["behaviour", "old"]:
        """The ratio's denominator for a trainer that computes in bf16 autocast or not
        (``ratio='auto'``, see the field)."""
        if self.ratio == "auto":
            return "old" if trainer_bf16 else "behaviour"
        return self.ratio

    def explicit_overrides(self) -> dict[str, Any]:
        """Preset keys whose value differs from what the preset alone would give."""
        preset = PRESETS[self.preset]
        return {k: getattr(self, k) for k in PRESET_KEYS if getattr(self, k) != preset[k]}
