"""Callbacks: each hook runs on the rank its docstring names, custom metrics reach progress.csv,
a hook that raises ends the run with one line naming it, and a bad spec is one clear error."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import BIN, PROGRAMS, hook_log, hook_ranks, mpi_env, run_mpi

MPIRL = str(BIN / "mpirl")
SPEC = "callbacks_probe:Probe"


def train_args(run_dir: Path, spec: str = SPEC, **config) -> list[str]:
    config = {"callbacks": spec, "num_envs_per_worker": 2, "rollout_fragment_length": 64,
              "checkpoint_every": 2, **config}
    return ["train", "--algo", "PPO", "--env", "CartPole-v1", "--run-dir", str(run_dir),
            "--progress", "off", "--config", json.dumps(config),
            "--stop", '{"training_iteration": 3}']


def train(ranks: int, args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(PROGRAMS), **(env or {})}
    if ranks == 1:
        return subprocess.run([MPIRL, *args], capture_output=True, text=True, timeout=120,
                              env=mpi_env(env))
    return run_mpi(ranks, MPIRL, *args, timeout=120, env=env)


def rows(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "progress.csv") as file:
        return list(csv.DictReader(file))


@pytest.mark.parametrize("ranks", [1, 3])
def test_hooks_run_where_documented_and_metrics_reach_progress(tmp_path, ranks):
    probe, run_dir = tmp_path / "probe", tmp_path / "run"
    probe.mkdir()
    # -n 3: the driver, one rollout rank and one learner rank.
    proc = train(ranks, train_args(run_dir, num_learners=1 if ranks == 3 else 0),
                 env={"PROBE_DIR": str(probe)})
    assert proc.returncode == 0, proc.stderr
    log = hook_log(probe)
    ranks_of = hook_ranks(log)
    expected = ({"on_algorithm_init": {0}, "on_train_result": {0}, "on_checkpoint": {0},
                 "on_episode_end": {1}, "on_sample_end": {1}, "on_learn_on_batch": {2}}
                if ranks == 3 else
                dict.fromkeys(["on_algorithm_init", "on_train_result", "on_checkpoint",
                               "on_episode_end", "on_sample_end", "on_learn_on_batch"], {0}))
    assert ranks_of == expected
    counts = {hook: sum(e["hook"] == hook for e in log) for hook in expected}
    assert counts["on_algorithm_init"] == 1 and counts["on_train_result"] == 3
    assert counts["on_sample_end"] == counts["on_learn_on_batch"] == 3
    checkpoints = [e for e in log if e["hook"] == "on_checkpoint"]
    assert [Path(e["checkpoint"]).name for e in checkpoints] == ["checkpoint_000002",
                                                                "checkpoint_000003"]
    assert all(e["exists"] for e in checkpoints)
    samples = [e for e in log if e["hook"] == "on_sample_end"]
    # CartPole's MLP policy acts in NumPy; a rollout rank of its own never imports torch.
    assert {e["actor"] for e in samples} == {"NumpyPolicy"}, samples
    assert {e["torch_loaded"] for e in samples} == {ranks == 1}, samples
    table = rows(run_dir)
    assert len(table) == 3
    for row in table:
        # The custom metric is each episode's length: its window mean is episode_len_mean.
        assert math.isclose(float(row["custom/length_copy_mean"]),
                            float(row["episode_len_mean"]), rel_tol=1e-9)
        assert int(float(row["iteration_twice"])) == 2 * int(row["iteration"])
    episodes = sum(e["hook"] == "on_episode_end" for e in log)
    assert episodes == int(table[-1]["episodes_total"])
    assert json.loads((run_dir / "result.json").read_text())["iteration_twice"] == 6


@pytest.mark.parametrize(("hook", "where", "ranks"), [
    ("on_episode_end", "rollout worker 0 on rank 1", 3),
    ("on_learn_on_batch", "learner 0 on rank 2", 3),
    ("on_train_result", "driver", 3),
    ("on_sample_end", "rollout worker 0 on rank 0", 1),
])
def test_a_raising_hook_ends_the_run_with_one_line(tmp_path, hook, where, ranks):
    proc = train(ranks, train_args(tmp_path / "run", num_learners=1 if ranks == 3 else 0),
                 env={"CALLBACK_RAISE": hook})
    assert proc.returncode == 1, proc.stderr
    assert f"callbacks: Probe.{hook} raised ValueError: boom ({where})" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(("spec", "message"), [
    ("no_such_module:Probe", "callbacks 'no_such_module:Probe': no module named "
                             "'no_such_module'"),
    ("callbacks_probe:Missing", "module callbacks_probe has no class Missing"),
    ("callbacks_probe:NotCallbacks", "NotCallbacks is not a subclass of mpirl.Callbacks"),
    ("callbacks_probe", "give it as 'module:Class'"),
])
def test_a_bad_spec_is_one_clear_error(tmp_path, monkeypatch, spec, message):
    """In-process: make_request, which ``mpirl train`` calls before anything starts (end to
    end: test_a_bad_spec_ends_the_cli_with_one_line)."""
    from mpirl.commands.train import make_request
    from mpirl.errors import ConfigError

    monkeypatch.syspath_prepend(str(PROGRAMS))  # as the CLI's PYTHONPATH gives it
    config = {"callbacks": spec, "num_envs_per_worker": 2}
    with pytest.raises(ConfigError) as raised:
        make_request("PPO", "CartPole-v1", None, config, {"training_iteration": 3}, None,
                     str(tmp_path / "run"))
    assert raised.value.exit_code == 2
    assert message in str(raised.value), str(raised.value)
    assert not (tmp_path / "run").exists()


def test_a_bad_spec_ends_the_cli_with_one_line(tmp_path):
    proc = train(1, train_args(tmp_path / "run", spec="callbacks_probe:Missing"))
    assert proc.returncode == 2, proc.stderr
    assert "module callbacks_probe has no class Missing" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("ranks", "raising", "where"), [
    (1, None, ""),
    (3, None, "rollout on rank 1: "),  # rollout ranks build theirs first
    (3, "2", "learner on rank 2: "),
    (3, "0", ""),  # the driver's own instance
])
def test_a_raising_constructor_is_one_clear_error(tmp_path, ranks, raising, where):
    env = {} if raising is None else {"CALLBACK_INIT_RAISE": raising}
    proc = train(ranks, train_args(tmp_path / "run", spec="callbacks_probe:Boom",
                                   num_learners=1 if ranks == 3 else 0), env=env)
    assert proc.returncode == 2, proc.stderr
    assert (f"mpirl: {where}callbacks 'callbacks_probe:Boom': Boom() raised RuntimeError: no "
            f"licence server. mpirl calls Boom() with no arguments on every rank that runs a "
            f"hook") in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("mpirl: ") == 1, proc.stderr


def test_a_metric_first_reported_later_gains_its_column_and_keeps_it_on_resume(tmp_path):
    run_dir = tmp_path / "run"
    # -n 2: the driver and one rollout rank, whose third sample call (iteration 3) is the first
    # to report custom/late_mean.
    proc = train(2, train_args(run_dir, spec="callbacks_probe:LateMetric",
                               num_envs_per_worker=4))  # episodes end in every iteration
    assert proc.returncode == 0, proc.stderr
    first = rows(run_dir)
    assert [row["custom/late_mean"] for row in first] == ["", "", "1.0"]
    assert not list(run_dir.glob(".progress.csv*"))  # no temporary file left behind
    # The resumed rank counts its sample calls from 0: the window's episodes keep the mean.
    resumed = train(2, ["train", "--resume", str(run_dir), "--progress", "off",
                        "--stop", '{"training_iteration": 5}'])
    assert resumed.returncode == 0, resumed.stderr
    table = rows(run_dir)
    assert [int(row["iteration"]) for row in table] == [1, 2, 3, 4, 5]
    assert [row["custom/late_mean"] for row in table] == ["", "", "1.0", "1.0", "1.0"]
    assert list(table[0]) == list(first[0])  # the same columns, in the same order


def test_python_api_takes_a_class(tmp_path):
    program = ("import sys, mpirl\n"
               "from callbacks_probe import Probe\n"
               "row = mpirl.train('PPO', 'CartPole-v1', callbacks=Probe, run_dir=sys.argv[1],\n"
               "                  stop={'training_iteration': 2}, progress='off')\n"
               "print('ROW', row['iteration_twice'], 'custom/length_copy_mean' in row)\n")
    proc = subprocess.run([sys.executable, "-c", program, str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=120,
                          env=mpi_env({"PYTHONPATH": str(PROGRAMS)}))
    assert proc.returncode == 0, proc.stderr
    assert "ROW 4 True" in proc.stdout
