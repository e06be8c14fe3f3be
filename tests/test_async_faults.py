"""Faults for real in the asynchronous algorithms (IMPALA, A3C), whose driver keeps requests in
flight on every rollout rank: a rollout rank killed with kill -9 must never hang the driver.

As for PPO (tests/test_ulfm.py, tests/test_failures.py): under ULFM (``mpiexec --with-ft ulfm``,
``survive_rollout_loss`` on by default) the run goes on without the rank and reaches its stop
criterion in the same job; without ULFM the job ends within a bounded time with a non-zero exit
naming the dead rank, and ``mpirl train --resume`` continues from the last checkpoint.
"""

import csv
import json
import os
import signal
import time

import pytest
from conftest import BIN, LiveRun, assert_every_rank_ended, latest_checkpoint_iteration, run_mpi

MPIRL = str(BIN / "mpirl")
#: Small iterations so that a test takes seconds: 1000 env steps per row of metrics.
CONFIG = {"IMPALA": {"min_steps_per_iteration": 1000, "train_batch_size": 400},
          "A3C": {"min_steps_per_iteration": 1000}}
# Fragments streamed to the learner, which pushes the weights back (FragmentStream).
CONFIG["IMPALA-streamed"] = {**CONFIG["IMPALA"], "fragments_per_call": 2}
# Chunks streamed to a shard by calls that span iterations (StreamedReplayLoop).
CONFIG["APEX-streamed"] = {"min_env_steps_per_iteration": 200, "fragments_per_call": 2,
                           "num_replay_shards": 1}
END_LIMIT_S = 30  # from the kill to the end of the job, without ULFM


def _rows(run_dir):
    with open(run_dir / "progress.csv") as file:
        return list(csv.DictReader(file))


@pytest.mark.parametrize("algo, n, layout", [
    ("IMPALA", 4, {}),                       # learner in the driver's process, 3 rollout ranks
    ("IMPALA", 5, {"num_learners": 1}),      # learner rank 4 receives the fragments
    ("A3C", 4, {}),
    ("IMPALA-streamed", 5, {"num_learners": 1}),  # its pushes to the dead rank are dropped
    ("APEX-streamed", 6, {"num_learners": 1}),  # the dead rank's call never answers
], ids=["IMPALA", "IMPALA-learner-rank", "A3C", "IMPALA-streamed-learner-rank",
        "APEX-streamed"])
def test_async_run_goes_on_without_a_rollout_rank_killed_under_ulfm(tmp_path, monkeypatch, algo,
                                                                     n, layout):
    # 3 rollout ranks, each with requests in flight when rank 2 is killed after 2 iterations.
    # The run must reach its stop criterion (12 iterations) in the same job.
    # Before the fix, the driver's poll for stop signals (a probe from any source) could be the
    # first MPI call to see the failure and raise: the job ended with exit 70 (2 runs in 8).
    monkeypatch.setenv("CI", "true")  # plain lines: no live display capturing stderr
    run_dir = tmp_path / "run"
    config = {**CONFIG[algo], **layout, "num_rollout_workers": 3, "checkpoint_every": 0}
    run = LiveRun(n, "--algo", algo.split("-")[0], "--env", "CartPole-v1", "--run-dir",
                  str(run_dir),
                  "--config", json.dumps(config), "--stop", '{"training_iteration": 12}',
                  ulfm=True)
    killed_at = run.kill_rollout_rank(run_dir)
    pids = run.pids()
    code = run.finish(timeout=90)
    elapsed = time.monotonic() - killed_at
    err = run.stderr
    assert code == 0, f"exit {code}\n{err}"
    assert "mpirl: lost rank 2 (rollout 1) on " in err and f"(pid {pids[2][1]})" in err, err
    assert "continuing with 2 rollout workers" in err and err.count("mpirl: lost") == 1, err
    assert "Traceback" not in err, err
    result = json.loads((run_dir / "result.json").read_text())
    assert result["iteration"] == 12, result
    assert result["rollout_ranks_lost"] == 1 and result["num_rollout_workers"] == 2, result
    progress = _rows(run_dir)
    assert [int(r["iteration"]) for r in progress] == list(range(1, 13))
    workers = [int(r["num_rollout_workers"]) for r in progress]
    assert workers[0] == 3 and workers[-1] == 2, workers
    if algo != "APEX-streamed":  # the lost rank's requests are no longer counted in flight
        assert float(progress[-1]["requests_in_flight"]) <= 2 * config.get(
            "max_requests_in_flight_per_worker", 1 if algo == "A3C" else 2)
    assert_every_rank_ended([pid for _, pid in pids.values()])
    print(f"{algo}: kill -9 to the end of the run: {elapsed:.1f} s")


@pytest.mark.parametrize("algo", ["IMPALA", "A3C"])
def test_async_run_ends_on_a_killed_rollout_rank_and_resumes_without_ulfm(tmp_path, algo):
    run_dir = tmp_path / "run"
    config = {**CONFIG[algo], "checkpoint_every": 1, "keep_checkpoints": 5}
    run = LiveRun(3, "--algo", algo.split("-")[0], "--env", "CartPole-v1", "--run-dir",
                  str(run_dir),
                  "--config", json.dumps(config), "--stop", '{"training_iteration": 100000}')
    run.wait_until(lambda: latest_checkpoint_iteration(run_dir) >= 2, "a checkpoint")
    pids = run.pids()
    assert pids[2][0] == "rollout"
    killed_at = time.monotonic()
    os.kill(pids[2][1], signal.SIGKILL)
    code = run.finish(timeout=90)
    elapsed = time.monotonic() - killed_at
    assert code != 0, run.stderr
    assert elapsed < END_LIMIT_S, elapsed
    assert "rank 2" in run.stderr, run.stderr  # Open MPI's launcher names the dead rank
    assert_every_rank_ended([pid for _, pid in pids.values()])

    resumed_at = latest_checkpoint_iteration(run_dir)
    assert resumed_at >= 2
    stop = resumed_at + 2
    proc = run_mpi(3, MPIRL, "train", "--resume", str(run_dir), "--stop",
                   json.dumps({"training_iteration": stop}), timeout=120, env={"CI": "true"})
    assert proc.returncode == 0, proc.stderr
    assert f"checkpoint_{resumed_at:06d} (iteration {resumed_at}" in proc.stdout, proc.stdout
    progress = _rows(run_dir)
    assert [int(r["iteration"]) for r in progress] == list(range(1, stop + 1))
    steps = [int(r["timesteps_total"]) for r in progress]
    assert steps == sorted(steps) and steps[-1] - steps[resumed_at - 1] >= 2000
    print(f"{algo}: kill -9 to the end of the job: {elapsed:.1f} s")
