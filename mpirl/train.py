"""``mpirl train``: one algorithm, one environment, one run directory."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from mpi4py import MPI

import mpirl
from mpirl.algorithm import STOP_KEYS, Algorithm, load_algorithm, stop_reached
from mpirl.config import build, check_known_keys, split_by_dataclass
from mpirl.errors import ConfigError
from mpirl.layout import Layout
from mpirl.progress import ProgressDisplay
from mpirl.rollout import EnvSpec
from mpirl.run_dir import RunRecorder
from mpirl.runtime import Driver, RuntimeSettings, run

#: Used when --stop is not given.
DEFAULT_STOP = {"timesteps_total": 1_000_000}


@dataclasses.dataclass
class TrainRequest:
    """A checked ``mpirl train`` command line, the same on every rank."""

    algo: str
    env: EnvSpec
    config: Any
    settings: RuntimeSettings
    stop: dict[str, float]
    run_dir: Path

    @property
    def layout(self) -> Layout:
        return Layout(num_rollout_workers=self.config.num_rollout_workers,
                      num_learners=self.config.num_learners)


def make_request(algo: str, env_id: str, env_module: str | None, config: dict[str, Any],
                 stop: dict[str, Any], seed: int | None, run_dir: str | None) -> TrainRequest:
    """Validate everything that can be checked without starting anything; ConfigError if not."""
    module = load_algorithm(algo)
    config_keys, runtime_keys = split_by_dataclass(config, module.Config, RuntimeSettings)
    if seed is not None:
        config_keys["seed"] = seed
    algo_config = build(module.Config, config_keys)
    settings = build(RuntimeSettings, runtime_keys)
    check_known_keys(stop, list(STOP_KEYS), "--stop")
    for key, value in stop.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"--stop {key!r} must be a number, got {value!r}")
    env = EnvSpec(env_id, env_module)
    env.check()
    if run_dir is None:
        # Rank 0's clock names the directory; the other ranks never use it.
        stamp = time.strftime("%Y%m%d-%H%M%S")
        run_dir = f"runs/{algo.upper()}-{env_id.replace(':', '_')}-{stamp}"
    existing = [name for name in ("progress.csv", "result.json")
                if (Path(run_dir) / name).exists()]
    if existing:
        raise ConfigError(
            f"run directory {run_dir} already holds a run ({', '.join(existing)}); nothing was "
            f"overwritten. Choose a new --run-dir, or leave it out for a fresh timestamped one."
        )
    return TrainRequest(algo.upper(), env, algo_config, settings, stop or dict(DEFAULT_STOP),
                        Path(run_dir))


def train(request: TrainRequest) -> int:
    """Run on every rank; rank 0 trains until a stop criterion is met (exit code 0)."""
    return run(lambda driver: _drive(driver, request), request.layout, request.settings)


def _drive(driver: Driver, request: TrainRequest) -> int:
    module = load_algorithm(request.algo)
    algo = Algorithm(driver, module, request.config, request.env)
    params = {
        "algo": request.algo, "env": request.env.env_id, "env_module": request.env.env_module,
        "config": dataclasses.asdict(request.config),
        "runtime": dataclasses.asdict(request.settings), "stop": request.stop,
        "layout": driver.placement.summary(), "world_size": MPI.COMM_WORLD.Get_size(),
        "train_batch_size": algo.train_batch_size, "mpirl_version": mpirl.__version__,
    }
    title = f"{request.algo} {request.env.env_id}"
    with RunRecorder(request.run_dir, params) as recorder, \
            ProgressDisplay(title, total_steps=request.stop.get("timesteps_total")) as display:
        while True:
            row = algo.train()
            recorder.record(row)
            display.update(row)
            reason = stop_reached(row, request.stop)
            if reason is not None:
                break
    print(f"stopped: {reason} reached ({row[reason if reason in row else 'iteration']:g}) after "
          f"{row['timesteps_total']} env steps, {row['time_total_s']:.1f} s; "
          f"episode_return_mean {row['episode_return_mean']:.1f}. Results in {request.run_dir}",
          flush=True)
    return 0
