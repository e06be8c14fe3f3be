"""Training survives the loss of a rollout rank under ULFM (``mpiexec --with-ft ulfm``).

A rollout rank is killed with kill -9 in the middle of a PPO run. The run must reach its stop
criterion in the same job (no restart), say which rank it lost, and record the smaller rollout
group. mpiexec exits 0 under ULFM even when a rank died, so the tests read mpirl's own output and
result.json, and check that every rank's process has ended.
"""

import csv
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import assert_every_rank_ended, mpi_env, mpiexec_command

from mpirl.runtime.layout import parse_layout_row
from mpirl.testing import tagged_ranks

LIMIT_S = 90  # the whole run, start-up included; the test fails rather than hangs past it
#: PPO's stop: 200 comes at about 20 iterations of 3 rollout ranks (30k steps), well after the
#: loss at iteration 5; the learning goes on without the rank.
STOP = {"episode_return_mean": 200, "timesteps_total": 300_000}
#: The learner-in-driver case's stop: 4 iterations after the loss at iteration 5 (the learning
#: that goes on without the rank is the learner-rank case's, to STOP).
STOP_AFTER_LOSS = {"training_iteration": 9}


class LiveRun:
    """``mpiexec ... mpirl train`` with its output read line by line as it comes."""

    def __init__(self, n, run_dir, config, algo="PPO", stop=STOP, env="CartPole-v1"):
        command = mpiexec_command(
            n, sys.executable, "-m", "mpirl", "train", "--algo", algo, "--env", env,
            "--seed", "1", "--config", json.dumps(config), "--stop", json.dumps(stop),
            "--run-dir", str(run_dir), ulfm=True)
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=mpi_env({"CI": "true"}),
                                     start_new_session=True)
        self.lines = []  # (monotonic time, "out" or "err", line)
        self.started = time.monotonic()
        self._readers = [threading.Thread(target=self._read, args=(stream, name), daemon=True)
                         for stream, name in ((self.proc.stdout, "out"), (self.proc.stderr, "err"))]
        for reader in self._readers:
            reader.start()

    def _read(self, stream, name):
        for line in stream:
            self.lines.append((time.monotonic(), name, line.rstrip("\n")))

    def wait_for_line(self, pattern):
        """The time and match of the first line matching ``pattern``; fails at the limit."""
        regex = re.compile(pattern)
        while time.monotonic() - self.started < LIMIT_S:
            for at, _, line in list(self.lines):
                if match := regex.search(line):
                    return at, match
            if self.proc.poll() is not None and not any(r.is_alive() for r in self._readers):
                break
            time.sleep(0.02)
        self.fail(f"no line matching {pattern!r}")

    def pids(self):
        """World rank -> (role, pid), from the layout table the driver prints."""
        self.wait_for_line(r"^-+  -+")
        table = {}
        for _, _, line in list(self.lines):
            if row := parse_layout_row(line):
                table[row["rank"]] = (row["role"], row["pid"])
        return table

    def finish(self):
        try:
            self.proc.wait(timeout=max(1.0, LIMIT_S - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.fail("the job hung")
        for reader in self._readers:
            reader.join(timeout=5)

    def text(self, name):
        return "\n".join(line for _, stream, line in self.lines if stream == name)

    def fail(self, why):
        with_output = f"{why}\n--- stdout\n{self.text('out')[-3000:]}\n--- stderr\n" \
                      f"{self.text('err')[-3000:]}"
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        pytest.fail(with_output)


@pytest.mark.parametrize("n, config, stop", [
    (4, {}, STOP_AFTER_LOSS),        # learner in the driver's process, 3 rollout ranks
    (5, {"num_learners": 1}, STOP),  # learner rank 4, 3 rollout ranks
], ids=["learner-in-driver", "learner-rank"])
def test_ppo_run_finishes_after_losing_a_rollout_rank(tmp_path, n, config, stop):
    run_dir = tmp_path / "run"
    run = LiveRun(n, run_dir, config, stop=stop)
    table = run.pids()
    victim = 2
    assert table[victim][0] == "rollout"
    run.wait_for_line(r"^iter 5[ /]")
    killed_at = time.monotonic()
    os.kill(table[victim][1], signal.SIGKILL)
    lost_at, _ = run.wait_for_line(r"^mpirl: lost rank 2 ")
    run.finish()
    out, err = run.text("out"), run.text("err")

    # mpirl's own account; mpiexec's exit code is 0 here whether or not a rank died.
    if run.proc.returncode != 0:
        run.fail(f"exit code {run.proc.returncode}")  # with the output's ends, not cut short
    assert "mpirl: lost rank 2 (rollout 1) on " in err and f"(pid {table[victim][1]})" in err
    assert "continuing with 2 rollout workers" in err and err.count("mpirl: lost") == 1, err
    assert "Traceback" not in err, err
    stopped = re.search(r"^stopped: (\w+) reached", out, re.MULTILINE)
    assert stopped and stopped.group(1) in stop, out[-2000:]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["rollout_ranks_lost"] == 1 and result["num_rollout_workers"] == 2, result
    if stop is STOP:
        assert (result["episode_return_mean"] >= STOP["episode_return_mean"]
                or result["timesteps_total"] >= STOP["timesteps_total"]), result
    else:
        assert result["iteration"] == stop["training_iteration"], result
    # One run, never restarted: one layout table, iterations 1..N in order, 3 workers then 2.
    assert out.count("mpirl layout:") == 1
    with open(run_dir / "progress.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["iteration"]) for r in rows] == list(range(1, len(rows) + 1))
    workers = [int(r["num_rollout_workers"]) for r in rows]
    assert workers[:5] == [3] * 5 and workers[-1] == 2 and workers == sorted(workers, reverse=True)
    assert_every_rank_ended([pid for _, pid in table.values()])
    print(f"kill -9 to the driver's loss line: {lost_at - killed_at:.3f} s; "
          f"{len(rows)} iterations, {result['time_total_s']:.1f} s of training")


def lose_a_rollout_rank(run: LiveRun, run_dir, victim: int, after_iteration: int):
    """kill -9 rollout rank ``victim`` of a 3-rollout-rank run once ``after_iteration`` is
    printed; check the run said so, went on with 2 and reached its iteration stop. The layout
    table and the progress rows."""
    table = run.pids()
    assert table[victim][0] == "rollout"
    run.wait_for_line(rf"^iter {after_iteration}[ /]")
    os.kill(table[victim][1], signal.SIGKILL)
    run.wait_for_line(rf"^mpirl: lost rank {victim} ")
    run.finish()
    out, err = run.text("out"), run.text("err")
    assert run.proc.returncode == 0, (run.proc.returncode, err)
    assert "continuing with 2 rollout workers" in err and "Traceback" not in err, err
    assert re.search(r"^stopped: training_iteration reached", out, re.MULTILINE), out[-2000:]
    with open(run_dir / "progress.csv") as f:
        return table, list(csv.DictReader(f))


def test_a_rollout_rank_lost_while_it_writes_a_checkpoint_is_left_out_of_it(tmp_path):
    """kill -9 of a rollout rank in the middle of its ``save_state`` (its env sleeps while it is
    pickled): the checkpoint is written again by the two ranks left, and the run goes on. Before,
    the call that would never be answered ended the job with exit 70 (found by chaos.py)."""
    from mpirl.jobs.checkpoint import verify

    run_dir, markers = tmp_path / "run", tmp_path / "markers"
    markers.mkdir()
    config = {"checkpoint_every": 3, "keep_checkpoints": 5, "num_envs_per_worker": 1,
              "env_config": {"marker_dir": str(markers), "save_s": 2.0}}
    run = LiveRun(4, run_dir, config, env="mpirl.testing:SlowToSaveCartPole",
                  stop={"training_iteration": 7})
    table = run.pids()
    rollouts = {pid: rank for rank, (role, pid) in table.items() if role == "rollout"}
    while not (saving := list(markers.glob("saving-*"))):
        if time.monotonic() - run.started > LIMIT_S or run.proc.poll() is not None:
            run.fail("no rollout rank began a checkpoint")
        time.sleep(0.01)
    pid = int(saving[0].name.split("-")[1])
    os.kill(pid, signal.SIGKILL)
    run.wait_for_line(rf"^mpirl: lost rank {rollouts[pid]} ")
    run.finish()
    out, err = run.text("out"), run.text("err")
    assert run.proc.returncode == 0, (run.proc.returncode, err)
    assert "continuing with 2 rollout workers" in err, err
    assert "Traceback" not in err and "exit code 70" not in err, err
    assert re.search(r"^stopped: training_iteration reached", out, re.MULTILINE), out[-2000:]
    with open(run_dir / "progress.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["iteration"]) for r in rows] == list(range(1, 8))
    # The checkpoint of iteration 3 holds the two live rollout workers' states, and verifies.
    manifest = verify(run_dir / "checkpoints" / "checkpoint_000003")
    assert manifest["layout"]["rollout"] == 2, manifest["layout"]
    assert sorted(n for n in manifest["files"] if n.startswith("rollout")) == [
        "rollout_0.pkl", "rollout_1.pkl"]
    assert_every_rank_ended([pid for _, pid in table.values()])


def test_es_drops_a_lost_ranks_perturbations_and_goes_on(tmp_path):
    """ES under ULFM: kill -9 one of 3 rollout ranks mid-run; the generation in flight drops its
    pairs, the others keep applying identical updates (checksums agree) until the stop."""
    run_dir = tmp_path / "run"
    stop = {"training_iteration": 9}
    run = LiveRun(4, run_dir, {}, algo="ES", stop=stop)
    table, rows = lose_a_rollout_rank(run, run_dir, victim=3, after_iteration=4)
    assert len(rows) == 9 and int(rows[-1]["num_rollout_workers"]) == 2
    assert int(rows[0]["num_rollout_workers"]) == 3
    # Generations went on after the loss, with updates the survivors agreed on (a checksum
    # mismatch would have ended the run) and that still improve the policy.
    assert float(rows[-1]["perturbed_return_mean"]) > float(rows[0]["perturbed_return_mean"])
    assert_every_rank_ended([pid for _, pid in table.values()])


def test_alphazero_goes_on_without_a_lost_self_play_rank(tmp_path):
    """Self-play positions go rollout -> learner: the lost rank's are not waited for, and
    its weights broadcast and evaluation share move to the ranks left."""
    pytest.importorskip("pyspiel")
    run_dir = tmp_path / "run"
    config = {"games_per_worker": 4, "sgd_steps_per_iteration": 4, "train_batch_size": 16,
              "evaluation_interval": 2, "evaluation_games": 4, "simulations": 4}
    run = LiveRun(4, run_dir, config, algo="AlphaZero", env="openspiel/tic_tac_toe",
                  stop={"training_iteration": 6})
    table, rows = lose_a_rollout_rank(run, run_dir, victim=2, after_iteration=3)
    assert [int(r["iteration"]) for r in rows] == list(range(1, 7))
    assert int(rows[0]["num_rollout_workers"]) == 3 and int(rows[-1]["num_rollout_workers"]) == 2
    # The ranks left keep playing and training: games and SGD steps after the loss.
    assert int(rows[-1]["games_this_iter"]) >= 8 and int(rows[-1]["sgd_steps"]) == 4
    assert rows[-1]["eval_random_win"] != "nan"
    assert_every_rank_ended([pid for _, pid in table.values()])


def test_pets_goes_on_without_a_lost_planning_rank(tmp_path):
    """PETS's transitions go rollout -> learner: the lost rank's are not waited for, the
    ensemble reaches the ranks left, and their evaluation episodes make up the whole count."""
    import numpy as np
    from test_pets import QUICK

    run_dir = tmp_path / "run"
    # Evaluations at iterations 3 (before the kill) and 6 (after the loss): 3 episodes, one a
    # rank, then spread over the 2 ranks left.
    run = LiveRun(4, run_dir, {**QUICK, "evaluation_interval": 3, "evaluation_episodes": 3},
                  algo="PETS", env="Pendulum-v1", stop={"training_iteration": 6})
    table, rows = lose_a_rollout_rank(run, run_dir, victim=2, after_iteration=3)
    assert [int(r["iteration"]) for r in rows] == list(range(1, 7))
    assert int(rows[0]["num_rollout_workers"]) == 3 and int(rows[-1]["num_rollout_workers"]) == 2
    # 3 ranks x 2 envs x 10 steps an iteration, then 2 ranks' 40 once the loss is seen.
    grown = np.diff([int(r["transitions"]) for r in rows]).tolist()
    assert grown[0] == 60 and grown[-1] == 40, grown
    # Both evaluations played their 3 whole episodes (200 steps), the second on the ranks left.
    evaluated = [int(float(r["evaluation_env_steps_total"])) for r in rows]
    assert evaluated == [0, 0, 600, 600, 600, 1200], evaluated
    assert rows[2]["eval_return_mean"] != "nan" and rows[-1]["eval_return_mean"] != "nan"
    assert_every_rank_ended([pid for _, pid in table.values()])


def test_mbpo_goes_on_without_a_lost_rollout_rank(tmp_path):
    """MBPO's real steps and its model rollouts go rollout -> learner: a rank lost is not waited
    for in either, and its share of the start states goes to the ranks left."""
    import numpy as np
    from test_mbpo import QUICK

    run_dir = tmp_path / "run"
    # Evaluations at iterations 3 (before the kill) and 6 (after the loss): 3 episodes, one a
    # rank, then spread over the 2 ranks left.
    run = LiveRun(4, run_dir, {**QUICK, "evaluation_interval": 3, "evaluation_episodes": 3},
                  algo="MBPO", env="Pendulum-v1", stop={"training_iteration": 6})
    table, rows = lose_a_rollout_rank(run, run_dir, victim=2, after_iteration=3)
    assert [int(r["iteration"]) for r in rows] == list(range(1, 7))
    assert int(rows[0]["num_rollout_workers"]) == 3 and int(rows[-1]["num_rollout_workers"]) == 2
    # 3 ranks x 1 env x 10 steps an iteration, then 2 ranks' 20 once the loss is seen.
    grown = np.diff([int(float(r["real_buffer_size"])) for r in rows]).tolist()
    assert grown[0] == 30 and grown[-1] == 20, grown
    # The model rollouts go on: all 20 start states rolled out by the ranks left.
    assert int(float(rows[-1]["model_buffer_size"])) > 0
    # An evaluation's return stays in the rows up to the next: a new one at 6, on the ranks left.
    evals = [r["eval_return_mean"] for r in rows]
    assert evals[:2] == ["nan", "nan"] and evals[2] == evals[3] == evals[4] != "nan", evals
    assert evals[5] not in ("nan", evals[4]), evals
    assert_every_rank_ended([pid for _, pid in table.values()])


class _RevocableComm:
    revoked = False

    def Revoke(self):  # noqa: N802 (MPI's name)
        self.revoked = True


@pytest.mark.parametrize("error_class, failed, becomes_failure", [
    ("ERR_PROC_FAILED", [], True),
    ("ERR_REVOKED", [], True),
    # libnbc once completed an Ibarrier with ERR_OTHER for a member's death (CI, the
    # learner-in-driver case above): a traceback and exit 1 instead of going on without it.
    ("ERR_OTHER", [2], True),
    ("ERR_INTERN", [2], True),
    ("ERR_OTHER", [], False),      # no failure known: a real error, raised as it is
    ("ERR_TRUNCATE", [2], False),  # a failure known, but this error is not about it
])
def test_a_collective_that_a_death_breaks_is_revoked_and_named(monkeypatch, error_class, failed,
                                                                becomes_failure):
    from mpi4py import MPI

    from mpirl.errors import ProcessFailure
    from mpirl.runtime import ulfm

    monkeypatch.setattr(ulfm, "fault_tolerant", lambda: True)
    monkeypatch.setattr(ulfm, "failed_world_ranks", lambda comm=None: failed)
    comm = _RevocableComm()
    raised = MPI.Exception(getattr(MPI, error_class))
    expected = ProcessFailure if becomes_failure else MPI.Exception
    with pytest.raises(expected) as caught, ulfm.revoke_on_failure(comm, "the weight broadcast"):
        raise raised
    assert comm.revoked is becomes_failure
    if becomes_failure:
        assert str(caught.value).startswith("the weight broadcast failed: ")
        assert f"ranks {failed or 'none yet'} as failed" in str(caught.value)
    else:
        assert caught.value is raised


def test_a_population_that_loses_its_controller_ends_in_one_line(tmp_path):
    """kill -9 of ``mpirl tune``'s controller under ULFM: the members' waits on it raise MPI's
    process-failure error, which now ends each the way their heartbeat does (one line, exit 70),
    not with a traceback and MPI_Abort (found by chaos.py --ulfm on a PBT population)."""
    tune_dir, tag = tmp_path / "pbt", f"{os.getpid()}-{time.monotonic_ns()}"
    command = mpiexec_command(
        3, sys.executable, "-m", "mpirl", "tune", "--scheduler", "pbt", "--population", "2",
        "--ranks-per-trial", "1", "--perturbation-interval", "4", "--mutations",
        '{"lr": [1e-4, 1e-3]}', "--run-dir", str(tune_dir), "--", "--algo", "PPO", "--env",
        "CartPole-v1", "--config", '{"num_envs_per_worker": 1}', "--stop",
        '{"training_iteration": 10000}', ulfm=True)
    code, err = _end_of_a_job_that_lost_a_rank(
        _launch(command, tag), tag, 0, lambda ranks: (tune_dir / "pbt.jsonl").exists(),
        end_within_s=60)
    assert "mpirl: lost the population controller (rank 0)" in err, err
    assert "Traceback" not in err and "MPI_ABORT" not in err, err


def _start_command(command: str, run_dir, config: dict) -> list[str]:
    """``mpirl train`` or ``mpirl tune`` (a PBT population of two one-rank trials) of PPO on
    ``config``'s env, 3 ranks, under ULFM."""
    train = ["--algo", "PPO", "--env", config.pop("env", "CartPole-v1"), "--config",
             json.dumps(config), "--stop", '{"training_iteration": 3}']
    if command == "train":
        args = ["train", "--run-dir", str(run_dir), *train]
    else:
        args = ["tune", "--scheduler", "pbt", "--population", "2", "--ranks-per-trial", "1",
                "--mutations", '{"lr": [1e-4, 1e-3]}', "--run-dir", str(run_dir), "--", *train]
    return mpiexec_command(3, sys.executable, "-m", "mpirl", *args, ulfm=True)


def _end_of_a_job_that_lost_a_rank(proc, tag: str, victim: int, ready,
                                   end_within_s: float = LIMIT_S) -> tuple[int, str]:
    """Kill -9 world rank ``victim`` once ``ready(ranks)`` holds; the job's exit code and
    stderr, once every rank has ended. Fails, killing the job, if it has not ended within
    ``end_within_s`` of the kill."""
    try:
        deadline = time.monotonic() + LIMIT_S
        while not (len(ranks := tagged_ranks("MPIRL_TEST_TAG", tag)) == 3 and ready(ranks)):
            assert time.monotonic() < deadline and proc.poll() is None, "the job never started"
            time.sleep(0.005)
        os.kill(ranks[victim], signal.SIGKILL)
        _, err = proc.communicate(timeout=end_within_s)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert_every_rank_ended(list(ranks.values()))
    return proc.returncode, err


def _launch(command: list[str], tag: str) -> subprocess.Popen:
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=mpi_env({"CI": "true", "MPIRL_TEST_TAG": tag}),
                            start_new_session=True)


def test_a_rank_lost_before_mpi_init_ends_the_job_at_startup_timeout(tmp_path):
    """Under ULFM the launcher does not end the job when a rank dies, and the other ranks wait
    in MPI_Init for it for ever: before the fix this job never ended. Each waiting rank is now
    ended at startup_timeout_s by init_watchdog, with one line, and the job exits 70."""
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    started = time.monotonic()
    proc = _launch(_start_command("train", tmp_path / "run", {"startup_timeout_s": 5}), tag)
    # The moment all three processes exist: far from MPI_Init's end (the interpreter and
    # mpirl's imports come first).
    code, err = _end_of_a_job_that_lost_a_rank(proc, tag, 2, lambda ranks: True)
    assert code == 70, err
    lines = [line for line in err.splitlines() if "did not finish MPI_Init" in line]
    assert lines and all("within 5 s (startup_timeout_s)" in line for line in lines), err
    assert "Traceback" not in err, err
    assert time.monotonic() - started < 5 + 30, "ended, but long after startup_timeout_s"


@pytest.mark.parametrize("command", ["train", "tune"])
def test_a_rank_lost_after_mpi_init_and_before_the_heartbeat_ends_in_one_line(tmp_path,
                                                                            command):
    """kill -9 of a rank while rank 0 checks the request (it builds the env once) and the others
    wait for it: MPI's process-failure error met in start-up's calls gave a traceback on each
    rank that met it (tune's broadcast, its split); now each says which rank was lost, once,
    and the job exits 70."""
    tag, markers = f"{os.getpid()}-{time.monotonic_ns()}", tmp_path / "markers"
    markers.mkdir()
    config = {"env": "mpirl.testing:SlowToBuildCartPole",
              "env_config": {"marker_dir": str(markers), "build_s": 1.0}}
    proc = _launch(_start_command(command, tmp_path / "run", config), tag)
    code, err = _end_of_a_job_that_lost_a_rank(
        proc, tag, 2, lambda ranks: (markers / f"building-{ranks[0]}").exists())
    assert code == 70, err
    assert "mpirl: lost rank 2 while the job started: MPI reported a process failure" in err, err
    assert "Traceback" not in err and "MPI_ABORT" not in err, err


@pytest.mark.parametrize("disarm, code", [(False, 70), (True, 0)])
def test_the_exit_timer_ends_a_process_that_python_cannot_interrupt(disarm, code):
    """init_watchdog's timer ends its process with 70 from a C thread, while the main thread
    holds the GIL in C (here a ctypes call that blocks in sleep(3); MPI_Init in life), and
    ``timer_delete`` disarms it."""
    program = ("import ctypes\n"
               "from mpirl.runtime import init_watchdog\n"
               "timer = init_watchdog.exit_timer(0.3, 70)\n"
               "assert timer is not None\n"
               f"if {disarm}: init_watchdog._libc().timer_delete(timer)\n"
               "ctypes.PyDLL(None).sleep(1)\n")
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == code, proc.stderr
