"""Errors that used to pass silently are reported, each made to happen for real: environments that
cannot be pickled into a checkpoint, a rollout worker whose set_state could not restore them, and a
trajectory writer that never confirms its episodes (a stopped process)."""

import json
import os
import signal
import sys

import pytest
from conftest import latest_checkpoint_iteration, run_mpi
from test_env_failures import local_context

from mpirl.data import dump_writer as trajectories
from mpirl.data.dump_writer import DumpTarget, DumpWriterTimeout
from mpirl.errors import RemoteError, unwrap_remote
from mpirl.models.policy import PolicySpec
from mpirl.workers.env_spec import EnvSpec
from mpirl.workers.rollout import RolloutSettings, RolloutWorker

MPIRL = [sys.executable, "-m", "mpirl"]
LOCK_ERROR = "TypeError: cannot pickle '_thread.lock' object"


def worker(env_id, num_envs=2, dump=None):
    spec = EnvSpec(env_id, "mpirl.testing")
    return RolloutWorker(local_context("rollout"), RolloutSettings(
        env=spec, policy=PolicySpec(*spec.spaces(), (8,), "tanh"), num_envs=num_envs, seed=0,
        gamma=0.99, dump=dump))


def test_a_worker_reports_why_its_envs_were_not_saved_and_that_they_were_not_restored(tmp_path):
    saving = worker("MpirlUnpicklableCartPole-v0")
    saving.sample(10)
    entry = saving.save_state(str(tmp_path), "rollout_0.pkl")
    assert entry["envs_error"] == LOCK_ERROR
    assert worker("MpirlUnpicklableCartPole-v0").load_state(
        str(tmp_path / "rollout_0.pkl"), entry) is False
    fine = worker("CartPole-v1")
    entry = fine.save_state(str(tmp_path), "fine.pkl")
    assert "envs_error" not in entry
    assert worker("CartPole-v1").load_state(str(tmp_path / "fine.pkl"), entry) is True
    # Another num_envs_per_worker: saved, but reset all the same.
    assert worker("CartPole-v1", num_envs=3).load_state(str(tmp_path / "fine.pkl"), entry) is False


def test_unpicklable_envs_are_warned_about_at_the_checkpoint_and_at_the_resume(tmp_path):
    run_dir = tmp_path / "run"
    args = [*MPIRL, "train", "--env-module", "mpirl.testing", "--config",
            '{"checkpoint_every": 1}']
    proc = run_mpi(3, *args, "--algo", "PPO", "--env", "MpirlUnpicklableCartPole-v0",
                   "--run-dir", str(run_dir), "--stop", '{"training_iteration": 2}',
                   timeout=120, env={"CI": "true"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if "could not be pickled" in line]
    assert warnings == [  # once, though two checkpoints were written
        f"mpirl: warning: the environments of rollout_0, rollout_1 could not be pickled into "
        f"checkpoints ({LOCK_ERROR}); a resume resets them from fresh seeds, and their episodes "
        f"in progress are lost"], proc.stderr
    manifest = json.loads((run_dir / "checkpoints" / "checkpoint_000002" / "manifest.json")
                          .read_text())
    assert manifest["files"]["rollout_1.pkl"]["envs_error"] == LOCK_ERROR

    proc = run_mpi(3, *MPIRL, "train", "--resume", str(run_dir), "--stop",
                   '{"training_iteration": 3}', timeout=120, env={"CI": "true"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert latest_checkpoint_iteration(run_dir) == 3
    for i in (0, 1):
        assert (f"mpirl: warning: rollout worker {i}'s environments were reset from fresh seeds "
                f"instead of continuing their episodes: they could not be restored "
                f"({LOCK_ERROR})") in proc.stderr


def test_a_writer_that_never_confirms_its_episodes_is_an_error(tmp_path, monkeypatch):
    rollout = worker("CartPole-v1", dump=DumpTarget(str(tmp_path), 0))
    rollout.sample(100)  # whole episodes, sent to the writer and confirmed
    pid = rollout.recorder.writer.proc.pid
    os.kill(pid, signal.SIGSTOP)  # as if its file system hung
    try:
        rollout.sample(100)
        monkeypatch.setattr(trajectories, "WRITER_ACK_TIMEOUT_S", 1.0)
        with pytest.raises(DumpWriterTimeout) as caught:
            rollout.finish_dump()
    finally:
        os.kill(pid, signal.SIGKILL)
    message = str(caught.value)
    assert f"the trajectory writer of {tmp_path}/rollout-s0-w0.hdf5 (pid {pid}) has not " \
           f"confirmed" in message
    assert "after 1 s" in message and "not in the dump's index" in message


def test_the_driver_reports_a_writer_timeout_by_its_message_alone():
    remote = RemoteError(1, "rollout", "finish_dump", "mpirl.data.dump_writer.DumpWriterTimeout",
                         "the trajectory writer of x has not confirmed 2 batch(es)", "Traceback")
    local = unwrap_remote(remote, DumpWriterTimeout)
    assert type(local) is DumpWriterTimeout and str(local).startswith("the trajectory writer")
    assert unwrap_remote(remote) is remote
