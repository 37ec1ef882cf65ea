"""What ``forge eval MODEL`` adds to a run config before it is launched like any run
(:func:`forgerl.commands.launching.launch`): ``objective: eval``, the model, and, where MODEL names a run
(its directory, ``run:NAME`` or one of its checkpoint folders), that run's task, rewards,
environment, sampling, seed and held-out size, so that its checkpoint is scored exactly as
the run's own evaluation scored it. Flags and ``--set`` values given here come after and win.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from forgerl.errors import ConfigError

#: The sections of a run's config.yaml an evaluation of its checkpoints starts from.
_FROM_RUN = ("task", "environment", "rewards", "loop", "generator", "transport", "scheduler", "model")


def run_base(model: str) -> tuple[dict[str, Any] | None, str | None]:
    """The config sections of the run ``model`` names (None when it names no run), and a
    line saying where they come from."""
    from forgerl.configuration.config import read_yaml
    from forgerl.models import from_run
    from forgerl.rundirs import runs

    found = from_run.find(model)
    if found is None:
        return None, None
    saved = read_yaml(found.run_dir / runs.CONFIG_FILE)
    base = {key: saved[key] for key in _FROM_RUN if key in saved}
    # The run's own model.options (a named model's) would not fit a checkpoint folder.
    base.pop("model", None)
    return base, f"evaluating with the task, rewards and sampling of run {found.run_dir}"


def implied_sets(k: int | None, temperature: float | None, problems: int | None, confidence: float | None,
                 batch_size: int | None) -> list[str]:  # fmt: skip
    """The ``--set`` values forge eval's own options stand for."""
    sets = ["objective=eval"]
    if k is not None:
        sets.append(f"eval.k={k}")
    if temperature is not None:
        sets.append(f"loop.eval_temperature={temperature}")
    if problems is not None:
        sets.append(f"loop.eval_size={problems}")
    if confidence is not None:
        sets.append(f"eval.confidence={confidence}")
    if batch_size is not None:
        sets.append(f"eval.batch_size={batch_size}")
    return sets


def check_model_argument(model: str | None, resume_dir: str | None) -> None:
    """A missing MODEL, and a mistyped run directory (``runs/typo`` reads as a hub id
    ``owner/name``, which would fail only in the worker, after launch): one line now."""
    if resume_dir is None and (model is None or not model.strip()):
        raise ConfigError(
            "forge eval needs the model to evaluate: a named model (tiny), a Hugging Face folder, a hub id "
            "owner/name, or a run directory (runs/NAME, its newest checkpoint); or --resume DIR"
        )
    if model is None or "/" not in model:
        return
    path = Path(model).expanduser()
    try:
        missing = not path.exists() and str(path.parent) not in ("", ".") and path.parent.is_dir()
    except (OSError, ValueError):
        return
    if missing:
        raise ConfigError(
            f"model {model!r}: no such folder or run ({path.parent} holds no {path.name!r}); a hub id owner/name "
            "must not name a folder that exists here"
        )
