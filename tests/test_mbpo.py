"""MBPO through the real CLI (issue 39): SAC's actor on the rollout ranks, branched model
rollouts through the ensemble there, SAC and the ensemble trained on the learner; learning (a
1-D walk to a target; Pendulum-v1's -200 is benchmarks/model_based.py's figure, see the
learning test), the rollout-length schedule and the buffers, checkpoint and resume, evaluate,
local mode, a learner rank, and bad input.
"""

from __future__ import annotations

import contextlib
import io
import json
import math

import gymnasium as gym
import numpy as np
import pytest
import torch
from conftest import local_train, train_refused
from mpirl.algorithms.model_based.mbpo import (
    Config,
    model_buffer_capacity,
    model_spec,
    rollout_length,
)
from test_pets import refusal
from test_train import rows, train

COLUMNS = {"model_error", "model_error_max", "model_train_nll", "rollout_length",
           "model_buffer_size", "real_buffer_size", "critic_loss", "actor_loss", "alpha",
           "entropy", "q_mean", "sgd_steps", "sgd_steps_total", "random_actions",
           "eval_return_mean"}
#: A quick run's settings: small networks, little data. With 2 rollout ranks an iteration is
#: 20 env steps; the model is fitted at 40 and 80 steps (epochs 1 and 2 of 40 steps), with
#: rollouts of 2 and then 3 steps from 20 start states.
QUICK = {"rollout_fragment_length": 10, "initial_random_steps": 40, "model_train_freq": 40,
         "rollout_batch_size": 20, "rollout_schedule": [0, 2, 1, 3], "epoch_length": 40,
         "sgd_steps_per_env_step": 1, "train_batch_size": 32, "hidden_sizes": [32, 32],
         "ensemble_size": 3, "elites": 2, "model_hidden_sizes": [16, 16],
         "model_batch_size": 32, "model_max_epochs": 3, "evaluation_interval": 2,
         "evaluation_episodes": 2}


def _ints(progress, column):
    return [int(float(row[column])) for row in progress]


#: MBPO's learning test: a 1-D walk (MpirlOverflowing-v0, its observations kept finite for
#: the whole run: explode_after far past the budget) that pays minus the distance from 0, 100
#: steps an episode from a start in [-1, 1], the action moving the position by up to 0.1.
#: Small networks, a short horizon (gamma 0.9), a low starting temperature and a quarter of
#: each SAC minibatch real, the rest model rollouts of 1 to 3 steps.
WALK = {"env_config": {"explode_after": 1_000_000}, "rollout_fragment_length": 50,
        "initial_random_steps": 100, "model_train_freq": 100, "epoch_length": 100,
        "rollout_batch_size": 400, "rollout_schedule": [0, 2, 1, 3],
        "sgd_steps_per_env_step": 4, "train_batch_size": 64, "hidden_sizes": [32, 32],
        "ensemble_size": 3, "elites": 2, "model_hidden_sizes": [32, 32], "model_batch_size": 32,
        "evaluation_interval": 2, "evaluation_episodes": 10, "initial_alpha": 0.1,
        "gamma": 0.9, "real_ratio": 0.25}


@pytest.fixture(scope="module")
def walk(tmp_path_factory):
    """The learning test's run, which also dumps its real transitions to HDF5."""
    tmp_path = tmp_path_factory.mktemp("walk")
    dump = tmp_path / "dump"
    _, run_dir, _ = train(
        2, tmp_path, "--algo", "MBPO", "--env-module", "mpirl.testing", "--env",
        "MpirlOverflowing-v0", "--seed", "0", "--config", json.dumps(WALK),
        "--dump-trajectories", str(dump),
        "--stop", '{"eval_return_mean": -10, "timesteps_total": 800}', timeout=300)
    return run_dir, dump


