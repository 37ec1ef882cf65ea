"""The ``eval`` section of the run config: what ``forge eval`` (``objective: eval``,
docs/eval.md) samples per held-out problem and reports. Imports pydantic, never torch."""

from __future__ import annotations

from pydantic import ConfigDict, Field

from forgerl.configuration.limits import MAX_SAMPLES_PER_STEP
from forgerl.options import OptionsModel


class EvalConfig(OptionsModel):
    """``forge eval``: samples per problem, batching and the confidence level (docs/eval.md)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    k: int = Field(
        1,
        ge=1,
        le=1024,
        description="Samples per held-out problem; pass@1, pass@2, pass@4, ... up to pass@k "
        "and mean@k are reported. Sample 0 of a problem is the one the run's own evaluation draws.",
    )
    batch_size: int = Field(
        64,
        ge=1,
        le=MAX_SAMPLES_PER_STEP,
        description="Samples generated and scored together, then appended to "
        "the results file: the most work a killed evaluation loses.",
    )
    confidence: float = Field(
        0.95,
        gt=0,
        lt=1,
        description="Level of the confidence intervals (normal approximation over problems).",
    )
