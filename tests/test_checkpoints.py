"""Checkpoint-restart for real: kill -9 mid-run, resume, and compare with a run never stopped.

A synchronous algorithm on CPU with an unchanged layout must resume to bit-identical weights and
the same progress.csv rows. Signals checkpoint and exit with EXIT_RESUME; corrupt checkpoints are
skipped by name; checkpoints of another run are refused.
"""

import csv
import json
import os
import pickle
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
from conftest import BIN, LiveRun, mpi_env, rewound_copy, run_mpi
from conftest import latest_checkpoint_iteration as _latest_iteration

from mpirl.commands.train import make_request
from mpirl.errors import EXIT_RESUME, EXIT_USAGE, CheckpointError, ConfigError
from mpirl.jobs.checkpoint import CheckpointStore, verify

MPIRL = str(BIN / "mpirl")
#: Columns that depend only on the training itself (not on wall time).
DETERMINISTIC = ("iteration", "timesteps_total", "episodes_total", "episode_return_mean",
                 "policy_loss", "vf_loss", "approx_kl")


def _config(**extra):
    return json.dumps({"checkpoint_every": 3, "keep_checkpoints": 20, "print_layout": True,
                       **extra})


def _train(n, *args, timeout=120):
    if n == 1:
        import subprocess

        return subprocess.run([MPIRL, "train", *args], capture_output=True, text=True,
                              timeout=timeout, env=mpi_env())
    return run_mpi(n, MPIRL, "train", *args, timeout=timeout)


def _rows(run_dir: Path):
    with open(run_dir / "progress.csv") as file:
        return [{k: row[k] for k in DETERMINISTIC} for row in csv.DictReader(file)]


def _learner_state(run_dir: Path, iteration: int, index: int = 0):
    path = run_dir / "checkpoints" / f"checkpoint_{iteration:06d}" / f"learner_{index}.pkl"
    with open(path, "rb") as file:
        return pickle.load(file)


def _assert_same_learner(a, b):
    assert np.array_equal(a["weights"], b["weights"]), "weights differ"
    for (ka, va), (kb, vb) in zip(a["optimizer"]["state"].items(),
                                  b["optimizer"]["state"].items(), strict=True):
        assert ka == kb
        for name in va:
            assert np.array_equal(np.asarray(va[name]), np.asarray(vb[name])), name


REFERENCE_ITERATIONS = 12