def test_mbpo_learns_to_walk_to_the_target_within_800_env_steps(walk):
    """MBPO learns: 10 deterministic evaluation episodes (one every 100 env steps) with a mean
    of at least -10 within 800 env steps, mpiexec -n 2 (driver and learner, one rollout rank);
    the run stops at the first evaluation that passes. The same 10 episodes played with
    uniformly random actions average -59, standing still -49 (the best constant action is no
    better), walking straight to 0 and staying there -1.4 (1,000 episodes each, 2026-11-29).
    Seeds 0-4 with this command (2026-11-29, 2 loaded cores): -5.0 at 300 env steps, -5.0 at
    300, -5.6 at 400, -7.6 at 500, -7.8 at 400; 10-13 CPU seconds each.

    The issue's goal, 10 deterministic episodes of Pendulum-v1 with a mean of -200 within
    5,000 env steps (mpiexec -n 3, the defaults), was this test until 2026-11-29: 117 CPU
    seconds, too dear for the suite. It is benchmarks/model_based.py's figure (``--algos MBPO
    --caps MBPO=5000``; benchmarks/RESULTS.md, "Model-based RL: MBPO vs SAC (Pendulum-v1)":
    -200 reached at 1,400-3,200 env steps on seeds 0-3, and seed 4 at 4,000 with this
    test's protocol). The removed test, measured when written (2026-11-28, evaluation every 8
    iterations = 400 env steps, stopping at the first mean of 10 deterministic episodes >=
    -200), on 2 cores shared with other agents' jobs (load 3.5-6): seed 0 -133.5 at 2,000 env
    steps in 47.5-71.4 s of training, seed 1 -196.9 at 2,800 in 91.5-98.5 s, seed 2 -152.3 at
    4,000 in 124.0-144.7 s (103-107 s of CPU for all three ranks; the driver's process, which
    holds the learner, is the critical path: SAC's SGD steps, 10 per env step, take about 3 ms
    each there). With SAC's lr 1e-3 instead of 3e-4 seed 1 swung between -400 and -1,600 up to
    2,800 env steps."""
    run_dir, _ = walk
    progress = rows(run_dir)
    last = progress[-1]
    assert float(last["eval_return_mean"]) >= -10, last
    assert int(last["timesteps_total"]) <= 800
    # It learned from model rollouts: the buffer held them, and SAC trained on them.
    assert int(float(last["model_buffer_size"])) > 0 and int(float(last["rollout_length"])) >= 1
    assert float(progress[1]["eval_return_mean"]) < -20, progress[1]


def test_real_transitions_are_dumped_to_hdf5(walk):
    """The learning run's dump (--dump-trajectories): the run stops at an evaluation, every
    100 env steps, where the env's 100-step episodes end, so it holds every episode whole, with
    the rewards the env gave (minus the distance from 0 after the step) and actions inside the
    bounds. (test_model_based_cli.py checks PETS's dump.)"""
    from mpirl.data.reader import open_dataset

    run_dir, dump = walk
    last = rows(run_dir)[-1]
    dataset = open_dataset(dump)
    steps = int(last["timesteps_total"])
    assert dataset.num_episodes == steps // 100 == int(last["episodes_total"])
    assert dataset.total_steps == steps
    returns = []
    for episode in dataset.iterate_episodes():
        assert episode.observations.shape[1:] == (1,) and len(episode.actions) == 100
        assert np.all(np.abs(episode.actions) <= 1.0) and np.all(episode.rewards <= 0)
        np.testing.assert_allclose(episode.rewards[:-1],
                                   -np.abs(episode.observations[1:100, 0]), rtol=1e-5)
        returns.append(float(episode.rewards.sum()))
    assert float(last["episode_return_mean"]) == pytest.approx(np.mean(returns), rel=1e-5)


