"""Replay plans' configuration and exit paths: ``checkpoint_replay`` off and on, DQN with two
learner ranks, an Ape-X run ending with weight posts in flight, and the SGD-step debt (DQN) and
count (Ape-X) across a resume."""

import csv
import json
import pickle
import time

import numpy as np
import pytest
from conftest import run_mpi
from test_train import MPIRL, train

DQN = ["--algo", "DQN", "--env", "CartPole-v1", "--seed", "0"]
#: Local mode, small network: 256 env steps per iteration, training from 512 steps on.
SMALL = {"num_envs_per_worker": 4, "rollout_fragment_length": 64, "hidden_sizes": [64, 64],
         "learning_starts": 512, "checkpoint_every": 2, "keep_checkpoints": 10}


def _rows(run_dir):
    with open(run_dir / "progress.csv") as file:
        return list(csv.DictReader(file))


def _checkpoint(run_dir, iteration):
    return run_dir / "checkpoints" / f"checkpoint_{iteration:06d}"


def _load(path):
    return pickle.loads(path.read_bytes())


def _resume(run_dir, stop, n=1):
    command = [*MPIRL, "train", "--resume", str(run_dir), "--stop",
               json.dumps({"training_iteration": stop})]
    if n == 1:
        import subprocess

        from conftest import mpi_env
        proc = subprocess.run(command, capture_output=True, text=True, timeout=180,
                              env=mpi_env({"CI": "true"}))
    else:
        proc = run_mpi(n, *command, timeout=180, env={"CI": "true"})
    assert proc.returncode == 0, proc.stderr
    return proc


def test_checkpoint_without_replay_is_smaller_and_the_resumed_run_refills_first(tmp_path):
    full_dir, bare_dir = tmp_path / "full", tmp_path / "bare"
    for run_dir, keep in ((full_dir, True), (bare_dir, False)):
        config = {**SMALL, "checkpoint_replay": keep}
        _, _, result = train(1, run_dir, *DQN, "--config", json.dumps(config),
                             "--stop", '{"training_iteration": 4}')
        assert result["iteration"] == 4
    full, bare = _checkpoint(full_dir / "run", 4), _checkpoint(bare_dir / "run", 4)
    assert (full / "replay_0.pkl").is_file() and not list(bare.glob("replay_*"))
    assert json.loads((bare / "manifest.json").read_text())["layout"] == {
        "learner": 1, "rollout": 1}
    size = {c: sum(f.stat().st_size for f in c.iterdir()) for c in (full, bare)}
    replay_bytes = (full / "replay_0.pkl").stat().st_size
    assert size[bare] < size[full] - replay_bytes // 2, size
    # The default keeps the shard's rows, and a resumed run goes on with them.
    assert _load(full / "replay_0.pkl")["written"].sum() == 4 * 256
    proc = _resume(full_dir / "run", 6)
    assert "replay workers start empty" not in proc.stdout
    assert _load(_checkpoint(full_dir / "run", 6) / "replay_0.pkl")["written"].sum() == 6 * 256
    assert [float(r["sgd_steps"]) for r in _rows(full_dir / "run")[4:]] == [128.0, 128.0]

    # Without replay: the buffer starts empty and training waits until learning_starts (512)
    # new steps are stored again: iteration 5 only samples, 6 trains on the refilled buffer.
    proc = _resume(bare_dir / "run", 7)
    assert "replay workers start empty (none in the checkpoint)" in proc.stdout, proc.stdout
    sgd = [float(r["sgd_steps"]) for r in _rows(bare_dir / "run")]
    assert sgd[2:4] == [128.0, 128.0] and np.isnan(sgd[4]) and sgd[5:] == [128.0, 128.0], sgd
    learner = _load(_checkpoint(bare_dir / "run", 6) / "learner_0.pkl")
    assert learner["updates"] == 4 * 128


def test_sgd_step_debt_carries_over_a_resume(tmp_path):
    # 0.3 SGD steps per env step: 76.8 per 256-step iteration, so the fraction owed carries
    # from iteration to iteration (76, 77, 77, 77, 76, ...). It is in the checkpoint: a resumed
    # run takes exactly the SGD steps of one never stopped (before, the fraction was lost and
    # iteration 4 took 76 steps, not 77). The resumed run is bit-identical: its environments
    # continue their episodes, so the streams are not cut at the restore and the replay shard
    # holds exactly the rows of the run never stopped (before, the last row of every stream
    # lost its transition and the weights differed).
    #
    # The debt is the plan's own (``ReplayState``), in driver.pkl under "plan".
    config = {**SMALL, "learning_starts": 256, "sgd_steps_per_env_step": 0.3}
    runs = reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    for run_dir, stop in ((reference, 6), (resumed, 3)):
        train(1, run_dir, *DQN, "--config", json.dumps({**config, "checkpoint_every": 3}),
              "--stop", json.dumps({"training_iteration": stop}))
    driver = _load(_checkpoint(resumed / "run", 3) / "driver.pkl")
    assert driver["plan"] == {"sgd_step_debt": pytest.approx(3 * 256 * 0.3 % 1.0),
                              "replay_empty_at": 0}
    assert driver["plan"]["sgd_step_debt"] > 0
    _resume(resumed / "run", 6)
    steps = [[float(r["sgd_steps"]) for r in _rows(d / "run")] for d in runs]
    assert steps[0] == steps[1] and sum(steps[0]) == int(6 * 256 * 0.3), steps
    a, b = (_load(_checkpoint(d / "run", 6) / "learner_0.pkl") for d in runs)
    assert a["updates"] == b["updates"] == int(6 * 256 * 0.3)
    assert np.array_equal(a["weights"], b["weights"])
    assert np.array_equal(a["target"], b["target"])
    shards = [_load(_checkpoint(d / "run", 6) / "replay_0.pkl") for d in (reference, resumed)]
    for key in ("obs", "actions", "rewards", "flags", "written"):
        assert np.array_equal(shards[0][key], shards[1][key]), key
    driver = _load(_checkpoint(resumed / "run", 6) / "driver.pkl")
    assert driver["plan"]["sgd_step_debt"] == pytest.approx(6 * 256 * 0.3 % 1.0)
    assert "sgd_step_debt" not in driver


