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


@pytest.fixture(scope="module")
def small_dump(tmp_path_factory):
    """Ten episodes of an untrained policy: data for the error and resume tests."""
    import gymnasium as gym

    from mpirl.policy import PolicySpec

    env = gym.make(ENV)
    policy = PolicySpec(env.observation_space, env.action_space).build()
    episodes = play_episodes(policy, ENV, 10, seed=0)
    return write_dump(tmp_path_factory.mktemp("small") / "dump", ENV, episodes)


def test_resume_continues_identically(small_dump, tmp_path):
    """MARWIL over two learners: a run stopped after iteration 2 and resumed trains iteration 3
    exactly as an uninterrupted run (weights, optimizer, shard sampling RNG, moving average)."""
    config = {"input": str(small_dump), "num_learners": 2, "num_sgd_steps_per_iteration": 20,
              "checkpoint_every": 1}
    whole = _train(4, "MARWIL", tmp_path / "whole", config, {"training_iteration": 3})
    assert whole.returncode == 0, whole.stderr
    part = _train(4, "MARWIL", tmp_path / "part", config, {"training_iteration": 2})
    assert part.returncode == 0, part.stderr
    resumed = run_mpi(4, MPIRL, "train", "--resume", str(tmp_path / "part"), "--stop",
                      '{"training_iteration": 3}', timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout
    rows = [json.loads((tmp_path / name / "result.json").read_text()) for name in ("whole",
                                                                                    "part")]
    for key in ("policy_loss", "vf_loss", "advantage_scale", "timesteps_total"):
        assert rows[0][key] == rows[1][key], (key, rows)


def _expect_usage_error(proc, *phrases):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    for phrase in phrases:
        assert phrase in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_input_is_a_clear_error(small_dump, tmp_path):
    """BC and MARWIL share these checks (mpirl.offline.check_config); each case runs on one."""
    stop = {"training_iteration": 1}
    for algo in ("BC", "MARWIL"):
        _expect_usage_error(_train(1, algo, tmp_path / algo, {}, stop), 'config key "input"')
    algo = "BC"
    _expect_usage_error(_train(2, algo, tmp_path / "b", {"input": str(tmp_path / "nope")}, stop),
                        "no such file or directory")
    (tmp_path / "empty").mkdir()
    _expect_usage_error(_train(2, algo, tmp_path / "c", {"input": str(tmp_path / "empty")}, stop),
                        str(tmp_path / "empty"))
    proc = run_mpi(2, MPIRL, "train", "--algo", algo, "--env", "Acrobot-v1", "--run-dir",
                   str(tmp_path / "d"), "--config", json.dumps({"input": str(small_dump)}))
    _expect_usage_error(proc, "holds episodes of CartPole-v1", "--env is Acrobot-v1")
    _expect_usage_error(_train(3, algo, tmp_path / "e", {"input": str(small_dump),
                                                         "num_learners": 11}, stop),
                        "holds 10 episodes, fewer than the 11 learners")
    _expect_usage_error(_train(3, algo, tmp_path / "f", {"input": str(small_dump),
                                                         "max_rows_in_memory": 50}, stop),
                        "max_rows_in_memory=50")
