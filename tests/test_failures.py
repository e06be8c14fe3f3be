"""Faults injected for real: kill -9, a worker leaving its serve loop, a driver that raises.

The job must end within 30 s with a non-zero exit and a message naming the rank; never hang.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import (
    SCENARIOS,
    assert_every_rank_ended,
    mpi_env,
    mpiexec_command,
    parse_result,
    run_scenario,
)

from mpirl.errors import EXIT_RANK_LOST

HANG_LIMIT_S = 90  # the test fails, rather than hangs, past this


def _start(n, name, tmp_path, *args, ulfm=False):
    pid_file = tmp_path / "pids.json"
    command = mpiexec_command(n, sys.executable, str(SCENARIOS), name,
                              "--pid-file", str(pid_file), *args, ulfm=ulfm)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=mpi_env(), start_new_session=True)
    deadline = time.monotonic() + 60
    while not pid_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            out, err = _finish(proc)
            pytest.fail(f"scenario never wrote its pids (exit {proc.returncode}):\n{out}\n{err}")
        time.sleep(0.05)
    return proc, {int(rank): pid for rank, pid in json.loads(pid_file.read_text()).items()}


def _finish(proc, limit=HANG_LIMIT_S):
    try:
        return proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the job hung for {limit} s after the fault:\n{out}\n{err}")


def _kill_and_time(proc, pid):
    time.sleep(0.5)  # let the run get going
    start = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    out, err = _finish(proc)
    return time.monotonic() - start, out, err


def test_kill_9_of_a_worker_ends_the_job(tmp_path):
    proc, pids = _start(3, "busy_until_killed", tmp_path)
    elapsed, out, err = _kill_and_time(proc, pids[2])
    assert proc.returncode != 0
    assert elapsed < 30
    assert "rank 2" in err, err  # Open MPI's launcher names the dead rank
    assert "survived" not in out
    assert_every_rank_ended(pids.values())


@pytest.mark.parametrize("scenario", ["busy_until_killed", "computing_until_killed"])
def test_heartbeat_catches_a_dead_worker_when_mpi_keeps_running(tmp_path, scenario):
    # Under ULFM, mpiexec lets the survivors run on: only mpirl's heartbeat can end the job.
    # The driver is either waiting on workers or computing without touching MPI.
    # With the default 20 s heartbeat timeout, ULFM's failure report must end every rank (the
    # driver ends the job, the workers see the driver go) long before any heartbeat times out.
    proc, pids = _start(4, scenario, tmp_path, ulfm=True)
    elapsed, out, err = _kill_and_time(proc, pids[2])
    assert proc.returncode == EXIT_RANK_LOST, (proc.returncode, err)
    assert elapsed < 30
    assert "mpirl: lost rank 2 (rollout 1)" in err, err
    assert f"(pid {pids[2]})" in err
    assert "survived" not in out
    assert_every_rank_ended(pids.values())


def test_workers_end_when_the_driver_is_killed(tmp_path):
    proc, pids = _start(3, "busy_until_killed", tmp_path, ulfm=True)
    elapsed, out, err = _kill_and_time(proc, pids[0])
    assert proc.returncode == EXIT_RANK_LOST, (proc.returncode, err)
    assert elapsed < 30
    assert "mpirl: lost rank 0 (driver 0)" in err, err
    assert_every_rank_ended(pids.values())


def test_worker_leaving_its_serve_loop_ends_the_job():
    start = time.monotonic()
    proc, result = run_scenario(3, "exit_outside", timeout=HANG_LIMIT_S)
    assert time.monotonic() - start < 30 + 10  # 10 s for start-up
    assert proc.returncode != 0 and result is None
    assert "mpirl: rank 2 (rollout 1)" in proc.stderr and "failed outside a task" in proc.stderr
    assert "SystemExit: 3" in proc.stderr


def test_driver_exception_stops_every_rank_with_an_error_code():
    proc, result = run_scenario(3, "driver_raises", timeout=HANG_LIMIT_S)
    assert proc.returncode == 1
    assert "mpirl: the driver failed" in proc.stderr
    assert "a bug in the driver program" in proc.stderr
    assert proc.stderr.count("a bug in the driver program") == 2  # the traceback, on rank 0 only


def test_a_frozen_worker_is_declared_lost_by_heartbeat_silence(tmp_path):
    # SIGSTOP freezes every thread of the rank: MPI sees nothing wrong, only silence does.
    proc, pids = _start(3, "busy_until_killed", tmp_path, "--heartbeat-timeout", "4")
    time.sleep(0.5)
    start = time.monotonic()
    os.kill(pids[1], signal.SIGSTOP)
    out, err = _finish(proc)
    elapsed = time.monotonic() - start
    assert proc.returncode == EXIT_RANK_LOST, (proc.returncode, err)
    # Silence counts from the last heartbeat, which is up to one interval (1 s) before the stop.
    assert 4 - 1 - 0.2 <= elapsed < 30
    assert "mpirl: lost rank 1 (rollout 0)" in err and "no heartbeat for" in err, err
    assert_every_rank_ended(pids.values())


def test_a_lost_rollout_rank_is_survived_under_ulfm(tmp_path):
    # With survive_rollout_loss the driver's calls on the lost rank raise RankLost, the group
    # drops it, and the other workers keep answering; the job then ends normally.
    proc, pids = _start(4, "calls_until_a_rank_is_lost", tmp_path, "--survive-rollout-loss",
                        ulfm=True)
    elapsed, out, err = _kill_and_time(proc, pids[2])
    assert proc.returncode == 0, (proc.returncode, err)
    assert elapsed < 30
    assert (f"mpirl: lost rank 2 (rollout 1) on {socket.gethostname()} (pid {pids[2]}): MPI "
            f"reported a process failure; continuing with 2 rollout workers") in err, err
    assert err.count("mpirl: lost") == 1
    result = parse_result(out)
    assert result["lost"] == [[2, 1]] and result["workers"] == [1, 3], result
    assert all(rank == 2 and "rollout rank 2 was lost" in text for rank, text in result["errors"])
    assert result["calls_after"] > 0 and result["answers"] == ["still here"] * 2
    assert_every_rank_ended(pids.values())


def test_losing_the_last_rollout_rank_ends_the_job_under_ulfm(tmp_path):
    proc, pids = _start(2, "busy_until_killed", tmp_path, "--survive-rollout-loss", ulfm=True)
    _, out, err = _kill_and_time(proc, pids[1])
    assert proc.returncode == EXIT_RANK_LOST, (proc.returncode, err)
    assert "mpirl: lost rank 1 (rollout 0)" in err and "it was the last rollout worker" in err
    assert "survived" not in out
    assert_every_rank_ended(pids.values())