def test_dqn_with_two_learner_ranks_keeps_them_identical(tmp_path):
    """Two DQN learner ranks, 4 iterations of 256 env steps (training from 1,000 steps on: in
    iteration 4). DQN's learning is test_dqn.py's (in local mode and on a learner rank with
    replay shards); that the shared gradient (``share_gradient``, which DQN's learners call as
    PPO's do) learns on two learner ranks is test_train.py's PPO test. This run had a stop at a
    100-episode mean of 100 within 15,000 steps too: 26 CPU-s for the same identity check."""
    config = {"num_learners": 2, "num_rollout_workers": 1, "checkpoint_every": 2}
    _, run_dir, result = train(4, tmp_path, *DQN, "--config", json.dumps(config),
                               "--stop", '{"training_iteration": 4}', timeout=240)
    assert result["iteration"] == 4, result
    checkpoint = _checkpoint(run_dir, 4)
    assert json.loads((checkpoint / "manifest.json").read_text())["layout"] == {
        "learner": 2, "rollout": 1, "replay": 1}
    first, second = (_load(checkpoint / f"learner_{i}.pkl") for i in (0, 1))
    # Data-parallel SGD: each learner trains on half of every minibatch, the gradients are
    # averaged, and both hold the same weights, target network and step count.
    assert first["updates"] == second["updates"] > 0
    assert np.array_equal(first["weights"], second["weights"])
    assert np.array_equal(first["target"], second["target"])
    # The weights moved from the ones both started with (checkpoint 2: before any update).
    start = _load(_checkpoint(run_dir, 2) / "learner_0.pkl")
    assert start["updates"] == 0 and not np.array_equal(start["weights"], first["weights"])


def test_apex_exits_cleanly_with_weight_posts_in_flight(tmp_path):
    # One seed (a second, run on every commit, doubled the cost and never failed alone).
    seed = 1
    # Learner 0 posts its weights (1 MB: sent by rendezvous, not eagerly) to both rollout ranks
    # after every SGD step, and the run stops a moment after training starts: posts are still
    # unreceived when the stop criterion is met. The job must end at once, exit 0.
    config = {"num_rollout_workers": 2, "num_replay_shards": 1, "num_learners": 1,
              "learning_starts": 256, "batches_per_train": 2, "weight_sync_every": 1,
              "throttle_sampling": False, "min_env_steps_per_iteration": 256,
              "hidden_sizes": [512, 512]}
    start = time.monotonic()
    proc, run_dir, result = train(5, tmp_path, "--algo", "APEX", "--env", "CartPole-v1",
                                  "--seed", str(seed), "--config", json.dumps(config),
                                  "--stop", '{"timesteps_total": 2500}', timeout=120)
    elapsed = time.monotonic() - start
    assert result["timesteps_total"] >= 2500
    assert "Traceback" not in proc.stderr and "mpirl: lost" not in proc.stderr, proc.stderr
    learner = _load(_checkpoint(run_dir, result["iteration"]) / "learner_0.pkl")
    assert learner["updates"] > 0 and learner["posted"] == learner["updates"]
    print(f"Ape-X seed {seed}: {elapsed:.1f} s from launch to exit, "
          f"{learner['updates']} SGD steps, each followed by a weight post")


def test_apex_resumes_with_its_sgd_step_count(tmp_path):
    # Ape-X paces sampling against the SGD steps its learner has taken. A resumed run that
    # counted them from 0 again took them all a second time while sampling waited (here 1,728
    # learner updates where the pacing allows 1,248).
    config = {"num_rollout_workers": 1, "num_replay_shards": 1, "num_learners": 1,
              "learning_starts": 256, "min_env_steps_per_iteration": 512,
              "hidden_sizes": [64, 64], "checkpoint_every": 3, "keep_checkpoints": 10}
    _, run_dir, result = train(4, tmp_path, "--algo", "APEX", "--env", "CartPole-v1",
                               "--config", json.dumps(config),
                               "--stop", '{"training_iteration": 3}', timeout=120)
    before = int(float(_rows(run_dir)[-1]["sgd_steps_total"]))
    assert before > 0
    _resume(run_dir, 6, n=4)
    progress = _rows(run_dir)
    counts = [int(float(r["sgd_steps_total"])) for r in progress]
    assert [int(r["iteration"]) for r in progress] == list(range(1, 7))
    assert counts == sorted(counts) and counts[-1] > before, counts
    # The driver's count is the learner's: every training call started was trained.
    learner = _load(_checkpoint(run_dir, 6) / "learner_0.pkl")
    assert learner["updates"] == counts[-1], (learner["updates"], counts)
