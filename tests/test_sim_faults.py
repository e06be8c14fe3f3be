"""Faults of env groups, each injected for real: the example C solver's fault keys
(examples/solvers/solver_faults.h) and a Python simulation's hang. Each fault is one line,
with exit 2 or a clean recovery, and every process of the job ends.

The rollout side's checks (sizes, non-finite numbers) run against the C solver through
tests/programs/sim_faults_check.py (SimEnvs without a run around it: no torch, one mpiexec of
two processes). Faults that end a run are checked end to end with ``mpirl train`` and, for a
killed solver, ``mpirl launch``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import (
    BIN,
    PROGRAMS,
    cli_in_process,
    latest_checkpoint_iteration,
    mpi_env,
    mpiexec_command,
    parse_result,
    run_mpi,
)

from mpirl.jobs.launch import check_mpmd_programs, lost_solver_rank, mpmd_programs

CHECK = str(PROGRAMS / "sim_faults_check.py")
RD = {"observation_size": 8, "action_size": 4}
SOLVER_ENV = "mpirl.envs.simulation:Solver"


def check(solver: str, faults: dict, steps: int = 6, solvers: int = 1,
          max_failures: int = 3) -> dict:
    proc = run_mpi(1, sys.executable, CHECK, json.dumps({**RD, **faults}), str(steps), "10",
                   str(max_failures), ":", "-n", str(solvers), solver, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return parse_result(proc.stdout)


def mpirl_lines(proc: subprocess.CompletedProcess) -> list[str]:
    """mpirl's lines on stderr (Open MPI's abort note may come first and leave a space before
    the next line it forwards)."""
    assert "Traceback" not in proc.stderr, proc.stderr
    return [line.strip() for line in proc.stderr.splitlines()
            if line.strip().startswith("mpirl:")]


# --- the rollout side against the C solver's faults ------------------------------------------

@pytest.mark.parametrize("by, solvers, said", [
    (1, 1, "sent 13 numbers per reply at step 3"),
    # Longer than the row's spare column: MPI truncates it; two groups, each on its own clock.
    (5, 2, "sent more than 13 numbers per reply at step 3")])
def test_a_reply_of_the_wrong_size_names_the_group_and_both_sizes(built_solvers, by, solvers,
                                                                   said):
    faults = {"wrong_size_at": 3, "wrong_size_by": by, "fault_group": solvers - 1}
    result = check(built_solvers.path("rd_solver"), faults, solvers=solvers)
    group = solvers - 1
    assert result["error"] == [
        "SimulationError", f"env group {group} (solver rank {group}) of the check {said}; "
        f"observation_size 8 needs 12 (seq, reward, terminated, truncated, obs)"]


def test_non_finite_replies_are_env_failures_until_max_env_failures(built_solvers):
    # NaN rewards from step 2 on: steps 2 and 3 are env failures (the group is reset, the
    # episode dropped), the third in a row ends it, naming the group.
    result = check(built_solvers.path("rd_solver"), {"nan_at": 2, "nan_steps": 10})
    assert result["steps"] == 3 and result["failures"] == 2, result
    assert result["error"] == [
        "EnvFailureError", "env group 0 (solver rank 0) of the check sent non-finite numbers "
        "(NaN or inf) 3 times in a row; fix the simulation, or allow more with "
        "max_env_failures (now 3)"]


def test_one_non_finite_reply_is_recovered_from(built_solvers):
    result = check(built_solvers.path("rd_solver"), {"nan_at": 2})
    assert result == {"steps": 6, "failures": 1, "error": None}


# --- a Python simulation on env ranks that hangs --------------------------------------------

def test_a_hanging_python_simulation_ends_the_job_naming_its_group(tmp_path):
    config = {"ranks_per_env": 1, "num_envs_per_worker": 1, "rollout_fragment_length": 8,
              "num_epochs": 1, "minibatch_size": 8, "print_layout": False,
              "env_step_timeout_s": 2, "env_config": {"hang_at": 3}}
    proc = run_mpi(3, str(BIN / "mpirl"), "train", "--algo", "PPO", "--env",
                   "mpirl.testing:SplitVectorSimulation", "--config", json.dumps(config),
                   "--run-dir", str(tmp_path / "run"), timeout=60)
    # The stuck env rank takes no stop: the driver aborts the job at once (no 30 s wait for
    # the workers), and run_mpi's timeout would catch a process left behind.
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = mpirl_lines(proc)
    assert lines == ["mpirl: env group 0 (ranks 2) of rollout worker 0 on rank 1 did not answer "
                     "step 3 within env_step_timeout_s 2 s"], proc.stderr


# --- mpirl launch with a solver program ------------------------------------------------------

def test_launch_finds_the_programs_after_each_colon():
    command = ["mpiexec", "--oversubscribe", "-n", "2", "mpirl", "train", "--env", "x", ":",
               "-n", "4", "--mca", "btl", "self", "-x", "A=1", "./rd_solver", "-v", ":",
               "--np=2", "--wdir", "/tmp", "other", "--flag"]
    assert [(p.program, p.count) for p in mpmd_programs(command)] == [
        ("./rd_solver", 4), ("other", 2)]
    assert mpmd_programs(["mpiexec", "-n", "2", "mpirl", "train"]) == []


def test_launch_refuses_a_program_after_a_colon_that_is_not_executable(tmp_path, capsys):
    solver = tmp_path / "rd_solver"
    solver.write_text("#!/bin/sh\n")
    assert check_mpmd_programs(["mpiexec", "-n", "1", "mpirl", "train", ":", "-n", "1",
                                str(solver)]) == [f"{solver} (after ':') is not an executable file"]
    solver.chmod(0o755)
    assert check_mpmd_programs(["mpirl", ":", "-n", "1", str(solver)]) == []
    assert check_mpmd_programs(["mpirl", ":", "-n", "1", "no_such_solver_here"]) == [
        "no_such_solver_here (after ':') is not on PATH; give its path, e.g. "
        "./no_such_solver_here"]
    # End to end: nothing is started (mpiexec would start mpirl's ranks first).
    code, stderr = cli_in_process(capsys, "launch", "--", str(BIN / "mpiexec"), "-n", "1",
                                  str(BIN / "mpirl"), "train", "--algo", "PPO", ":", "-n", "1",
                                  "./rd_solvr")
    assert code == 2
    assert stderr == "mpirl launch: error: ./rd_solvr (after ':') is not an executable file\n"


def test_launch_names_a_lost_solver_rank_from_the_launchers_note(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    layout = {"world_size": 2, "env_groups": [
        {"group": 0, "rollout_rank": 1, "ranks": [0, 1], "external": True},
        {"group": 1, "rollout_rank": 1, "ranks": [2, 3], "external": True}]}
    (run_dir / "params.json").write_text(json.dumps({"layout": layout}))
    command = ["mpiexec", "-n", "2", "mpirl", "train", ":", "-n", "4", "./rd_solver"]
    note = ("prterun noticed that process rank 5 with PID 4321 on node n1 exited on\n"
            "signal 9 (Killed).")
    assert lost_solver_rank(note, str(run_dir), command) == (
        "world rank 5 was solver rank 3 of env group 1 (./rd_solver, pid 4321)")
    exited = "   Process name: [prterun-n1-777@1,2]\n   Exit code:    3\n"
    assert lost_solver_rank(exited, str(run_dir), command) == (
        "world rank 2 was solver rank 0 of env group 0 (./rd_solver, exit code 3)")
    # What the solver said of itself (params.json, a run's solver table) comes first.
    layout["env_groups"][1].update(world_ranks=[4, 5], program="/abs/rd_solver")
    (run_dir / "params.json").write_text(json.dumps({"layout": layout}))
    assert lost_solver_rank(note, str(run_dir), command) == (
        "world rank 5 was solver rank 3 of env group 1 (/abs/rd_solver, pid 4321)")
    # An mpirl rank, or no note: launch says nothing more than it did.
    assert lost_solver_rank(note.replace("rank 5", "rank 1"), str(run_dir), command) is None
    assert lost_solver_rank("", str(run_dir), command) is None


# --- runs beside a solver program (MPMD) ------------------------------------------------------

def solver_train(tmp_path, n: int, solver: str, env_config: dict, *solver_args: str,
                 **config) -> subprocess.CompletedProcess:
    """``mpiexec -n N mpirl train (PPO, 8 steps an iteration) : -n 1 SOLVER``, to its end."""
    settings = {"ranks_per_env": 1, "num_envs_per_worker": 1, "rollout_fragment_length": 8,
                "num_epochs": 1, "minibatch_size": 8, "print_layout": False,
                "env_step_timeout_s": 2, "env_config": {**RD, **env_config}, **config}
    return run_mpi(n, str(BIN / "mpirl"), "train", "--algo", "PPO", "--env", SOLVER_ENV,
                   "--config", json.dumps(settings), "--stop", '{"training_iteration": 2}',
                   "--run-dir", str(tmp_path / "run"), ":", "-n", "1", solver, *solver_args,
                   timeout=90)




def test_a_hanging_solver_ends_the_job_naming_its_group_program_and_step(tmp_path,
                                                                          built_solvers):
    solver = built_solvers.path("rd_solver")
    proc = solver_train(tmp_path, 2, solver, {"hang_at": 3})
    # The solver sleeps on: only MPI_Abort ends it (and run_mpi's timeout would catch a hang).
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "rd_solver: env group 0 hangs at step 3 (hang_at)" in proc.stderr
    assert mpirl_lines(proc) == [
        f"mpirl: env group 0 ({solver}, solver ranks 0) of rollout worker 0 on rank 1 did not "
        f"answer step 3 within env_step_timeout_s 2 s"], proc.stderr


def test_a_solvers_own_failure_ends_the_run_with_its_message(tmp_path, built_solvers):
    # Local mode (one mpirl process drives the group): the solver's message, exit 2, and the
    # solver leaves quietly (mpirl's rank 0 gives the job's code).
    solver = built_solvers.path("rd_solver")
    proc = solver_train(tmp_path, 1, solver, {"fail_at": 3})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert mpirl_lines(proc) == [
        f"mpirl: env group 0 ({solver}, solver ranks 0) of rollout worker 0 on rank 0 failed at "
        f"step 3: rd_solver: fail_at step 3"], proc.stderr
    assert "exited with non-zero status" not in proc.stderr


def test_a_solver_that_never_calls_mpirl_init_is_named_at_the_start_up_deadline(
        tmp_path, built_solvers):
    proc = solver_train(tmp_path, 1, built_solvers.path("echo_solver"), {}, "--no-init", "30",
                        startup_timeout_s=3)
    assert proc.returncode == 70, proc.stdout + proc.stderr
    assert mpirl_lines(proc) == [
        "mpirl: world rank 1 did not arrive within startup_timeout_s 3 s; an MPMD solver must "
        "call mpirl_init first (exit code 70)."], proc.stderr


@pytest.fixture(scope="module")
def killed_under_launch(tmp_path_factory, built_solvers):
    """``mpirl launch`` of a run beside rd_solver (local mode, checkpoints every iteration, 3
    iterations) whose solver hangs at its 20th step (iteration 3), where the test kills it with
    kill -9: the solver, its pid, launch's exit code and stderr, the run directory."""
    solver = built_solvers.path("rd_solver")
    run_dir = tmp_path_factory.mktemp("killed") / "run"
    config = {"ranks_per_env": 1, "num_envs_per_worker": 1, "rollout_fragment_length": 8,
              "num_epochs": 1, "minibatch_size": 8, "print_layout": False,
              "checkpoint_every": 1, "env_step_timeout_s": 10,
              "env_config": {**RD, "hang_at": 20}}
    train = mpiexec_command(1, str(BIN / "mpirl"), "train", "--algo", "PPO", "--env",
                            SOLVER_ENV, "--config", json.dumps(config), "--stop",
                            '{"training_iteration": 3}', "--run-dir", str(run_dir), ":", "-n",
                            "1", solver)
    launch = subprocess.Popen([str(BIN / "mpirl"), "launch", "--max-restarts", "1",
                               "--restart-delay", "0", "--", *train], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, env=mpi_env(),
                              start_new_session=True)
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(launch.stderr), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 90
        while not ("hangs at step 20" in "".join(err) and
                   latest_checkpoint_iteration(run_dir) == 2):
            assert launch.poll() is None and time.monotonic() < deadline, "".join(err)
            time.sleep(0.05)
        layout = json.loads((run_dir / "params.json").read_text())["layout"]
        pid = layout["env_groups"][0]["pids"][0]
        os.kill(pid, signal.SIGKILL)
        launch.wait(timeout=90)
    finally:
        if launch.poll() is None:
            os.killpg(launch.pid, signal.SIGKILL)
            launch.wait()
    reader.join(timeout=10)
    return solver, pid, launch.returncode, "".join(err), run_dir


