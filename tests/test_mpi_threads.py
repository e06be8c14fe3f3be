"""MPI and threads: the thread level MPI gives, a worker stuck in a task, a heartbeat thread that
fails, and deadlines on the collectives the driver takes part in. Faults are real: a thread
blocked for ever, an exception raised inside the heartbeat thread, a rank that starts late."""

import json
import re
import subprocess
import sys
import time

import pytest
from conftest import BIN, PROGRAMS, mpi_env, mpiexec_command, parse_result
from mpi4py import MPI

from mpirl.errors import EXIT_FAILURE, EXIT_RANK_LOST, EXIT_USAGE, ThreadLevelError
from mpirl.runtime import heartbeat

PROGRAM = PROGRAMS / "threads_scenarios.py"
HANG_LIMIT_S = 90


def _run(n, *args, env=None, timeout=HANG_LIMIT_S):
    """Run a threads scenario; return (process, its RESULT lines, seconds it took)."""
    start = time.monotonic()
    try:
        proc = subprocess.run(mpiexec_command(n, sys.executable, str(PROGRAM), *args),
                              capture_output=True, text=True, timeout=timeout,
                              env=mpi_env(env))
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"{' '.join(args)} hung for {timeout} s:\n{error.stdout}\n{error.stderr}")
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines()
               if line.startswith("RESULT ")]
    return proc, results, time.monotonic() - start


def test_below_thread_multiple_the_job_stops_at_once_with_exit_2():
    # mpi4py asks MPI for the level in MPI4PY_RC_THREAD_LEVEL; Open MPI then gives SERIALIZED.
    proc = subprocess.run(
        mpiexec_command(2, str(BIN / "mpirl"), "doctor", "--pings", "5"),
        capture_output=True, text=True, timeout=HANG_LIMIT_S,
        env=mpi_env({"MPI4PY_RC_THREAD_LEVEL": "serialized"}),
    )
    assert proc.returncode == EXIT_USAGE, (proc.returncode, proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("mpirl:")]
    assert len(lines) == 1, proc.stderr  # one line, from rank 0 only
    assert "thread level SERIALIZED, but mpirl needs MULTIPLE" in lines[0]
    assert "MPI4PY_RC_THREAD_LEVEL" in lines[0]
    assert "Traceback" not in proc.stderr
    assert "round trip" not in proc.stdout  # nothing ran


def test_doctor_shows_the_thread_level():
    proc = subprocess.run(mpiexec_command(2, str(BIN / "mpirl"), "doctor", "--pings", "5"),
                          capture_output=True, text=True, timeout=HANG_LIMIT_S, env=mpi_env())
    assert proc.returncode == 0, proc.stderr
    assert "MPI thread level MULTIPLE" in proc.stdout


def test_the_thread_level_message_says_how_to_get_multiple_on_mpich(monkeypatch):
    monkeypatch.setattr(heartbeat.MPI, "Query_thread", lambda: MPI.THREAD_SERIALIZED)
    monkeypatch.setattr(heartbeat.MPI, "Get_library_version",
                        lambda: "MPI VERSION    : CRAY MPICH version 8.1.28")
    monkeypatch.setattr("mpi4py.rc.thread_level", "multiple")
    with pytest.raises(ThreadLevelError, match="MPICH_MAX_THREAD_SAFETY=multiple") as caught:
        heartbeat.require_thread_multiple()
    assert caught.value.exit_code == EXIT_USAGE
    monkeypatch.setattr(heartbeat.MPI, "Query_thread", lambda: MPI.THREAD_MULTIPLE)
    heartbeat.require_thread_multiple()


