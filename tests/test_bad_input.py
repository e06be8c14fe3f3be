"""Bad numbers in --config and --stop: one line naming the key, the value and the allowed range,
exit code 2, on every rank before any MPI traffic; never a traceback, never a run that cannot stop.

The table of what each bad input gets is in docs/checkpoints.md ("Bad input").
"""

import json
import math
import sys
import time

import pytest
from conftest import run_mpi

from mpirl.commands.match import MAX_GAMES_ENV, max_games_from_env
from mpirl.commands.train import make_request
from mpirl.config.fields import numeric_fields, range_of
from mpirl.config.parse import build, parse_json_object
from mpirl.data.dump_writer import DumpSettings
from mpirl.errors import ConfigError
from mpirl.execution.contract import ALGORITHMS, load_algorithm
from mpirl.execution.trainer import MAX_ITERATIONS_ENV, STOP_KEYS, max_iterations_from_env
from mpirl.jobs.checkpoint import CheckpointSettings
from mpirl.runtime.driver import RuntimeSettings
from mpirl.runtime.layout import Layout

MPIRL = [sys.executable, "-m", "mpirl"]
SETTINGS = (RuntimeSettings, CheckpointSettings, DumpSettings, Layout)
CLASSES = {**{name: load_algorithm(name).Config for name in ALGORITHMS},
           **{cls.__name__: cls for cls in SETTINGS}}
NUMERIC = [(name, key, kind) for name, cls in CLASSES.items()
           for key, kind in numeric_fields(cls).items()]


def test_the_numeric_keys_are_found():
    keys = {key for _, key, _ in NUMERIC}
    assert {"minibatch_size", "lr", "gamma", "hidden_sizes", "target_entropy", "seed",
            "task_timeout_s", "keep_checkpoints", "dump_compression_level",
            "num_rollout_workers", "env_failure_window"} <= keys
    assert len(keys) > 60


@pytest.mark.parametrize("name, key, kind", NUMERIC)
def test_every_numeric_key_has_a_range_that_its_default_satisfies(name, key, kind):
    cls = CLASSES[name]
    rng = range_of(cls, key)
    assert rng is not None, f"{name}.{key} has no entry in mpirl.config.fields.RANGES"
    default = next(f.default for f in __import__("dataclasses").fields(cls) if f.name == key)
    values = default if kind == "ints" else [default]
    assert all(rng.admits(v, kind in ("int", "ints")) for v in values), (name, key, default)


FLOATS = [(name, key) for name, key, kind in NUMERIC if kind in ("float", "words|float")]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("name, key", FLOATS)
def test_every_float_key_refuses_nan_and_infinity(name, key, value):
    with pytest.raises(ConfigError, match=f'config key "{key}" = -?(NaN|Infinity) is out of range'):
        build(CLASSES[name], {key: value})


@pytest.mark.parametrize("name, key, kind", [n for n in NUMERIC if n[2] != "words|float"])
def test_every_numeric_key_refuses_a_value_below_its_range(name, key, kind):
    rng = range_of(CLASSES[name], key)
    low = rng.low - 1 if math.isfinite(rng.low) else None
    for value in ([low] if low is not None else []) + ([2.5] if kind != "float" else []):
        given = [int(value) if value == int(value) else value] if kind == "ints" else value
        with pytest.raises(ConfigError, match=f'config key "{key}" = .* is out of range: must'):
            build(CLASSES[name], {key: given})


