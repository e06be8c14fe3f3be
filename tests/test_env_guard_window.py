"""An environment that fails every k steps, with successes between, must still end the run:
max_env_failures failures within env_failure_window steps of one sub-env count, not only failures
in a row. The envs raise for real (mpirl.testing's FailureSchedule)."""

import json
import sys

import pytest
from conftest import run_mpi
from test_env_failures import rollout_worker

from mpirl.errors import ConfigError, EnvFailureError
from mpirl.workers.env_guard import GuardedEnv
from mpirl.workers.env_spec import EnvSpec

MPIRL = [sys.executable, "-m", "mpirl"]


def test_an_env_failing_every_third_step_ends_sampling_with_one_clear_error():
    # Never two failures in a row, so the old rule (a success resets the count) never fired.
    worker = rollout_worker({"episode_length": 1000, "fail_every_steps": 3}, max_env_failures=4)
    with pytest.raises(EnvFailureError) as caught:
        worker.sample(100)
    message = str(caught.value)
    assert "'mpirl.testing:CountingEnv' failed 4 times within 10 steps" in message
    assert "sub-env 0 of rollout worker 0 on rank 0" in message
    assert "max_env_failures 4 within env_failure_window 1000 steps end the run" in message
    assert "InjectedFailure: injected failure in step 3" in message


def guarded(fail_every_steps, max_failures, window):
    env = GuardedEnv(EnvSpec("mpirl.testing:CountingEnv",
                             env_config={"episode_length": 10_000,
                                         "fail_every_steps": fail_every_steps}),
                     max_failures, window=window)
    env.reset(seed=0)
    return env


def test_the_window_is_in_steps_of_the_sub_env_and_its_edge_is_exact():
    # Each instance fails in its 5th step: steps 5, 10, 15, ... of the sub-env. So 3 failures
    # span 11 steps: a window of 11 ends it at step 15, one of 10 never does.
    env = guarded(5, max_failures=3, window=11)
    for _ in range(14):
        env.step(0)
    with pytest.raises(EnvFailureError, match="failed 3 times within 11 steps"):
        env.step(0)
    assert env.steps == 15 and env.failures_total == 3
    env = guarded(5, max_failures=3, window=10)
    for _ in range(1000):
        env.step(0)
    assert env.failures_total == 200  # 2 within any 10 steps: tolerated


def test_failures_in_a_row_still_end_it_whatever_the_window():
    env = guarded(1, max_failures=3, window=1)
    with pytest.raises(EnvFailureError, match="failed 3 times in a row"):
        for _ in range(3):
            env.step(0)


@pytest.mark.parametrize("window", [0, -5, 1.5])
def test_the_window_must_be_a_whole_number_from_1(window):
    with pytest.raises(ConfigError, match='"env_failure_window" = .* must be an integer >= 1'):
        guarded(5, 3, window)


def test_a_run_on_an_env_failing_every_50_steps_ends_with_the_env_failure_error(tmp_path):
    # Before the window, this run trained to its stop criterion and exited 0 with 1,600 env
    # failures; now the tenth failure within 1,000 steps of a sub-env ends it.
    proc = run_mpi(2, *MPIRL, "train", "--algo", "PPO", "--env-module", "mpirl.testing",
                   "--env", "MpirlFailEvery50CartPole-v0", "--run-dir", str(tmp_path / "run"),
                   "--stop", json.dumps({"timesteps_total": 80_000}), timeout=120,
                   env={"CI": "true"})
    assert proc.returncode == 1, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "mpirl: environment 'MpirlFailEvery50CartPole-v0' failed 10 times within 451 steps" \
        in proc.stderr
    assert "InjectedFailure: injected failure in step 50" in proc.stderr
    assert proc.stderr.count("mpirl: environment") == 1  # one message, from rank 0
    assert "Traceback" not in proc.stderr
    progress = (tmp_path / "run" / "progress.csv").read_text().splitlines()
    assert len(progress) < 10  # ended within the first 1,000 steps of each sub-env