def test_a_worker_stuck_in_a_task_is_reported_within_the_bound():
    # stuck_task_timeout_s=3: a task computing for 4.5 s is progress; one blocked in a wait that
    # never returns (no CPU) is stuck, although its heartbeat thread keeps beating. The driver
    # waits on the stuck call with no timeout of its own (task_timeout_s is 3600 s).
    bound = 3.0
    proc, results, _ = _run(3, "stuck_worker", "--compute-s", "4.5",
                            "--settings", json.dumps({"stuck_task_timeout_s": bound}))
    ended = time.time()
    assert proc.returncode == EXIT_RANK_LOST, (proc.returncode, proc.stderr)
    assert results and results[0]["computed"], (proc.stdout, proc.stderr)
    assert not any("stuck_returned" in r for r in results)
    line = next((line for line in proc.stderr.splitlines() if "is stuck" in line), "")
    assert re.match(r"mpirl: rank 2 \(rollout 1\) on \S+ \(pid \d+\) is stuck: its main thread "
                    r"has used no CPU for [\d.]+ s in its call block_forever\(\) "
                    r"\(stuck_task_timeout_s=3\)", line), proc.stderr
    assert "rank 1 (rollout 0)" not in line
    # Reported within the documented bound: stuck_task_timeout_s + heartbeat_interval_s, plus
    # the time the job takes to end under this machine's load.
    took = ended - results[0]["blocked_at"]
    assert bound <= took < bound + 1.0 + 10, took


def test_a_failure_of_a_workers_heartbeat_thread_ends_the_rank_with_a_message():
    proc, results, took = _run(3, "heartbeat_fails", "--rank", "1")
    assert proc.returncode == EXIT_FAILURE, (proc.returncode, proc.stderr)
    assert not results
    assert re.search(r"mpirl: the heartbeat thread of rank 1 \(rollout 0\) on \S+ \(pid \d+\) "
                     r"failed; .* it ends now \(exit code 1\)", proc.stderr), proc.stderr
    assert "RuntimeError: injected heartbeat failure" in proc.stderr
    assert "no heartbeat for" not in proc.stderr  # ended by the failure, not by the silence
    assert took < 20  # less than heartbeat_timeout_s (20 s), start-up included


def test_a_failure_of_the_drivers_heartbeat_thread_ends_the_job_with_a_message():
    proc, results, took = _run(3, "heartbeat_fails", "--rank", "0")
    assert proc.returncode == EXIT_FAILURE, (proc.returncode, proc.stderr)
    assert not results
    assert "mpirl: the heartbeat thread of rank 0 (driver 0)" in proc.stderr, proc.stderr
    assert "RuntimeError: injected heartbeat failure" in proc.stderr
    assert "no heartbeat for" not in proc.stderr
    assert took < 20


def test_the_weight_broadcast_from_the_driver_has_a_deadline():
    # num_learners 0: the driver holds the learner and is the root of the weights Bcast. The
    # only rollout rank is busy in another task for 30 s, far past task_timeout_s (4 s).
    proc, results, _ = _run(2, "broadcast_while_busy", "--compute-s", "30",
                            "--settings", json.dumps({"task_timeout_s": 4,
                                                      "shutdown_timeout_s": 2}))
    assert results, (proc.stdout, proc.stderr)
    result = results[0]
    assert result["error"] == ("TaskTimeout: the weight broadcast: not all 2 members arrived "
                               "within 4 s; rollout ranks that had not taken the weights: rank 1"
                               ), result
    assert 4 <= result["elapsed_s"] < 4 + 5, result


def test_a_rank_that_never_reaches_start_up_is_named():
    # Rank 2 sleeps 40 s before it starts mpirl; startup_timeout_s is 3.
    proc, results, took = _run(3, "ping_all", "--late-rank", "2", "--late-s", "40",
                               "--settings", json.dumps({"startup_timeout_s": 3}))
    assert proc.returncode == EXIT_RANK_LOST, (proc.returncode, proc.stderr)
    assert not results
    assert ("mpirl: rank 2 (rollout 1) did not reach start-up within 3 s (startup_timeout_s); "
            "ending the job.") in proc.stderr, proc.stderr
    assert proc.stderr.count("mpirl:") == 1
    assert took < 30


def test_a_clean_run_is_unchanged():
    proc, results, _ = _run(3, "ping_all")
    assert proc.returncode == 0, proc.stderr
    assert parse_result(proc.stdout) == {"answers": 2}
