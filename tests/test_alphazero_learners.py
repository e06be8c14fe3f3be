"""AlphaZero on several learner ranks (issue 38), through the real CLI: self-play positions go
from rollout rank i straight to learner i mod L, each learner keeps its own replay shard, every
SGD step averages the gradient over the learners, so they hold the same weights; weights are
versioned and the policy lag is reported; a resume restores each learner's shard.

Measured when written (2026-11-28, 2 cores shared with other jobs): the two-learner run with its
resume took 37-40 s (two starts of 5 ranks), the four-rank run 13-16 s."""

from __future__ import annotations

import json
import math
import pickle

import numpy as np
import pytest
from conftest import OS_TTT, run_mpi
from test_train import MPIRL, rows, train

pytest.importorskip("pyspiel")

#: A quick run: few games and steps per iteration, an evaluation against random only, searching
#: 4 simulations a move (not the default 100: only that it runs is checked here).
QUICK = {"games_per_worker": 4, "sgd_steps_per_iteration": 4, "train_batch_size": 16,
         "evaluation_interval": 2, "evaluation_games": 4, "simulations": 4,
         "evaluation_opponents": "random", "evaluation_simulations": 4, "checkpoint_every": 1}


def learner_states(run_dir, iteration, learners):
    directory = run_dir / "checkpoints" / f"checkpoint_{iteration:06d}"
    states = []
    for index in range(learners):
        with open(directory / f"learner_{index}.pkl", "rb") as file:
            states.append(pickle.load(file))
    return states


def assert_same_learners(first, second):
    assert np.array_equal(first["weights"], second["weights"])
    assert first["version"] == second["version"]
    assert first["sgd_steps_total"] == second["sgd_steps_total"]
    moments = first["optimizer"]["state"]
    assert moments and all(
        np.array_equal(moments[k]["exp_avg"], second["optimizer"]["state"][k]["exp_avg"])
        for k in moments)


def test_two_learners_train_on_their_own_shards_with_identical_weights_and_resume(tmp_path):
    config = {**QUICK, "num_learners": 2}
    _, run_dir, _ = train(5, tmp_path, "--algo", "AlphaZero", "--env", OS_TTT, "--config",
                          json.dumps(config), "--stop", '{"training_iteration": 2}',
                          timeout=120)
    proc = run_mpi(5, *MPIRL, "train", "--resume", str(run_dir), "--stop",
                   '{"training_iteration": 3}', timeout=120)
    assert proc.returncode == 0, proc.stderr
    progress = rows(run_dir)
    assert [int(r["iteration"]) for r in progress] == [1, 2, 3]
    # Every iteration updated the weights once: a new version each, carried over the resume.
    assert [int(r["weights_version"]) for r in progress] == [1, 2, 3]
    assert [int(r["sgd_steps_total"]) for r in progress] == [4, 8, 12]
    lags = [float(r["policy_lag_mean"]) for r in progress]
    # Iteration 1 trains on version 0's positions only; later ones on older positions too.
    assert lags[0] == 0.0 and all(0.0 < lag < 2.0 for lag in lags[1:]), lags
    last = progress[-1]
    assert int(last["replay_size"]) == int(last["timesteps_total"])
    first, second = learner_states(run_dir, 3, 2)
    assert_same_learners(first, second)
    assert first["version"] == 3
    # Rollout rank i fed learner i: both shards hold positions, and together every one played.
    added = [state["replay"]["added"] for state in (first, second)]
    assert min(added) > 0 and sum(added) == int(last["timesteps_total"]), added
    # Positions carry the version that played them: iteration 3's, after the resume, version 2.
    for state in (first, second):
        versions = state["replay"]["arrays"]["versions"]
        assert list(np.unique(versions)) == [0, 1, 2], np.unique(versions)


def test_a_learner_without_a_rollout_rank_still_steps_with_the_others(tmp_path):
    # -n 4: the driver, one rollout rank (it feeds learner 0) and two learners. Learner 1's
    # shard stays empty: it adds no rows to the steps, yet takes every one.
    config = {**QUICK, "num_learners": 2}
    _, run_dir, result = train(4, tmp_path, "--algo", "AlphaZero", "--env", OS_TTT,
                               "--config", json.dumps(config), "--stop",
                               '{"training_iteration": 2}', timeout=120)
    last = rows(run_dir)[-1]
    assert int(last["weights_version"]) == 2 and not math.isnan(float(last["policy_loss"]))
    first, second = learner_states(run_dir, 2, 2)
    assert_same_learners(first, second)
    assert first["replay"]["added"] == result["timesteps_total"] > 0
    assert second["replay"]["added"] == 0