@pytest.fixture(scope="module")
def reference_3_ranks(tmp_path_factory):
    """PPO on 3 ranks (learner in the driver, 2 rollout ranks) for 12 iterations, a checkpoint
    after each: the kill -9 test's reference, and the run the corrupt-checkpoint and the
    fewer-rollout-workers tests copy (never changed)."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    proc = _train(3, "--algo", "PPO", "--env", "CartPole-v1", "--run-dir", str(run_dir),
                  "--config", _config(checkpoint_every=1),
                  "--stop", json.dumps({"training_iteration": REFERENCE_ITERATIONS}))
    assert proc.returncode == 0, proc.stderr
    return run_dir


@pytest.mark.parametrize("n, extra, victim, stops", [
    # Learner in the driver, 2 rollout ranks.
    (3, {}, "driver", [(signal.SIGTERM, "driver")]),
    # A learner rank of its own and one rollout rank (the run above has two): a stop signal on
    # the learner, then one on the rollout rank.
    (3, {"num_learners": 1, "num_rollout_workers": 1}, "learner",
     [(signal.SIGUSR2, "learner"), (signal.SIGUSR1, "rollout")]),
], ids=["kill-driver-then-TERM-driver", "kill-learner-then-USR2-learner-then-USR1-rollout"])
def test_resume_after_kill_9_and_a_stop_signal_is_bit_identical(tmp_path, request, n, extra,
                                                                  victim, stops):
    """kill -9 of ``victim`` after a checkpoint at 3 or later; the run resumed from there (with
    no periodic checkpoints: checkpoint_every 0 given on resume) gets each of ``stops``'s signals
    on its rank of that role, one resume after another, after an iteration: it checkpoints that
    iteration and exits 75 (resume me), naming the rank and the command (the checks of a stop
    signal test that ran USR1 on a rollout rank on a run of its own). Each checkpoint a stop
    wrote is the uninterrupted run's at that iteration bit for bit, and so is every row of
    progress.csv up to it (the reference checkpoints every iteration). A resume from a stop's
    checkpoint: the learner case's second resume, after USR2."""
    total = REFERENCE_ITERATIONS
    interrupted = tmp_path / "interrupted"
    if not extra:  # the 3-rank run, shared with the corrupt-checkpoint test
        reference = request.getfixturevalue("reference_3_ranks")
    else:
        reference = tmp_path / "reference"
        proc = _train(n, "--algo", "PPO", "--env", "CartPole-v1", "--run-dir", str(reference),
                      "--config", _config(**extra, checkpoint_every=1),
                      "--stop", json.dumps({"training_iteration": total}))
        assert proc.returncode == 0, proc.stderr

    run = LiveRun(n, "--algo", "PPO", "--env", "CartPole-v1", "--run-dir", str(interrupted),
                  "--config", _config(**extra), "--stop", '{"training_iteration": 100000}')
    run.wait_until(lambda: _latest_iteration(interrupted) >= 3, "a checkpoint at iteration 3")
    pid = next(pid for role, pid in run.pids().values() if role == victim)
    os.kill(pid, signal.SIGKILL)
    assert run.finish() != 0
    killed_at = _latest_iteration(interrupted)
    assert killed_at < total - 2, "the run got past the comparison point before the kill took"

    stopped_at = killed_at
    for signum, stopped in stops:
        resumed_at = stopped_at
        run = LiveRun(n, "--resume", str(interrupted), "--config", '{"checkpoint_every": 0}',
                      "--stop", '{"training_iteration": 100000}')
        run.wait_until(lambda: len(_rows(interrupted)) > resumed_at,  # noqa: B023 (waited here)
                       "an iteration after the resume")
        assert f"resumed from {interrupted}/checkpoints/checkpoint_{resumed_at:06d}" in run.stdout
        rank, pid = next((rank, pid) for rank, (role, pid) in run.pids().items()
                         if role == stopped)
        os.kill(pid, signum)
        assert run.finish() == EXIT_RESUME, run.stderr
        assert f"{signal.Signals(signum).name} on rank {rank} ({stopped}" in run.stderr
        assert f"--resume {interrupted}" in run.stderr
        stopped_at = json.loads((interrupted / "result.json").read_text())["iteration"]
        assert resumed_at < stopped_at < total, "the stop came too late"
        assert _latest_iteration(interrupted) == stopped_at  # the checkpoint of the last iteration
        verify(interrupted / "checkpoints" / f"checkpoint_{stopped_at:06d}")
        _assert_same_learner(_learner_state(reference, stopped_at),
                             _learner_state(interrupted, stopped_at))
        # progress.csv continues where the checkpoint was: no gap, no repeated iteration.
        assert _rows(interrupted) == _rows(reference)[:stopped_at]


@pytest.fixture(scope="module")
def local_ppo(tmp_path_factory):
    """A local-mode PPO run of 8 iterations, checkpoints at 3 and 6: the reference of the local
    resume, and the run whose checkpoints the refusal tests copy or corrupt (never changed)."""
    run_dir = tmp_path_factory.mktemp("local") / "ppo"
    proc = _train(1, "--algo", "PPO", "--env", "CartPole-v1", "--run-dir", str(run_dir),
                  "--config", _config(num_envs_per_worker=4), "--stop",
                  '{"training_iteration": 8}')
    assert proc.returncode == 0, proc.stderr
    return run_dir