def check_a_quick_run(proc, run_dir, monkeypatch):
    """test_model_based_cli.py's reference run (QUICK, mpiexec -n 3, 8 iterations, a
    checkpoint every 2), checked here: its first 4 iterations follow the rollout-length
    schedule, and ``mpirl evaluate`` acts with its last checkpoint."""
    progress = rows(run_dir)[:4]
    assert COLUMNS <= set(progress[0])
    assert _ints(progress, "real_buffer_size") == [20, 40, 60, 80]
    assert [r["random_actions"] for r in progress] == ["1.0", "1.0", "0.0", "0.0"]
    # k grows with the epochs: 2 steps at epoch 1, 3 at epoch 2 (Pendulum never terminates,
    # so every rollout runs its k steps); the buffer holds 20 rollouts x k.
    assert _ints(progress, "rollout_length") == [0, 2, 2, 3]
    assert _ints(progress, "model_buffer_size") == [0, 40, 40, 60]
    # One SAC step per env step from the first model rollouts (at 40 env steps) on.
    assert _ints(progress, "sgd_steps_total") == [0, 0, 20, 40]
    assert all(math.isfinite(float(r["model_error"])) for r in progress[1:])
    assert progress[1]["eval_return_mean"] != "nan"
    # mpirl evaluate acts with the checkpoint's SAC actor: the CLI's main in-process (the
    # console script's code path outside a launcher; test_pets.check_a_quick_run runs the
    # command end to end on PETS's checkpoint).
    from mpirl.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["evaluate", str(run_dir), "--episodes", "1", "--json"]) == 0
    summary = json.loads(out.getvalue().strip().splitlines()[-1])
    assert summary["episodes"] == 1 and math.isfinite(summary["return_mean"])


def test_a_learner_rank_keeps_the_buffers_and_trains_both(tmp_path):
    """num_learners 1: driver, learner rank, one rollout rank; real and model transitions
    travel from the rollout rank to the learner's over the data plane."""
    config = {**QUICK, "num_learners": 1}
    _, run_dir, _ = train(3, tmp_path, "--algo", "MBPO", "--env", "Pendulum-v1",
                          "--config", json.dumps(config), "--stop",
                          '{"training_iteration": 5}', timeout=120)
    progress = rows(run_dir)
    # 10 env steps an iteration: the model is first fitted at 40, and SAC trains after.
    assert _ints(progress, "real_buffer_size") == [10, 20, 30, 40, 50]
    assert _ints(progress, "model_buffer_size") == [0, 0, 0, 40, 40]
    assert _ints(progress, "sgd_steps") == [0, 0, 0, 0, 10]


def test_local_mode_rolls_out_and_trains(tmp_path):
    _, run_dir, _ = train(1, tmp_path, "--algo", "MBPO", "--env", "Pendulum-v1",
                          "--config", json.dumps(QUICK), "--stop",
                          '{"training_iteration": 5}', timeout=120)
    progress = rows(run_dir)
    # 10 env steps an iteration: the model is first fitted at 40, and SAC trains after.
    assert _ints(progress, "real_buffer_size") == [10, 20, 30, 40, 50]
    assert _ints(progress, "model_buffer_size") == [0, 0, 0, 40, 40]
    assert _ints(progress, "sgd_steps") == [0, 0, 0, 0, 10]


def test_the_rollout_length_follows_the_schedule():
    config = Config(rollout_schedule=(20, 100, 1, 15), epoch_length=1000, model_train_freq=250,
                    rollout_batch_size=100, model_retain_epochs=2)
    lengths = [rollout_length(config, epoch * 1000) for epoch in (0, 20, 21, 60, 100, 500)]
    assert lengths == [1, 1, 1, 8, 15, 15]
    assert model_buffer_capacity(config, 8) == 100 * 4 * 8 * 2


def stop_when_high(obs, action, next_obs):
    """A termination function for the test below: cos(theta) above 0.5 ends the episode."""
    return next_obs[:, 0] > 0.5