def test_a_solver_killed_with_kill_9_is_named_and_the_run_resumes_under_launch(
        killed_under_launch):
    """Open MPI's launcher names the killed world rank; launch names its env group and resumes
    from checkpoint 2 with a new solver process, which finishes the run."""
    solver, pid, code, stderr, run_dir = killed_under_launch
    assert code == 0, stderr
    assert (f"mpirl launch: world rank 1 was solver rank 0 of env group 0 ({solver}, pid "
            f"{pid}); resuming from checkpoint 2") in stderr, stderr
    assert stderr.count("hangs at step 20") == 1  # the new solver had 8 steps to take
    assert len((run_dir / "progress.csv").read_text().splitlines()) == 1 + 3


def test_mpirl_evaluate_ends_past_a_hanging_solver(killed_under_launch):
    # The run's env_config has the solver hang at its 20th step: within evaluate's episode.
    solver, _, _, _, run_dir = killed_under_launch
    proc = run_mpi(1, str(BIN / "mpirl"), "evaluate", str(run_dir), "--episodes", "1", ":",
                   "-n", "1", solver, timeout=90)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = mpirl_lines(proc)
    assert len(lines) == 1 and lines[0].startswith("mpirl: error: env group 0 (") and \
        lines[0].endswith("did not answer step 20 within env_step_timeout_s 10 s"), proc.stderr
