"""``mpirl launch``: restarts, --resume, exit codes and signals, with real processes.

The supervised command is tests/programs/fake_job.py, run either directly or through a script
named ``mpirl`` (so that launch takes it for ``mpirl train``), and once under real mpiexec.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import BIN, PROGRAMS, mpi_env, mpiexec_command

from mpirl.jobs.launch import describe, find_train, first_command, restart_command

FAKE_JOB = PROGRAMS / "fake_job.py"
TRAIN_ARGS = ["train", "--algo", "PPO", "--env", "CartPole-v1"]


# --- the command line that each attempt runs ------------------------------------------------

def test_find_train_recognizes_the_ways_to_run_mpirl():
    assert find_train(["mpiexec", "-n", "4", "mpirl", *TRAIN_ARGS]).train_index == 4
    assert find_train(["srun", "/opt/venv/bin/mpirl", *TRAIN_ARGS]).train_index == 2
    assert find_train(["python", "-m", "mpirl", *TRAIN_ARGS]).train_index == 3
    assert find_train(["mpirl", "doctor"]) is None
    assert find_train(["mpiexec", "--prefix", "/opt/mpirl", "mpirl", *TRAIN_ARGS]).train_index == 4
    assert find_train(["mpiexec", "-n", "2", "python", "prog.py", "train"]) is None
    call = find_train(["mpirl", *TRAIN_ARGS, "--run-dir=a", "--run-dir", "b", "--resume=c"])
    assert (call.run_dir, call.resume_dir, call.algo, call.env) == ("b", "c", "PPO", "CartPole-v1")


def test_first_attempt_names_the_run_dir_and_restarts_resume_from_it():
    command, run_dir = first_command(["mpiexec", "-n", "2", "mpirl", *TRAIN_ARGS, "--stop", "{}"])
    assert re.fullmatch(r"runs/PPO-CartPole-v1-\d{8}-\d{6}", run_dir)
    assert command == ["mpiexec", "-n", "2", "mpirl", "train", "--run-dir", run_dir,
                       *TRAIN_ARGS[1:], "--stop", "{}"]
    resumed = restart_command(command)
    assert resumed == ["mpiexec", "-n", "2", "mpirl", "train", "--resume", run_dir,
                       "--run-dir", run_dir, *TRAIN_ARGS[1:], "--stop", "{}"]
    assert restart_command(resumed) == resumed  # never a second --resume


def test_commands_launch_leaves_alone():
    given = ["mpirl", *TRAIN_ARGS, "--resume=runs/x"]
    assert first_command(given) == (given, "runs/x")
    assert restart_command(given) == given
    not_train = ["mpiexec", "-n", "2", "python", "my_driver.py"]
    assert first_command(not_train) == (not_train, None)
    assert restart_command(not_train) == not_train
    # MPMD: what follows ":" is another program; launch's words go right after "train".
    mpmd = ["mpiexec", "-n", "1", "mpirl", *TRAIN_ARGS, "--run-dir", "d", ":", "-n", "1", "x"]
    assert restart_command(mpmd) == ["mpiexec", "-n", "1", "mpirl", "train", "--resume", "d",
                                     *mpmd[5:]]


def test_describe_exit():
    assert describe(70) == "exited with 70 (a rank was lost)"
    assert describe(75) == "exited with 75 (stopped on request after a checkpoint)"
    assert describe(-9) == "was killed by SIGKILL"
    assert describe(137) == "exited with 137 (a process was killed by SIGKILL)"
    assert describe(3) == "exited with 3"
    # Open MPI's launcher exits with 213 when its PMIx server fails: 128 + 85 is no signal.
    assert describe(213) == "exited with 213"


# --- real processes ---------------------------------------------------------------------------

@pytest.fixture
def job(tmp_path: Path) -> Path:
    """A directory with bin/mpirl (runs fake_job.py) and the fake's state files."""
    (tmp_path / "bin").mkdir()
    wrapper = tmp_path / "bin" / "mpirl"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_JOB}" "$@"\n')
    wrapper.chmod(0o755)
    return tmp_path


