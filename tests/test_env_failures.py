"""Environments that raise, for real: recovered inside the rollout worker, or the run ends cleanly.

The fake envs of mpirl.testing fail on a fixed schedule per instance; CountingEnv's observation is
the number of steps its instance has taken, so each row of a batch says which step it came from.
"""

import dataclasses
import json
import pickle
import socket
import sys
import time

import numpy as np
import pytest
from conftest import run_mpi
from mpi4py import MPI

from mpirl.errors import ConfigError, EnvFailureError
from mpirl.execution.contract import load_algorithm
from mpirl.models.policy import PolicySpec
from mpirl.runtime.core import RankContext
from mpirl.runtime.layout import Layout
from mpirl.workers.env_spec import EnvSpec
from mpirl.workers.learner import Learner, LearnerSettings
from mpirl.workers.rollout import RolloutSettings, RolloutWorker

MPIRL = [sys.executable, "-m", "mpirl"]
ppo = load_algorithm("PPO")
GAMMA = 0.9


def local_context(role):
    placement = Layout().resolve(1)
    return RankContext(0, role, 0, 1, placement, None, MPI.COMM_SELF, None,
                       socket.gethostname(), "cpu")


def rollout_worker(env_config, num_envs=2, max_env_failures=10, seed=0,
                   env_id="mpirl.testing:CountingEnv", env_failure_window=1000):
    spec = EnvSpec(env_id, env_config=env_config)
    policy = PolicySpec(*spec.spaces(), (8,), "tanh")
    # lambda 1: value targets of finished episodes are plain discounted returns.
    return RolloutWorker(local_context("rollout"), RolloutSettings(
        env=spec, policy=policy, num_envs=num_envs, seed=seed, gamma=GAMMA, lam=1.0,
        max_env_failures=max_env_failures, env_failure_window=env_failure_window))


def ppo_learner(context, policy):
    """A PPO learner of ``policy`` that averages over MPI (``context``'s role_comm)."""
    return Learner(context, LearnerSettings(policy=policy, loss=ppo.loss, loss_config=ppo.Config(),
                                            lr=1e-3, grad_clip=0.5, seed=0, backend="mpi"))


def discounted_returns(length):
    """Value targets of steps 0..length-1 of an episode paying 1 a step."""
    return [sum(GAMMA**j for j in range(length - k)) for k in range(length)]


def test_a_failed_step_drops_its_partial_episode_and_training_rows_go_on():
    # Episodes of 5 steps; each instance raises on its 8th step. Per env and instance: an
    # episode of steps 1-5 (kept), then steps 6, 7 and the failing 8 (dropped), then afresh.
    worker = rollout_worker({"episode_length": 5, "fail_every_steps": 8})

    first = worker.sample(12)  # instance steps 1-12: rows 0-4 kept, 5-7 dropped, 8-11 kept
    batch = first["batch"]
    assert len(batch["obs"]) == 2 * 9 < 2 * 12
    assert all(len(v) == 18 for v in batch.values())
    assert first["env_failures"] == 2 and first["env_steps"] == 2 * 12
    assert first["episode_returns"] == [5.0, 5.0] and first["episode_lengths"] == [5, 5]
    # Rows are [T, N] flattened time-major; both envs run the same schedule.
    np.testing.assert_array_equal(batch["obs"][:, 0], np.repeat([0, 1, 2, 3, 4, 0, 1, 2, 3], 2))
    np.testing.assert_allclose(batch["value_targets"][:10], np.repeat(discounted_returns(5), 2),
                               rtol=1e-5)

    # The live episode straddles fragments: its 5th step ends it here, and counts in full.
    second = worker.sample(12)
    batch = second["batch"]
    np.testing.assert_array_equal(batch["obs"][:, 0], np.repeat([4, 0, 1, 2, 3, 4], 2))
    assert second["env_failures"] == 4
    assert second["episode_returns"] == [5.0] * 4 and second["episode_lengths"] == [5] * 4
    np.testing.assert_allclose(batch["value_targets"], np.repeat([1.0, *discounted_returns(5)], 2),
                               rtol=1e-5)
    np.testing.assert_allclose(batch["advantages"] + batch["values"], batch["value_targets"],
                               rtol=1e-5, atol=1e-6)
    assert worker.env_failures == 6


