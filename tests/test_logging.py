"""Logging on real libraries: TensorBoard files read back with TensorBoard's EventAccumulator
(scalars and the weight and gradient-norm histograms), and Weights & Biases (offline) and MLflow
(a local SQLite store) runs read back with their own formats and client."""

from __future__ import annotations

import ast
import json
import struct
import subprocess
import sys
import types
from pathlib import Path

import pytest
from conftest import BIN, mpi_env, run_mpi
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mpirl.errors import ConfigError
from mpirl.report import loggers

MPIRL = str(BIN / "mpirl")


def wandb_history(run_file: Path) -> tuple[list[dict], dict]:
    """The history rows and the run record of an offline W&B run file (a LevelDB-style log of
    ``Record`` protobufs in 32 KiB blocks, after a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    block, pos, payloads, pending = 32768, 7, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            payloads.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            payloads.append(pending + chunk)
    history, run = [], {}
    for payload in payloads:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            # A key with "/" (perf/driver_rss_mb) comes as its parts.
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
        elif kind == "run":
            run = {"project": record.run.project, "name": record.run.display_name,
                   "config": {item.key: json.loads(item.value_json)
                              for item in record.run.config.update}}
    return history, run


def test_tensorboard_wandb_and_mlflow_get_every_row(tmp_path):
    pytest.importorskip("wandb")
    mlflow = pytest.importorskip("mlflow")
    run_dir = tmp_path / "run"
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = {"num_learners": 1, "num_envs_per_worker": 2, "rollout_fragment_length": 64,
              "tensorboard_histograms_every": 2, "wandb_project": "mpirl-tests",
              "mlflow_experiment": "mpirl-tests"}
    proc = run_mpi(3, MPIRL, "train", "--algo", "PPO", "--env", "CartPole-v1", "--run-dir",
                   str(run_dir), "--progress", "off", "--config", json.dumps(config),
                   "--stop", '{"training_iteration": 4}', timeout=240,
                   env={"WANDB_MODE": "offline", "WANDB_SILENT": "true",
                        "MLFLOW_TRACKING_URI": store})
    assert proc.returncode == 0, proc.stderr
    result = json.loads((run_dir / "result.json").read_text())

    # TensorBoard: a scalar per row and key; histograms every second iteration.
    (events,) = run_dir.glob("events.out.tfevents.*")
    accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0, "histograms": 0})
    accumulator.Reload()
    iterations = accumulator.Scalars("iteration")
    assert [e.value for e in iterations] == [1, 2, 3, 4]
    assert iterations[-1].step == result["timesteps_total"]
    tags = accumulator.Tags()["histograms"]
    weights = [tag for tag in tags if tag.startswith("weights/")]
    assert weights and "grad_norm" in tags
    steps_2_and_4 = [e.step for e in accumulator.Scalars("timesteps_total")][1::2]
    for tag in [*weights, "grad_norm"]:
        assert [h.step for h in accumulator.Histograms(tag)] == steps_2_and_4
    # PPO's 10 epochs of one minibatch each (128 rows, minibatch_size 256) per iteration.
    norms = accumulator.Histograms("grad_norm")[0].histogram_value
    assert norms.num == 20 and norms.min > 0

    # W&B, offline: one history row per iteration, the run named after the run directory.
    (run_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    history, run = wandb_history(run_file)
    assert [row["iteration"] for row in history] == [1, 2, 3, 4]
    assert history[-1]["episode_return_mean"] == pytest.approx(result["episode_return_mean"])
    assert run["project"] == "mpirl-tests" and run["name"] == "run"
    assert run["config"]["algo"] == "PPO"

    # MLflow: every row's numbers as metrics, the config as parameters.
    client = mlflow.tracking.MlflowClient(store)
    experiment = client.get_experiment_by_name("mpirl-tests")
    (mlrun,) = client.search_runs([experiment.experiment_id])
    assert mlrun.info.run_name == "run" and mlrun.data.params["algo"] == "PPO"
    assert mlrun.data.params["config.num_envs_per_worker"] == "2"
    history = client.get_metric_history(mlrun.info.run_id, "iteration")
    assert [m.value for m in history] == [1, 2, 3, 4]
    assert mlrun.data.metrics["episode_return_mean"] == pytest.approx(
        result["episode_return_mean"])


@pytest.mark.parametrize(("key", "extra"), [("wandb_project", "wandb"),
                                            ("mlflow_experiment", "mlflow")])
def test_a_logger_that_is_not_installed_is_one_clear_error(monkeypatch, key, extra):
    monkeypatch.setattr(loggers.importlib.util, "find_spec", lambda name: None)

    class Config:
        wandb_project = mlflow_experiment = ""

    config = Config()
    setattr(config, key, "p")
    with pytest.raises(ConfigError, match=rf"{key} is set, but .* pip install 'mpirl\[{extra}\]'"):
        loggers.check_logger_packages(config)


#: wandb.init keyword values and the wandb release that first took each (wandb's CHANGELOG.md).
WANDB_INIT_SINCE = {("reinit", "create_new"): (0, 19, 10)}


def extras_floor(package: str) -> dict[str, tuple[int, ...]]:
    """setup.py's lower bound on ``package`` in each extra that names it."""
    tree = ast.parse((Path(__file__).parents[1] / "setup.py").read_text())
    # setup.py's EXTRAS literal: {extra: (what it is for, requirements)}.
    extras = next(node.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
                  and any(getattr(target, "id", None) == "EXTRAS" for target in node.targets))
    floors = {}
    for extra, (_, requirements) in ast.literal_eval(extras).items():
        for requirement in requirements:
            name, _, version = requirement.partition(">=")
            if name == package:
                floors[extra] = tuple(int(part) for part in version.split("."))
    return floors