def fake_train(job: Path, *args: str) -> list[str]:
    return [str(job / "bin" / "mpirl"), *TRAIN_ARGS, *args]


def start_launch(job: Path, plan: str, command: list[str], *options: str) -> subprocess.Popen:
    env = mpi_env({"FAKE_DIR": str(job), "FAKE_PLAN": plan})
    return subprocess.Popen([str(BIN / "mpirl"), "launch", "--restart-delay", "0", *options, "--",
                             *command], cwd=job, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def launch(job: Path, plan: str, command: list[str], *options: str,
           timeout: float = 30) -> subprocess.CompletedProcess:
    process = start_launch(job, plan, command, *options)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"mpirl launch did not end within {timeout} s: {process.communicate()}")
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def attempts(job: Path) -> list[list[str]]:
    """The argv of every attempt (rank 0's)."""
    path = job / "argv.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def signals_received(job: Path, rank: int = 0) -> list[str]:
    path = job / f"signals.{rank}"
    return path.read_text().split() if path.exists() else []


def wait_for(condition, timeout: float = 20, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def test_restarts_until_success_resuming_from_the_run_dir(job):
    result = launch(job, "exit:70,kill,exit:0", fake_train(job, "--run-dir", "runs/x"),
                    "--max-restarts", "3")
    assert result.returncode == 0, result.stderr
    runs = attempts(job)
    assert len(runs) == 3
    assert "--resume" not in runs[0]
    for argv in runs[1:]:
        assert argv.count("--resume") == 1 and argv[argv.index("--resume") + 1] == "runs/x"
    assert ("mpirl launch: attempt 2 of 4: previous attempt exited with 70 (a rank was lost); "
            "resuming from runs/x") in result.stderr
    assert "attempt 3 of 4: previous attempt was killed by SIGKILL" in result.stderr


@pytest.mark.parametrize("run_dir_args", [["--run-dir=runs/y"], []], ids=["equals", "default"])
def test_the_run_dir_is_kept_across_attempts(job, run_dir_args):
    result = launch(job, "exit:1,exit:0", fake_train(job, *run_dir_args))
    assert result.returncode == 0, result.stderr
    first, second = attempts(job)
    if run_dir_args:
        run_dir = "runs/y"
        assert first == TRAIN_ARGS + run_dir_args
    else:
        run_dir = first[first.index("--run-dir") + 1]
        assert re.fullmatch(r"runs/PPO-CartPole-v1-\d{8}-\d{6}", run_dir)
    assert second[second.index("--resume") + 1] == run_dir


def test_bad_input_is_not_restarted(job):
    result = launch(job, "exit:2,exit:0", fake_train(job, "--run-dir", "d"), "--max-restarts", "3")
    assert result.returncode == 2
    assert len(attempts(job)) == 1
    assert "not restarting" in result.stderr


def test_gives_up_with_the_last_code_when_restarts_are_spent(job):
    # 75 that launch did not ask for (e.g. a signal sent to the ranks directly) is restarted too.
    result = launch(job, "exit:75", fake_train(job, "--run-dir", "d"), "--max-restarts", "2")
    assert result.returncode == 75
    assert len(attempts(job)) == 3
    assert "giving up after 3 attempts: the last exited with 75" in result.stderr


@pytest.mark.parametrize(("sent", "train", "expected"), [
    (signal.SIGUSR2, True, "SIGUSR2"),
    (signal.SIGTERM, True, "SIGUSR2"),  # mpiexec would kill the ranks 0.25 s after a SIGTERM
    (signal.SIGINT, True, "SIGUSR2"),  # Ctrl-C: the same, and a checkpoint with exit 75
    (signal.SIGTERM, False, "SIGTERM"),
    (signal.SIGUSR1, False, "SIGUSR1"),
], ids=["usr2-train", "term-train", "ctrl-c-train", "term-other", "usr1-other"])
def test_forwards_signals_and_does_not_restart_after_one(job, sent, train, expected):
    command = fake_train(job, "--run-dir", "d") if train else [sys.executable, str(FAKE_JOB)]
    process = start_launch(job, "wait", command, "--max-restarts", "3")
    wait_for(lambda: (job / "ready.0.1").exists(), what="the command to start")
    process.send_signal(sent)
    stdout, stderr = process.communicate(timeout=20)
    assert process.returncode == 75, stderr
    assert signals_received(job) == [expected]
    assert len(attempts(job)) == 1
    assert "not restarting" in stderr


def test_a_second_sigint_kills_the_command(job):
    process = start_launch(job, "wait", [sys.executable, str(FAKE_JOB)])
    wait_for(lambda: (job / "ready.0.1").exists(), what="the command to start")
    process.send_signal(signal.SIGINT)
    wait_for(lambda: signals_received(job) == ["SIGINT"], what="the first SIGINT to arrive")
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=20)
    assert process.returncode == 128 + signal.SIGKILL, stderr
    assert "second SIGINT: killed" in stderr
    assert len(attempts(job)) == 1