def test_a_failed_reset_after_a_finished_episode_keeps_the_episode():
    # Every instance's second reset (its first autoreset) raises: the episode before it ended
    # normally, so it counts and its rows stay; the env is rebuilt and sampling goes on.
    worker = rollout_worker({"episode_length": 5, "fail_resets_after": 1})
    metrics = worker.sample(10)
    assert len(metrics["batch"]["obs"]) == 2 * 10
    assert metrics["env_failures"] == 4
    assert metrics["episode_returns"] == [5.0] * 4


def test_a_successful_step_resets_the_count_of_failures_in_a_row():
    # Every other step raises: 10 failures per env, but never 2 in a row (nor 2 within the
    # window of 2 steps; tests/test_env_guard_window.py has the window's own tests).
    worker = rollout_worker({"episode_length": 100, "fail_every_steps": 2}, max_env_failures=2,
                            env_failure_window=2)
    metrics = worker.sample(20)
    assert metrics["env_failures"] == 2 * 10
    assert len(metrics["batch"]["obs"]) == 0  # no episode got to finish
    assert metrics["episode_returns"] == []


def test_failures_in_a_row_raise_one_clear_error():
    worker = rollout_worker({"fail_every_steps": 1}, max_env_failures=3)
    with pytest.raises(EnvFailureError) as caught:
        worker.sample(10)
    message = str(caught.value)
    assert "'mpirl.testing:CountingEnv' failed 3 times in a row" in message
    assert "rollout worker 0 on rank 0" in message
    assert "InjectedFailure: injected failure in step 1" in message
    assert "--config '{\"max_env_failures\": 10}' (now 3)" in message


def test_an_env_that_never_resets_fails_when_the_worker_starts():
    with pytest.raises(EnvFailureError, match="injected failure in reset 1"):
        rollout_worker({"fail_resets_after": 0})


@pytest.mark.parametrize("value", [0, -1, 2.5, True])
def test_max_env_failures_must_be_a_whole_number_from_1(value):
    with pytest.raises(ConfigError, match='config key "max_env_failures" = .* is out of range: '
                                          'must be an integer >= 1'):
        ppo.Config(max_env_failures=value)


def test_rebuilt_envs_are_seeded_deterministically_and_pickle():
    def run():
        worker = rollout_worker({"fail_every_steps": 7}, num_envs=3, seed=5,
                                env_id="mpirl.testing:FlakyCartPoleEnv")
        worker.sample(30)
        return worker, worker.sample(30)

    (worker, a), (_, b) = run(), run()
    assert a["env_failures"] > 0
    np.testing.assert_array_equal(a["batch"]["obs"], b["batch"]["obs"])
    copy = pickle.loads(pickle.dumps(worker.envs))
    assert [env.failures_total for env in copy.envs] == [e.failures_total for e in worker.envs.envs]


def test_learner_trains_on_short_and_empty_batches():
    worker = rollout_worker({"episode_length": 5})
    policy = PolicySpec(*EnvSpec("mpirl.testing:CountingEnv").spaces(), (8,), "tanh")
    learner = ppo_learner(local_context("learner"), policy)
    batch = worker.sample(2)["batch"]
    short = {k: v[:3] for k, v in batch.items()}
    stats = learner.train([], [short], num_epochs=2, num_minibatches=8)
    assert stats["sgd_steps"] == 2 * 3 and stats["learner_samples"] == 3
    assert np.isfinite(stats["policy_loss"])
    empty = {k: v[:0] for k, v in batch.items()}
    assert learner.train([], [empty], num_epochs=2, num_minibatches=8) == {
        "sgd_steps": 0, "learner_samples": 0}