@pytest.mark.parametrize("algo, config, message", [
    ("PPO", {"minibatch_size": 0},
     'config key "minibatch_size" = 0 is out of range: must be an integer >= 1'),
    ("PPO", {"lr": math.nan}, 'config key "lr" = NaN is out of range: must be a finite number > 0'),
    ("PPO", {"gamma": 1.5},
     'config key "gamma" = 1.5 is out of range: must be a finite number in [0, 1]'),
    ("PPO", {"hidden_sizes": [64, 0]},
     'config key "hidden_sizes" = [64, 0] is out of range: must be a list of integers >= 1'),
    ("PPO", {"hidden_sizes": 64},
     'config key "hidden_sizes" = 64 is out of range: must be a list of integers >= 1'),
    ("PPO", {"seed": -1},
     'config key "seed" = -1 is out of range: must be an integer in [0, 4294967295]'),
    ("PPO", {"num_envs_per_worker": 2.5},
     'config key "num_envs_per_worker" = 2.5 is out of range: must be an integer >= 1'),
    ("DQN", {"final_epsilon": -0.1},
     'config key "final_epsilon" = -0.1 is out of range: must be a finite number in [0, 1]'),
    ("SAC", {"target_entropy": "high"},
     'config key "target_entropy" = "high" is out of range: must be a finite number or "auto"'),
    ("SAC", {"tau": 0}, 'config key "tau" = 0 is out of range: must be a finite number in (0, 1]'),
    ("IMPALA", {"max_requests_in_flight_per_worker": 0},
     'config key "max_requests_in_flight_per_worker" = 0 is out of range: must be an integer >= 1'),
    ("PPO", {"task_timeout_s": math.inf},
     'config key "task_timeout_s" = Infinity is out of range: must be a finite number > 0'),
    ("PPO", {"keep_checkpoints": 0},
     'config key "keep_checkpoints" = 0 is out of range: must be an integer >= 1'),
    ("PPO", {"dump_compression_level": 10},
     'config key "dump_compression_level" = 10 is out of range: must be an integer in [0, 9]'),
])
def test_make_request_names_the_key_the_value_and_the_range(tmp_path, algo, config, message):
    with pytest.raises(ConfigError) as caught:
        make_request(algo, "CartPole-v1", None, config, {}, None, str(tmp_path / "run"))
    assert str(caught.value) == message


@pytest.mark.parametrize("stop, message", [
    ({"timesteps_total": math.nan},
     '--stop criterion "timesteps_total" = NaN is out of range: must be a finite number > 0'),
    ({"episode_return_mean": math.inf},
     '--stop criterion "episode_return_mean" = Infinity is out of range: must be a finite '
     'number'),
    ({"training_iteration": 0},
     '--stop criterion "training_iteration" = 0 is out of range: must be a finite number > 0'),
    ({"time_total_s": -5},
     '--stop criterion "time_total_s" = -5 is out of range: must be a finite number > 0'),
    ({"timesteps_total": "100k"},
     '--stop criterion "timesteps_total" = "100k" is out of range: must be a finite number > 0'),
])
def test_stop_criteria_are_checked(tmp_path, stop, message):
    with pytest.raises(ConfigError) as caught:
        make_request("PPO", "CartPole-v1", None, {}, stop, None, str(tmp_path / "run"))
    assert str(caught.value) == message


def test_every_stop_criterion_refuses_nan():
    for key in STOP_KEYS:
        with pytest.raises(ConfigError, match=f'"{key}" = NaN'):
            make_request("PPO", "CartPole-v1", None, {}, {key: math.nan}, None, "unused")


def test_a_negative_return_is_a_valid_stop_criterion(tmp_path):
    request = make_request("SAC", "Pendulum-v1", None, {}, {"episode_return_mean": -200},
                           None, str(tmp_path / "run"))
    assert request.stop == {"episode_return_mean": -200}


#: Bad numbers the command line used to let through, and what they did then.
BAD_NUMBERS = [
    # Divided by zero on the driver after every rank had started (a traceback, exit 1).
    ("--config", '{"minibatch_size": 0}',
     'config key "minibatch_size" = 0 is out of range: must be an integer >= 1'),
    # json.loads accepts NaN: torch's Adam raised on the driver, a traceback.
    ("--config", '{"lr": NaN}',
     'config key "lr" = NaN is out of range: must be a finite number > 0'),
    # Never reached: the run went on until the allocation ended.
    ("--stop", '{"timesteps_total": NaN}',
     '--stop criterion "timesteps_total" = NaN is out of range: must be a finite number > 0'),
]


