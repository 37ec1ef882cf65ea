"""The ``mlflow`` tracker: every step's metrics, and the run's config as parameters, to
MLflow. Off unless ``logging.mlflow.enabled``. Without ``logging.mlflow.tracking_uri`` it
needs no server: a file store in ``<run_dir>/mlruns`` (``mlflow ui --backend-store-uri
RUN_DIR/mlruns``)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forgerl_plugins.trackers.common import SAMPLE_COLUMNS, Tracker, sample_rows

LOG_DIR = "mlruns"
#: MLflow refuses longer parameter values.
MAX_PARAM_CHARS = 500
STATUS = {"completed": "FINISHED", "interrupted": "KILLED"}
#: Each step's samples table, an artifact of the MLflow run.
SAMPLES_ARTIFACT = "samples/step-{step:06d}.json"


@dataclass
class _Run:
    client: Any
    run_id: str
    uri: str


def flat_params(config: Any, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    items = config.items() if isinstance(config, dict) else enumerate(config) if isinstance(config, list) else None
    if items is None:
        return {prefix: json.dumps(config) if not isinstance(config, str) else config}
    for k, v in items:
        out.update(flat_params(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


class MLflow(Tracker):
    name = "mlflow"
    module = "mlflow"
    install = "pip install mlflow-skinny"
    switch = "set logging.mlflow.enabled=false"

    def enabled(self, config: Any) -> bool:
        return bool(config.logging.mlflow.enabled)

    def open(self, config: Any, run_dir: Path) -> _Run:
        options = config.logging.mlflow
        uri = options.tracking_uri or (run_dir / LOG_DIR).resolve().as_uri()
        if uri.startswith("file:"):
            # MLflow 3 keeps the file store working behind this switch (it prefers a
            # database); a local store with no server is what this default is for.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        experiment = client.get_experiment_by_name(options.experiment)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(options.experiment)
        # A resumed run continues its MLflow run: found by the run directory's tag.
        tag = str(run_dir.resolve())
        found = client.search_runs([experiment_id], filter_string=f"tags.`forgerl.run_dir` = '{tag}'")
        if found:
            return _Run(client, found[0].info.run_id, uri)
        run = client.create_run(experiment_id, tags={"mlflow.runName": run_dir.name,
                                                     "forgerl.run_dir": tag})
        from mlflow.entities import Param

        params = [Param(k, v[:MAX_PARAM_CHARS]) for k, v in flat_params(json.loads(config.model_dump_json())).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters a batch
            client.log_batch(run.info.run_id, params=params[i:i + 100])
        return _Run(client, run.info.run_id, uri)

    def where(self, run_dir: Path) -> str:
        handle = self.open_runs.get(run_dir)
        return f"writing {handle.uri}" if handle else "writing"

    def write(self, handle: _Run, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        # "loss" and "loss/policy" cannot both be files of a file store: "/" becomes ".".
        metrics = [Metric(k.replace("/", "."), v, now, step) for k, v in values.items()]
        handle.client.log_batch(handle.run_id, metrics=metrics)

    def write_samples(self, handle: _Run, step: int, samples: Sequence[Any]) -> None:
        rows = sample_rows(samples)
        table = {c: [row[i] for row in rows] for i, c in enumerate(SAMPLE_COLUMNS)}
        artifact = SAMPLES_ARTIFACT.format(step=step)
        try:
            handle.client.log_table(handle.run_id, data=table, artifact_file=artifact)
        except ImportError:  # log_table needs pandas, which mlflow-skinny does not bring: the same columns as JSON
            handle.client.log_dict(handle.run_id, {"columns": list(SAMPLE_COLUMNS), "data": rows}, artifact)

    def close(self, handle: _Run, summary: Mapping[str, Any]) -> None:
        handle.client.set_terminated(handle.run_id, STATUS.get(str(summary.get("status")), "FAILED"))


_tracker = MLflow()

forge_run_start, forge_step_end, forge_run_end = _tracker.run_hooks()
forge_step_samples = _tracker.forge_step_samples