def test_processes_left_behind_by_an_attempt_are_killed(job):
    result = launch(job, "orphan:70", [sys.executable, str(FAKE_JOB)], "--max-restarts", "0")
    assert result.returncode == 70
    orphan = int((job / "orphan.pid").read_text())
    wait_for(lambda: not _alive(orphan), timeout=5, what=f"pid {orphan} to be gone")
    assert "killed 1 process(es) the command left running" in result.stderr


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def test_under_mpiexec_a_killed_rank_restarts_and_sigterm_becomes_a_checkpoint(job):
    # Attempt 1: rank 1 dies of SIGKILL, mpiexec ends the job. Attempt 2 (with --resume): both
    # ranks wait; launch turns its SIGTERM into SIGUSR2, which mpiexec forwards to every rank.
    command = mpiexec_command(2, *fake_train(job, "--run-dir", "runs/m"))
    process = start_launch(job, "kill@1,wait", command, "--max-restarts", "2")
    try:
        wait_for(lambda: all((job / f"ready.{rank}.2").exists() for rank in (0, 1)), timeout=40,
                 what="the second attempt's ranks to start")
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            process.send_signal(signal.SIGINT)
            process.communicate(timeout=10)
    assert process.returncode == 75, stderr
    first, second = attempts(job)
    assert "--resume" not in first and second[second.index("--resume") + 1] == "runs/m"
    assert "previous attempt exited with 137 (a process was killed by SIGKILL)" in stderr
    assert signals_received(job, 0) == signals_received(job, 1) == ["SIGUSR2"]


def test_a_killed_mpiexec_leaves_no_session_directory_for_a_later_one_to_trip_on(tmp_path):
    # prterun killed by SIGKILL (here by its own rank) cannot remove $TMPDIR/ompi.PID; a later
    # prterun given the same pid would fail to start on it (exit 213), so launch removes it.
    (tmp_path / "tmp").mkdir()
    command = mpiexec_command(1, "sh", "-c", "kill -9 $PPID; sleep 30")
    result = subprocess.run([str(BIN / "mpirl"), "launch", "--restart-delay", "0",
                             "--max-restarts", "1", "--", *command], capture_output=True,
                            text=True, timeout=60, env=mpi_env({"TMPDIR": str(tmp_path / "tmp")}))
    assert result.returncode == 137, result.stderr
    assert result.stderr.count("was killed by SIGKILL") == 2  # both attempts' prterun
    assert not [p.name for p in (tmp_path / "tmp").glob("ompi.*") if p.name[5:].isdigit()]