def test_local_mode_resume_is_bit_identical(tmp_path, local_ppo):
    """The local run rewound to its checkpoint at 3 (a copy: the later checkpoints and its
    result removed) and resumed with a new --stop of 9: its checkpoint at 6 and its rows up to 8
    are the uninterrupted run's."""
    reference, resumed = local_ppo, tmp_path / "resumed"
    rewound_copy(reference, resumed, 3)
    proc = _train(1, "--resume", str(resumed), "--stop", '{"training_iteration": 9}')
    assert proc.returncode == 0, proc.stderr
    assert "checkpoint_000003 (iteration 3" in proc.stdout
    # docs/checkpoints.md: the changes a resume makes are printed (a new --stop printed none).
    assert "\n  changed: --stop training_iteration 8 -> 9\n" in proc.stdout, proc.stdout
    _assert_same_learner(_learner_state(reference, 6), _learner_state(resumed, 6))
    assert _rows(resumed)[:8] == _rows(reference)
    assert len(_rows(resumed)) == 9


def test_corrupt_checkpoint_is_skipped_for_the_previous_one(tmp_path, reference_3_ranks):
    run_dir = tmp_path / "run"
    shutil.copytree(reference_3_ranks, run_dir)
    checkpoints = run_dir / "checkpoints"
    # What a kill -9 in the middle of a write leaves: a temporary directory, never renamed.
    partial = checkpoints / ".tmp-checkpoint_000013-99999"
    partial.mkdir()
    (partial / "learner_0.pkl").write_bytes(b"\x80\x05partial")
    # And the newest checkpoint damaged afterwards: one file truncated.
    learner = checkpoints / "checkpoint_000012" / "learner_0.pkl"
    learner.write_bytes(learner.read_bytes()[:1000])
    proc = _train(3, "--resume", str(run_dir), "--stop", '{"training_iteration": 14}')
    assert proc.returncode == 0, proc.stderr
    assert "skipping checkpoint checkpoint_000012" in proc.stderr
    assert "learner_0.pkl" in proc.stderr and "truncated" in proc.stderr
    assert "resumed from" in proc.stdout and "checkpoint_000011 (iteration 11" in proc.stdout
    assert [int(r["iteration"]) for r in _rows(run_dir)] == list(range(1, 15))
    assert not partial.exists()  # stale temporary directories are cleaned up


def test_every_checkpoint_corrupt_is_a_clear_error(tmp_path, local_ppo):
    run_dir = tmp_path / "run"
    shutil.copytree(local_ppo, run_dir)
    manifests = list((run_dir / "checkpoints").glob("checkpoint_*/manifest.json"))
    assert len(manifests) >= 2
    for manifest in manifests:
        manifest.write_text("{not json")
    proc = _train(1, "--resume", str(run_dir))
    assert proc.returncode == EXIT_USAGE
    assert "no valid checkpoint" in proc.stderr and "not valid JSON" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_checkpoint_of_another_run_is_refused(tmp_path, local_ppo):
    ppo, a2c = local_ppo, tmp_path / "a2c"
    proc = _train(1, "--algo", "A2C", "--env", "CartPole-v1", "--run-dir", str(a2c),
                  "--config", _config(num_envs_per_worker=2),
                  "--stop", '{"training_iteration": 3}')
    assert proc.returncode == 0, proc.stderr
    shutil.rmtree(a2c / "checkpoints")
    shutil.copytree(ppo / "checkpoints", a2c / "checkpoints")
    proc = _train(1, "--resume", str(a2c), "--stop", '{"training_iteration": 5}')
    assert proc.returncode == EXIT_USAGE
    assert "is a checkpoint of PPO on CartPole-v1, not of A2C" in proc.stderr
    # Naming another algorithm on the command line is refused before anything starts (by
    # make_request, in-process here; the refusal above went through the CLI).
    with pytest.raises(ConfigError, match="holds a PPO run on CartPole-v1, but --algo A2C was "
                                          "given"):
        make_request("A2C", None, None, {}, {}, None, None, resume=str(ppo))
    with pytest.raises(ConfigError, match="no such directory"):
        make_request(None, None, None, {}, {}, None, None, resume=str(tmp_path / "nowhere"))