class PeerWithTenRows:
    """A learner communicator of two ranks, the other holding 10 rows and zero gradients."""

    def Get_size(self):
        return 2

    def allgather(self, value):
        return [value, 10]

    def Bcast(self, buffer, root=0):
        pass

    def Allreduce(self, send, receive, op=None):
        pass  # the peer adds zeros


def test_a_learner_short_of_rows_keeps_in_step_with_its_peers():
    # 3 rows here, 10 on the peer, 8 minibatches: this learner's share of 5 steps per epoch is
    # empty, yet it must take all 8 (each is an allreduce) without NaNs.
    context = dataclasses.replace(local_context("learner"), role_comm=PeerWithTenRows())
    policy = PolicySpec(*EnvSpec("mpirl.testing:CountingEnv").spaces(), (8,), "tanh")
    learner = ppo_learner(context, policy)
    before = learner.get_weights()
    batch = rollout_worker({"episode_length": 5}).sample(2)["batch"]
    stats = learner.train([], [{k: v[:3] for k, v in batch.items()}], num_epochs=2,
                          num_minibatches=8)
    assert stats["sgd_steps"] == 2 * 8 and stats["learner_samples"] == 3
    after = learner.get_weights()
    assert np.isfinite(after).all() and not np.array_equal(before, after)


def test_ppo_learns_cartpole_through_env_failures(tmp_path):
    # Each env instance raises on its 2000th step (a full-length episode is 500 steps).
    run_dir = tmp_path / "run"
    proc = run_mpi(3, *MPIRL, "train", "--algo", "PPO", "--env-module", "mpirl.testing",
                   "--env", "MpirlFlakyCartPole-v0", "--seed", "1", "--run-dir", str(run_dir),
                   "--stop", '{"episode_return_mean": 475, "timesteps_total": 150000}',
                   timeout=300, env={"CI": "true"})
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr}"
    result = json.loads((run_dir / "result.json").read_text())
    assert result["episode_return_mean"] >= 475, result
    assert result["num_env_failures"] > 0, result
    header = (run_dir / "progress.csv").read_text().splitlines()[0].split(",")
    assert "num_env_failures" in header
    assert "Traceback" not in proc.stderr
    assert "env failures" in proc.stdout  # the progress line shows the count
    # A warning when the first failures come, then at most one a minute per rollout rank.
    assert 1 <= proc.stderr.count("mpirl: warning:") <= 2 * (1 + result["time_total_s"] // 60)


@pytest.mark.parametrize("algo, env_id, where", [
    ("PPO", "MpirlBrokenResetCartPole-v0", "injected failure in reset 1"),  # as workers start
    ("PPO", "MpirlBrokenStepCartPole-v0", "injected failure in step 1"),    # in the first sample
    # Asynchronous plans have requests in flight on every rollout rank when the first fails: the
    # same one line, and no call is left waiting.
    ("IMPALA", "MpirlBrokenStepCartPole-v0", "injected failure in step 1"),
    ("A3C", "MpirlBrokenStepCartPole-v0", "injected failure in step 1"),
])
def test_an_env_that_always_fails_ends_the_run_with_one_error(tmp_path, algo, env_id, where):
    start = time.monotonic()
    proc = run_mpi(3, *MPIRL, "train", "--algo", algo, "--env-module", "mpirl.testing",
                   "--env", env_id, "--run-dir", str(tmp_path / "run"),
                   "--config", '{"max_env_failures": 4}', timeout=60, env={"CI": "true"})
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, f"{proc.stdout[-3000:]}\n{proc.stderr}"
    assert elapsed < 40, elapsed
    assert proc.stderr.count("max_env_failures") == 1, proc.stderr
    assert f"mpirl: environment {env_id!r} failed 4 times in a row" in proc.stderr
    assert "InjectedFailure: " + where in proc.stderr
    assert "Traceback" not in proc.stderr and "Remote traceback" not in proc.stderr