@pytest.mark.parametrize("flag, text, message", BAD_NUMBERS)
def test_bad_numbers_on_the_command_line_are_refused(tmp_path, flag, text, message):
    """What the CLI does with --config and --stop (parse_json_object, then make_request), in
    process; the next test runs one of them end to end on every rank."""
    parsed = parse_json_object(text, flag)
    config, stop = (parsed, {}) if flag == "--config" else ({}, parsed)
    with pytest.raises(ConfigError) as caught:
        make_request("PPO", "CartPole-v1", None, config, stop, None, str(tmp_path / "run"))
    assert str(caught.value) == message
    assert not (tmp_path / "run").exists()


def test_the_cli_refuses_bad_numbers_on_every_rank_at_once(tmp_path):
    flag, text, message = BAD_NUMBERS[1]
    start = time.monotonic()
    proc = run_mpi(3, *MPIRL, "train", "--algo", "PPO", "--env", "CartPole-v1",
                   "--run-dir", str(tmp_path / "run"), flag, text, timeout=90,
                   env={"CI": "true"})
    assert proc.returncode == 2, f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    # One line from rank 0 (then mpiexec's own note that a rank exited non-zero).
    assert proc.stderr.splitlines()[0] == f"mpirl: error: {message}", proc.stderr
    assert proc.stderr.count("mpirl:") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout == ""  # nothing started: no layout table, no progress
    assert not (tmp_path / "run").exists()
    assert time.monotonic() - start < 60


def test_a_bad_number_in_a_resumed_runs_params_is_refused_too(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "params.json").write_text(json.dumps(
        {"algo": "PPO", "env": "CartPole-v1", "config": {"num_epochs": 0}, "stop": {}}))
    with pytest.raises(ConfigError, match='"num_epochs" = 0 is out of range'):
        make_request(None, None, None, {}, {}, None, None, resume=str(run_dir))


def test_the_heartbeat_timeout_must_exceed_its_interval():
    # Raised by the heartbeat thread's constructor after MPI had started: a traceback per rank.
    with pytest.raises(ConfigError) as caught:
        build(RuntimeSettings, {"heartbeat_interval_s": 30})
    assert str(caught.value) == ('config key "heartbeat_timeout_s" = 20 is out of range: must be '
                                 'greater than heartbeat_interval_s (30)')


def test_an_unknown_learner_device_names_the_choices():
    with pytest.raises(ConfigError) as caught:
        build(RuntimeSettings, {"learner_device": "gpu"})
    assert str(caught.value) == ('config key "learner_device" must be one of auto, cpu, '
                                 "got 'gpu'")


