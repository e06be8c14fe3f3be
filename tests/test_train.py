"""`mpirl train` end to end under mpiexec: learning thresholds, outputs, envs, and bad input."""

import csv
import json
import subprocess
import sys

import pytest
from conftest import cli_in_process, mpi_env, run_mpi, train_refused_in_process

MPIRL = [sys.executable, "-m", "mpirl"]
REQUIRED_COLUMNS = {"iteration", "timesteps_total", "episode_return_mean", "episode_len_mean",
                    "env_steps_per_s", "time_total_s"}


def train(n, tmp_path, *args, timeout=300):
    run_dir = tmp_path / "run"
    command = [*MPIRL, "train", *args, "--run-dir", str(run_dir)]
    if n == 1:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env=mpi_env({"CI": "true"}))
    else:
        proc = run_mpi(n, *command, timeout=timeout, env={"CI": "true"})
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr}"
    result = json.loads((run_dir / "result.json").read_text())
    return proc, run_dir, result


def rows(run_dir):
    with open(run_dir / "progress.csv") as f:
        return list(csv.DictReader(f))


# The learning tests run seed 5: the defaults were chosen on seeds 0-4, on which PPO reached a
# 100-episode mean of 475 within 59k-136k steps and A2C 400 within 58k-151k, with 1 and with 2
# rollout ranks (benchmarks/learning.py --thresholds, benchmarks/RESULTS.md).
# PPO's learning test on 3 ranks, test_ppo_learns_cartpole_within_150k_steps, is in
# test_evaluate.py: its trained run is the checkpoint evaluate's tests play.


def test_ppo_with_two_learners_and_two_rollout_workers_learns_as_well(tmp_path):
    _, run_dir, result = train(
        5, tmp_path, "--algo", "PPO", "--env", "CartPole-v1", "--seed", "5",
        "--config", '{"num_learners": 2, "num_rollout_workers": 2}',
        "--stop", '{"episode_return_mean": 475, "timesteps_total": 150000}')
    assert result["episode_return_mean"] >= 475, result
    assert result["timesteps_total"] <= 150000
    assert json.loads((run_dir / "params.json").read_text())["layout"]["summary"].startswith(
        "driver 1, rollout 2, replay 0, learner 2")


def test_a2c_learns_cartpole_within_500k_steps(tmp_path):
    _, _, result = train(
        3, tmp_path, "--algo", "A2C", "--env", "CartPole-v1", "--seed", "5",
        "--stop", '{"episode_return_mean": 400, "timesteps_total": 500000}')
    assert result["episode_return_mean"] >= 400, result
    assert result["timesteps_total"] <= 500000


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """PPO in local mode, 3 iterations: checked itself, then plotted and not overwritten."""
    return train(1, tmp_path_factory.mktemp("local"), "--algo", "PPO", "--env", "CartPole-v1",
                 "--stop", '{"training_iteration": 3}')


def test_local_mode_trains_without_a_launcher(local_run):
    proc, _, result = local_run
    assert result["iteration"] == 3 and result["timesteps_total"] == 3 * 8 * 64
    assert "local mode" in proc.stdout


@pytest.mark.parametrize("env_args, config", [
    (["--env", "mpirl.testing:CorridorEnv"], {}),
    (["--env", "mpirl.testing:MultiCorridorEnv"], {}),
    (["--env-module", "mpirl.testing", "--env", "MpirlCorridor-v0"],
     {"normalize_observations": True}),
])
def test_custom_envs_and_action_spaces_train(tmp_path, env_args, config):
    # The corridor is solved by walking right: +1 minus 0.01 a step, so a return above 0.9.
    config = {"num_envs_per_worker": 4, "rollout_fragment_length": 32, **config}
    _, _, result = train(3, tmp_path, "--algo", "PPO", *env_args, "--config", json.dumps(config),
                         "--stop", '{"episode_return_mean": 0.9, "timesteps_total": 30000}')
    assert result["episode_return_mean"] >= 0.9, result


def test_box_actions_train_end_to_end(tmp_path):
    # 4 x 64 steps per env: long enough to finish Pendulum's 200-step episodes.
    _, run_dir, result = train(2, tmp_path, "--algo", "PPO", "--env", "Pendulum-v1",
                               "--stop", '{"training_iteration": 4}')
    assert result["iteration"] == 4 and result["episode_return_mean"] < 0  # Pendulum's costs


def test_plot_draws_the_runs(local_run, tmp_path):
    _, run_dir, _ = local_run
    out = tmp_path / "curve.png"
    proc = subprocess.run([*MPIRL, "plot", str(run_dir), str(run_dir), "-o", str(out)],
                          capture_output=True, text=True, timeout=120, env=mpi_env())
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_existing_run_is_never_overwritten(local_run, capsys):
    """Rank 0's check before anything starts, through the CLI's main in process (a usage error
    under mpiexec is one line on every rank: test_bad_input_is_one_clear_error_on_every_rank)."""
    _, run_dir, _ = local_run
    before = (run_dir / "progress.csv").read_bytes()
    code, stderr = cli_in_process(capsys, "train", "--algo", "PPO", "--env", "CartPole-v1",
                                  "--run-dir", str(run_dir))
    assert code == 2 and "Traceback" not in stderr, stderr
    assert "already holds a run (progress.csv, result.json); nothing was overwritten" in stderr
    assert (run_dir / "progress.csv").read_bytes() == before


BAD_INPUT = [
    (["--config", '{"num_epoch": 3}'], "Did you mean 'num_epochs'?"),
    (["--config", '{"lr": "fast"}'], 'config key "lr" = "fast" is out of range: must be a '
                                     'finite number > 0'),
    (["--env", "CartPol-v1"], "unknown environment id 'CartPol-v1'. Did you mean 'CartPole-v1'"),
    (["--algo", "PPPO"], "unknown algorithm 'PPPO': neither a built-in one (PPO, A2C, BC, MARWIL"),
    (["--stop", '{"reward": 10}'], "unknown --stop key 'reward'"),
]


@pytest.mark.parametrize("args, expected", BAD_INPUT)
def test_bad_input_is_one_clear_error(tmp_path, capsys, args, expected):
    """What the CLI checks before starting anything, through its main in process (exit 2, one
    line); end to end on every rank: the next test, and test_cli_outputs.py's one-line error
    under mpiexec."""
    stderr = train_refused_in_process(tmp_path, capsys, "--algo", "PPO", "--env", "CartPole-v1",
                                      *args)
    assert expected in stderr
    assert not (tmp_path / "run").exists()


# A bad config key under mpiexec -n 3, one line and nothing else, end to end:
# test_cli_outputs.py's test_an_error_under_mpiexec_is_one_line_without_open_mpis_note.
@pytest.mark.parametrize("args, expected", [
    (["--config", '{"num_rollout_workers": 5}'], "needs 6 ranks"),  # the world's size
])
def test_bad_input_is_one_clear_error_on_every_rank(tmp_path, args, expected):
    command = [*MPIRL, "train", "--algo", "PPO", "--env", "CartPole-v1", *args,
               "--run-dir", str(tmp_path / "run")]
    proc = run_mpi(3, *command, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("mpirl: error:") == 1, proc.stderr
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()