def test_the_wandb_floor_takes_what_the_logger_passes(tmp_path, monkeypatch):
    # What WandbLogger passes to wandb.init, caught by a stand-in module.
    calls = []
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(
        init=lambda **kwargs: calls.append(kwargs)))
    loggers.WandbLogger("p", tmp_path, {})
    (passed,) = calls
    floors = extras_floor("wandb")
    assert set(floors) == {"wandb", "dev"}
    # reinit's string values came one release at a time: each one passed must be in the table.
    reinit = passed.get("reinit")
    assert not isinstance(reinit, str) or ("reinit", reinit) in WANDB_INIT_SINCE, \
        f"add reinit={reinit!r} and the wandb release that added it to WANDB_INIT_SINCE"
    for (key, value), since in WANDB_INIT_SINCE.items():
        if passed.get(key) == value:
            for extra, floor in floors.items():
                assert floor >= since, (f"WandbLogger passes {key}={value!r}, new in wandb "
                                        f"{since}, but the {extra!r} extra allows {floor}")


#: A script that trains through the Python API inside its own active MLflow run.
CALLER = """
import json, sys
import mlflow, mpirl
mlflow.set_tracking_uri(sys.argv[1])
mlflow.set_experiment("caller")
with mlflow.start_run(run_name="mine") as mine:
    mlflow.log_param("mine", "yes")
    mpirl.train("PPO", "CartPole-v1", config={"mlflow_experiment": "mpirl-tests",
                "num_envs_per_worker": 2, "rollout_fragment_length": 64},
                stop={"training_iteration": 2}, run_dir=sys.argv[2], progress="off")
    active = mlflow.active_run()
    mlflow.log_metric("after", 1.0)  # still the caller's run
with mlflow.start_run() as later:  # still the caller's experiment
    pass
print("RESULT " + json.dumps({"mine": mine.info.run_id, "active": active and active.info.run_id,
                              "later_experiment": later.info.experiment_id}))
"""


def test_mlflow_leaves_the_callers_active_run_alone(tmp_path):
    mlflow = pytest.importorskip("mlflow")
    # A store in a local SQLite file (MLflow 3 refuses a plain directory unless told to).
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = subprocess.run([sys.executable, "-c", CALLER, store, str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=180, env=mpi_env())
    assert proc.returncode == 0, proc.stderr
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    result = json.loads(line[len("RESULT "):])
    assert result["active"] == result["mine"]
    client = mlflow.tracking.MlflowClient(store)
    caller = client.get_experiment_by_name("caller")
    assert result["later_experiment"] == caller.experiment_id
    mine = client.get_run(result["mine"])
    # The caller's run holds what the caller logged, and none of mpirl's rows or parameters.
    assert mine.info.status == "FINISHED" and mine.info.experiment_id == caller.experiment_id
    assert mine.data.params == {"mine": "yes"} and set(mine.data.metrics) == {"after"}
    (ours,) = client.search_runs([client.get_experiment_by_name("mpirl-tests").experiment_id])
    assert ours.info.run_id != result["mine"] and ours.info.status == "FINISHED"
    assert ours.info.run_name == "run" and ours.data.params["algo"] == "PPO"
    assert [m.value for m in client.get_metric_history(ours.info.run_id, "iteration")] == [1, 2]