def test_the_session_directories_of_dead_launchers_go_and_the_others_stay(tmp_path, monkeypatch):
    import tempfile

    from mpirl.jobs.launch import remove_dead_launchers_session_dirs

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    for name in (f"ompi.{dead.pid}", f"ompi.{os.getpid()}", "ompi.vm.0"):
        (tmp_path / name / "0").mkdir(parents=True)
        (tmp_path / name / "pmix.vm.tool").write_text("rendezvous")
    assert remove_dead_launchers_session_dirs() == [dead.pid]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"ompi.{os.getpid()}",
                                                                 "ompi.vm.0"])


def test_launch_stays_outside_mpi_and_rejects_bad_input(tmp_path):
    check = "import sys, mpirl.cli; assert 'mpi4py.MPI' not in sys.modules, 'MPI imported'"
    subprocess.run([sys.executable, "-c", check], check=True, timeout=30)
    for args, message in [
        ([], "no COMMAND given"),
        (["--max-restarts", "-1", "--", "true"], "--max-restarts must be 0 or more"),
        (["--", str(tmp_path / "missing")], "cannot run"),
    ]:
        result = subprocess.run([str(BIN / "mpirl"), "launch", *args], capture_output=True,
                                text=True, timeout=30, env=dict(os.environ))
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr)


def test_launch_survives_killed_rollout_and_learner_ranks(tmp_path):
    """The whole story: kill -9 a rollout rank, then (after the automatic restart) a learner
    rank; mpirl launch resumes from the newest checkpoint each time and the run reaches its
    stop criterion, with every iteration in progress.csv exactly once. (That a resumed run
    learns exactly as an uninterrupted one is test_checkpoints.py's bit-identity test.)"""
    import csv

    from conftest import LAUNCHER_FAILURES, LiveRun

    run_dir = tmp_path / "run"
    every = 3
    # Room for two more attempts than the kills need: Open MPI's launcher may fail before it
    # starts any rank (conftest.LAUNCHER_FAILURES), and mpirl launch then simply tries again.
    command = [str(BIN / "mpirl"), "launch", "--max-restarts", "5", "--restart-delay", "1", "--",
               *mpiexec_command(4, str(BIN / "mpirl"), "train", "--algo", "PPO", "--env",
                                "CartPole-v1", "--run-dir", str(run_dir), "--config",
                                json.dumps({"num_learners": 1, "checkpoint_every": every}),
                                "--stop", '{"training_iteration": 15}')]
    run = LiveRun(0, command=command)

    def checkpoint_at_least(iteration):
        latest = run_dir / "checkpoints" / "latest"
        return latest.is_file() and int(latest.read_text().split("_")[1]) >= iteration

    tables_seen = 0
    for victim, after in (("rollout", every), ("learner", 2 * every)):
        run.wait_until(lambda a=after: checkpoint_at_least(a), f"a checkpoint at iteration {after}")
        run.wait_until(lambda t=tables_seen: run.stdout.count("mpirl layout:") > t,
                       "the layout table")
        tables_seen = run.stdout.count("mpirl layout:")
        pid = next(pid for role, pid in run.pids().values() if role == victim)
        os.kill(pid, signal.SIGKILL)
        run.wait_until(lambda t=tables_seen: run.stdout.count("mpirl layout:") > t,
                       f"a restart after killing the {victim}", timeout=120)
    assert run.finish(timeout=240) == 0, run.stderr[-3000:]
    launcher_failures = sum(run.stderr.count(failure) for failure in LAUNCHER_FAILURES)
    assert run.stderr.count("resuming from") == 2 + launcher_failures, run.stderr[-3000:]
    assert run.stdout.count(f"resumed from {run_dir}/checkpoints/checkpoint_") == 2
    with open(run_dir / "progress.csv") as file:
        rows = list(csv.DictReader(file))
    assert [int(r["iteration"]) for r in rows] == list(range(1, 16))