def test_resume_onto_fewer_rollout_workers(tmp_path, reference_3_ranks):
    """The 3-rank reference rewound to its checkpoint at 3 (a copy: the checkpoints after it
    and its result removed, ``latest`` pointing at 3), resumed on 2 ranks."""
    run_dir = tmp_path / "run"
    rewound_copy(reference_3_ranks, run_dir, 3)
    proc = _train(2, "--resume", str(run_dir), "--stop", '{"training_iteration": 5}')
    assert proc.returncode == 0, proc.stderr
    assert "checkpoint_000003 (iteration 3" in proc.stdout
    assert "rollout workers 2 -> 1" in proc.stdout
    rows = _rows(run_dir)
    assert [int(r["iteration"]) for r in rows] == [1, 2, 3, 4, 5]
    # 2 workers x 8 envs x 64 steps per iteration, then 1 x 8 x 64.
    assert [int(r["timesteps_total"]) for r in rows] == [1024, 2048, 3072, 3584, 4096]


def test_interrupted_commit_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    """A crash between writing a checkpoint's files and renaming it into place."""
    store = CheckpointStore(tmp_path, keep=3)
    first = store.begin(1)
    (first / "a.bin").write_bytes(b"one")
    entry = {"sha256": __import__("hashlib").sha256(b"one").hexdigest(), "bytes": 3}
    store.commit(first, {"iteration": 1, "files": {"a.bin": entry}})
    second = store.begin(2)
    (second / "a.bin").write_bytes(b"two")

    def crash(*args):
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(os, "rename", crash)
    with pytest.raises(KeyboardInterrupt):
        store.commit(second, {"iteration": 2, "files": {"a.bin": entry}})
    monkeypatch.undo()
    path, manifest = store.newest_valid()
    assert path.name == "checkpoint_000001" and manifest["iteration"] == 1
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "checkpoint_000001"
    with pytest.raises(CheckpointError, match="SHA-256 does not match"):
        verify(second)  # never renamed, and not usable either


def test_kill_9_while_a_checkpoint_is_written(tmp_path):
    """A model big enough that writing a checkpoint takes a while; kill -9 the learner rank
    while the temporary directory exists. The resume uses the previous, complete checkpoint.
    Iterations of 32 steps: the model's size makes the write slow, not its training."""
    run_dir = tmp_path / "run"
    config = _config(num_learners=1, hidden_sizes=[1536, 1536], num_epochs=1,
                     num_envs_per_worker=2, rollout_fragment_length=16,
                     checkpoint_every=1, keep_checkpoints=2)
    run = LiveRun(3, "--algo", "PPO", "--env", "CartPole-v1", "--run-dir", str(run_dir),
                  "--config", config, "--stop", '{"training_iteration": 100000}')
    checkpoints = run_dir / "checkpoints"

    def writing():
        return _latest_iteration(run_dir) >= 1 and any(checkpoints.glob(".tmp-checkpoint_*"))

    run.wait_until(writing, "a checkpoint being written", timeout=120)
    pid = next(pid for role, pid in run.pids().values() if role == "learner")
    os.kill(pid, signal.SIGKILL)
    assert run.finish() != 0
    complete = _latest_iteration(run_dir)
    assert any(checkpoints.glob(".tmp-checkpoint_*")), "the kill did not land mid-write"
    proc = _train(3, "--resume", str(run_dir), "--stop",
                  json.dumps({"training_iteration": complete + 1}))
    assert proc.returncode == 0, proc.stderr
    assert f"checkpoint_{complete:06d} (iteration {complete}" in proc.stdout
    assert "skipping" not in proc.stderr  # the half-written one was never a candidate
    verify(checkpoints / f"checkpoint_{complete + 1:06d}")
