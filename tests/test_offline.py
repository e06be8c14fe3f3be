"""BC and MARWIL: learning from a trained PPO's CartPole episodes, sharded over learner ranks;
a missing or foreign input is a clear error (exit code 2)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import BIN, run_mpi
from offline_fixtures import checkpoint_policy, play_episodes, write_dump

MPIRL = str(BIN / "mpirl")
ENV = "CartPole-v1"
DUMP_EPISODES = 50


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    """50 episodes of a PPO policy trained to >= 475, sampled stochastically; and their mean
    return."""
    root = tmp_path_factory.mktemp("offline")
    proc = run_mpi(3, MPIRL, "train", "--algo", "PPO", "--env", ENV, "--run-dir",
                   str(root / "ppo"), "--stop",
                   '{"episode_return_mean": 475, "timesteps_total": 150000}', timeout=240)
    assert proc.returncode == 0, proc.stderr
    episodes = play_episodes(checkpoint_policy(root / "ppo"), ENV, DUMP_EPISODES, seed=100)
    mean_return = float(np.mean([e["rewards"].sum() for e in episodes]))
    return write_dump(root / "dump", ENV, episodes), mean_return


def _train(n: int, algo: str, run_dir, config: dict, stop: dict, timeout: float = 120):
    return run_mpi(n, MPIRL, "train", "--algo", algo, "--env", ENV, "--run-dir", str(run_dir),
                   "--config", json.dumps(config), "--stop", json.dumps(stop), timeout=timeout)


@pytest.mark.parametrize(("algo", "n", "layout"), [
    ("BC", 3, {}),
    ("BC", 4, {"num_learners": 2}),
    ("MARWIL", 4, {"num_learners": 2}),
])
def test_learns_from_ppo_dump(dump, tmp_path, algo, n, layout):
    path, dataset_return = dump
    target = 0.9 * dataset_return
    proc = _train(n, algo, tmp_path / "run", {"input": str(path), **layout},
                  {"episode_return_mean": target, "training_iteration": 30})
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["episode_return_mean"] >= target, (result, dataset_return)
    # timesteps_total counts dataset rows trained on: 512 rows x 100 steps per iteration.
    assert result["timesteps_total"] == 512 * 100 * result["iteration"]
    assert result["evaluation_env_steps_total"] >= 10 * result["iteration"]