def test_doctor_refuses_zero_pings_before_starting():
    # The median of no round trips raised StatisticsError (a traceback) after every rank started.
    proc = run_mpi(2, *MPIRL, "doctor", "--pings", "0", timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[0] == "mpirl: error: --pings must be >= 1, got 0"
    assert proc.stdout == ""


def test_a_run_directory_that_is_a_file_is_refused_and_kept(tmp_path):
    # It ended in a FileExistsError traceback from deep in the run lock (exit 1).
    taken = tmp_path / "notes.txt"
    taken.write_text("mine")
    proc = run_mpi(2, *MPIRL, "train", "--algo", "PPO", "--env", "CartPole-v1",
                   "--run-dir", str(taken), "--stop", '{"training_iteration": 1}', timeout=90,
                   env={"CI": "true"})
    assert proc.returncode == 2, f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert proc.stderr.splitlines()[0] == (
        f"mpirl: error: --run-dir {taken} is a file, not a directory; nothing was written. Give "
        f"a directory (it is made if missing), or leave --run-dir out for a fresh timestamped "
        f"one."), proc.stderr
    assert "Traceback" not in proc.stderr and taken.read_text() == "mine"


CAPS = [
    (max_iterations_from_env, MAX_ITERATIONS_ENV, "the most training iterations a run may take"),
    (max_games_from_env, MAX_GAMES_ENV, "the most games an evaluation may play"),
]


@pytest.mark.parametrize("text", ["0", "-3", "2.5", "ten", "1e3"])
@pytest.mark.parametrize("read, name, what", CAPS, ids=["iterations", "games"])
def test_a_cap_from_the_environment_that_is_not_a_positive_integer_is_refused(read, name, what,
                                                                              text):
    with pytest.raises(ConfigError) as caught:
        read({name: text})
    assert str(caught.value) == f"${name} must be a positive integer ({what}), got {text!r}"
    assert read({name: " 7 "}) == 7
    assert read({name: ""}) is None
    assert read({}) is None


def test_the_games_cap_plays_at_most_its_games_and_says_so(monkeypatch):
    import mpirl.commands.match as match

    played = []

    class Matches:
        def evaluate(self, checkpoint, manifest, opponent, games, simulations, seed):
            played.append(games)
            return {"games": games}

    monkeypatch.setattr(match, "checkpoint_matches", lambda path, warn: (Matches(), None, {}))
    warnings = []
    monkeypatch.setenv(MAX_GAMES_ENV, "2")
    assert match.evaluate_match("run", "minimax", 100, warn=warnings.append) == {"games": 2}
    assert warnings == ["MPIRL_MAX_GAMES=2: this evaluation plays 2 games, whatever --games says"]
    assert match.evaluate_match("run", "minimax", 1, warn=warnings.append) == {"games": 1}
    assert len(warnings) == 1  # under the cap: nothing to say
    monkeypatch.delenv(MAX_GAMES_ENV)
    assert match.evaluate_match("run", "minimax", 100, warn=warnings.append) == {"games": 100}
    assert played == [2, 1, 100]


@pytest.mark.parametrize("command", [
    ["train", "--run-dir", "RUN", "--algo", "PPO", "--env", "CartPole-v1"],
    ["tune", "--run-dir", "RUN", "--ranks-per-trial", "1", "--search", "random",
     "--num-samples", "1", "--", "--algo", "PPO", "--env", "CartPole-v1"],
], ids=["train", "tune"])
def test_the_cli_refuses_a_bad_iteration_cap_before_starting(tmp_path, command):
    command = [str(tmp_path / "run") if arg == "RUN" else arg for arg in command]
    proc = run_mpi(2, *MPIRL, *command, timeout=90,
                   env={"CI": "true", MAX_ITERATIONS_ENV: "ten"})
    assert proc.returncode == 2, f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert proc.stderr.splitlines()[0] == (
        "mpirl: error: $MPIRL_MAX_ITERATIONS must be a positive integer (the most training "
        "iterations a run may take), got 'ten'"), proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_misspelled_key_gets_the_close_match_and_where_the_keys_are_not_all_of_them(tmp_path):
    with pytest.raises(ConfigError) as caught:
        make_request("PPO", "CartPole-v1", None, {"num_env_per_worker": 8}, {}, None,
                     str(tmp_path / "run"))
    # It used to list every one of PPO's ~75 keys after the did-you-mean, on one line.
    assert str(caught.value) == ("unknown config key 'num_env_per_worker'. Did you mean "
                                 "'num_envs_per_worker' or 'num_rollout_workers'? Every config "
                                 "key is listed in docs/config-keys.md.")
    # A short list (the --stop criteria) is still spelled out.
    with pytest.raises(ConfigError, match="Known keys: .*timesteps_total"):
        make_request("PPO", "CartPole-v1", None, {}, {"timestep_total": 10}, None,
                     str(tmp_path / "run"))