def test_model_rollouts_stop_where_the_termination_function_says():
    env = gym.make("Pendulum-v1")
    config = Config(ensemble_size=2, elites=2, model_hidden_sizes=(8,),
                    termination_fn=f"{__name__}:stop_when_high")
    model = model_spec(env.observation_space, env.action_space, config).build()
    start = np.array([[1.0, 0.0, 0.0]] * 5 + [[-1.0, 0.0, 0.0]] * 5, np.float32)
    out = model.branched_rollouts(start, 4, torch.Generator().manual_seed(0))
    ended = out["terminated"] > 0.5
    assert np.array_equal(ended, out["next_obs"][:, 0] > 0.5)
    # A rollout goes on only from a step that did not end it: at most 10 start states.
    assert len(out["obs"]) <= 10 * 4 and out["actions"].shape[1] == 1
    assert np.all(np.abs(out["actions"]) <= 2.0)


@pytest.mark.parametrize("args, message", [
    (["--env", "CartPole-v1"], "MBPO acts with SAC on continuous actions: it needs a Box "
                               "action space, and this environment's is Discrete(2)"),
    (["--env", "Pendulum-v1", "--config", '{"elites": 8}'],
     "MBPO: elites (8) cannot exceed ensemble_size (7)"),
    (["--env", "Pendulum-v1", "--config", '{"rollout_schedule": [1, 5, 0, 3]}'],
     "has a rollout length below 1"),
    (["--env", "Pendulum-v1", "--config", '{"termination_fn": "nowhere_mod:fn"}'],
     "termination_fn 'nowhere_mod:fn': no module named 'nowhere_mod'"),
    (["--env", "Pendulum-v1", "--config", '{"real_ratio": 1.5}'],
     '"real_ratio" = 1.5 is out of range'),
    (["--env", "Pendulum-v1", "--config", '{"num_learners": 2}'],
     "num_learners 2 must be 0 or 1"),
    (["--env", "Pendulum-v1", "--stop", '{"eval_return_mean": -200}'],
     "--stop eval_return_mean needs evaluations: set the config key evaluation_interval"),
])
def test_bad_input_is_refused(tmp_path, capsys, args, message):
    """In-process (test_pets.refusal); the first case end to end below."""
    assert message in refusal(tmp_path, capsys, "--algo", "MBPO", *args)


def test_bad_input_exits_2_in_one_line(tmp_path):
    assert ("MBPO acts with SAC on continuous actions: it needs a Box action space, and this "
            "environment's is Discrete(2)"
            in train_refused(tmp_path, "--algo", "MBPO", "--env", "CartPole-v1"))


#: A quick run on a walk whose observations go wrong after 25 steps of each env: checkpoints
#: every iteration, the model first fitted at 40 env steps.
EXPLODING = {**QUICK, "evaluation_interval": 0, "checkpoint_every": 1,
             "env_config": {"explode_after": 25}}


@pytest.mark.parametrize("value, message", [
    ("huge", "dynamics ensemble member 0 diverged at epoch 1: its training loss is nan"),
    ("nan", "new transitions have NaN or infinite obs: the environment returned them"),
])
def test_a_diverged_model_or_nan_data_stops_the_run_keeping_the_last_checkpoint(
        tmp_path, value, message):
    """Observations at float32's edge make the model's targets overflow (its loss is NaN);
    NaN observations are refused before the model or SAC learns from them. Either way: exit
    2, one line naming the training iteration, the last good checkpoint kept."""
    config = {**EXPLODING, "env_config": {"explode_after": 25, "value": value}}
    proc = local_train(tmp_path, "--algo", "MBPO", "--env-module", "mpirl.testing", "--env",
                       "MpirlOverflowing-v0", "--config", json.dumps(config), "--stop",
                       '{"training_iteration": 8}')
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("mpirl:")]
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert lines[0].startswith("mpirl: training iteration ")
    assert lines[0].endswith("the run stopped, its last checkpoint is kept")
    stopped_at = int(lines[0].split()[3].rstrip(":"))
    latest = (tmp_path / "run" / "checkpoints" / "latest").read_text().strip()
    assert latest == f"checkpoint_{stopped_at - 1:06d}"
