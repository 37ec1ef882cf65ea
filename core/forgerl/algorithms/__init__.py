"""GRPO and its variants as pure torch functions over padded ``[B, T]`` tensors.

``from forgerl.algorithms import AlgorithmConfig`` needs only pydantic (configs are
validated on machines without torch); everything else is imported lazily on first
use and needs torch. Maths and papers: ``docs/algorithms.md``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .config import PRESET_KEYS, PRESETS, AlgorithmConfig

_LAZY = {
    # advantages
    "group_advantages": "advantages",
    "zero_variance_groups": "advantages",
    "ZeroVarianceGroups": "advantages",
    # logprobs
    "selective_logprobs": "logprobs",
    "naive_selective_logprobs": "logprobs",
    "token_entropy": "logprobs",
    "naive_token_entropy": "logprobs",
    # loss
    "policy_loss": "loss",
    "clipped_surrogate": "loss",
    "Surrogate": "loss",
    "kl_estimate": "loss",
    "kl_from_log_ratio": "loss",
    "aggregate_loss": "loss",
    "masked_mean": "loss",
    "logprob_gap": "loss",
    "logprob_gap_by_age": "loss",
    "gap_age_key": "loss",
    "METRIC_KEYS": "loss",
    # overlong
    "overlong_mask": "overlong",
    "soft_overlong_penalty": "overlong",
    "apply_overlong": "overlong",
}

__all__ = [
    "METRIC_KEYS",
    "PRESETS",
    "PRESET_KEYS",
    "AlgorithmConfig",
    "Surrogate",
    "ZeroVarianceGroups",
    "aggregate_loss",
    "apply_overlong",
    "clipped_surrogate",
    "gap_age_key",
    "group_advantages",
    "kl_estimate",
    "kl_from_log_ratio",
    "logprob_gap",
    "logprob_gap_by_age",
    "masked_mean",
    "naive_selective_logprobs",
    "naive_token_entropy",
    "overlong_mask",
    "policy_loss",
    "selective_logprobs",
    "soft_overlong_penalty",
    "token_entropy",
    "zero_variance_groups",
]
if set(__all__) != {"AlgorithmConfig", "PRESETS", "PRESET_KEYS", *_LAZY}:  # a bug here, not the caller's
    raise RuntimeError("forgerl.algorithms: keep __all__ and _LAZY in step")


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from .advantages import ZeroVarianceGroups, group_advantages, zero_variance_groups
    from .logprobs import naive_selective_logprobs, naive_token_entropy, selective_logprobs, token_entropy
    from .loss import (
        METRIC_KEYS,
        Surrogate,
        aggregate_loss,
        clipped_surrogate,
        gap_age_key,
        kl_estimate,
        kl_from_log_ratio,
        logprob_gap,
        logprob_gap_by_age,
        masked_mean,
        policy_loss,
    )
    from .overlong import apply_overlong, overlong_mask, soft_overlong_penalty
