"""Experiment trackers, each a plugin on the run hooks (``forge_run_start``,
``forge_step_end``, ``forge_run_end``): ``tensorboard`` (on by default), ``wandb`` and
``mlflow`` (off until ``logging.wandb.enabled`` / ``logging.mlflow.enabled``). A tracker
whose library is missing is skipped with a note in the run's progress, never an error.
See docs/observability.md."""
