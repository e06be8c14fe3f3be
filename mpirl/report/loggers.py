"""Optional loggers besides TensorBoard: Weights & Biases and MLflow, each off unless its config
key names a project or experiment. Rank 0 only; they get what progress.csv gets, one row per
iteration, with the run directory's name as the run name and params.json as the run's config.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import numbers
import time
from pathlib import Path
from typing import Any

from mpirl.errors import ConfigError

#: config key -> (package, the extra that installs it)
LOGGER_PACKAGES = {"wandb_project": ("wandb", "wandb"), "mlflow_experiment": ("mlflow", "mlflow")}


def check_logger_packages(config: Any) -> None:
    """ConfigError, before anything starts, for a logger configured but not installed."""
    for key, (package, extra) in LOGGER_PACKAGES.items():
        if getattr(config, key, "") and importlib.util.find_spec(package) is None:
            raise ConfigError(f"{key} is set, but the {package} package is not installed; "
                              f"install it with: pip install 'mpirl[{extra}]'")


def _numbers(row: dict[str, Any]) -> dict[str, float]:
    return {key: float(value) for key, value in row.items()
            if isinstance(value, numbers.Real) and not isinstance(value, bool)
            and math.isfinite(value)}


class WandbLogger:
    """A W&B run named after the run directory; a resumed run continues the same W&B run.
    ``WANDB_MODE=offline`` writes it under ``RUN_DIR/wandb`` for ``wandb sync`` later."""

    def __init__(self, project: str, run_dir: Path, params: dict[str, Any]) -> None:
        import wandb

        # The same run directory is the same W&B run: its id comes from the absolute path.
        run_id = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]
        self.run = wandb.init(project=project, name=run_dir.name, id=run_id, resume="allow",
                              config=params, dir=str(run_dir), reinit="create_new")

    def log(self, row: dict[str, Any], step: int) -> None:
        self.run.log(_numbers(row), step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowLogger:
    """An MLflow run in ``experiment`` (tracking server from ``MLFLOW_TRACKING_URI``), named
    after the run directory, with the config's keys as its parameters. Everything goes through
    a client by the run's id, never MLflow's active run or experiment: a script that calls
    mpirl inside its own ``mlflow.start_run()`` keeps its run, and the recorder may log from a
    thread of its own (RunRecorder's in_background), where no run is active anyway."""

    def __init__(self, experiment: str, run_dir: Path, params: dict[str, Any]) -> None:
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient
        from mlflow.tracking.context.registry import resolve_tags

        self.metric = Metric
        self.client = MlflowClient()
        # The tags mlflow.start_run would set (user, source script, git commit).
        run = self.client.create_run(self._experiment_id(experiment), run_name=run_dir.name,
                                     tags=resolve_tags())
        self.run_id = run.info.run_id
        flat = {"algo": params.get("algo"), "env": params.get("env"),
                **{f"config.{k}": v for k, v in params.get("config", {}).items()}}
        # MLflow caps a parameter's value at 6000 characters.
        self.client.log_batch(self.run_id, params=[Param(k, str(v)[:6000])
                                                   for k, v in flat.items()])

    def _experiment_id(self, name: str) -> str:
        from mlflow.exceptions import MlflowException

        found = self.client.get_experiment_by_name(name)
        if found is None:
            try:
                return self.client.create_experiment(name)
            except MlflowException:
                # Another run (a trial beside this one) created it first.
                found = self.client.get_experiment_by_name(name)
                if found is None:
                    raise
        if found.lifecycle_stage == "deleted":
            raise ConfigError(f"mlflow_experiment {name!r} is a deleted experiment of the "
                              f"tracking store; restore it (mlflow experiments restore) or "
                              f"name another")
        return found.experiment_id

    def log(self, row: dict[str, Any], step: int) -> None:
        stamp = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[
            self.metric(key, value, stamp, step) for key, value in _numbers(row).items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def make_loggers(config: Any, run_dir: Path, params: dict[str, Any]) -> list[Any]:
    """The loggers ``config`` turns on (``wandb_project``, ``mlflow_experiment``)."""
    loggers: list[Any] = []
    if getattr(config, "wandb_project", ""):
        loggers.append(WandbLogger(config.wandb_project, run_dir, params))
    if getattr(config, "mlflow_experiment", ""):
        loggers.append(MlflowLogger(config.mlflow_experiment, run_dir, params))
    return loggers
