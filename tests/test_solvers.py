"""Solvers as separate programs (MPMD): the start-up handshake (mpirl.runtime.apps), the C
library (mpirl/envs/solver/mpirl_solver.c) and the Fortran module, against the example solvers
of examples/solvers. tests/programs/solver_link_check.py plays the rollout side of sim_link by
hand; each test is one mpiexec."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import BIN, PROGRAMS, parse_result, run_mpi

CHECK = str(PROGRAMS / "solver_link_check.py")
PYTHON = sys.executable
#: Open MPI's note when a process exits non-zero before the others: a solver must not cause it.
NON_ZERO_NOTE = "exited with non-zero status"


def link_check(mode: str, k: int, solver: str, *solver_args: str, timeout_s: str = "600",
               solvers: int = 2):
    proc = run_mpi(1, PYTHON, CHECK, mode, str(k), timeout_s, ":", "-n", str(solvers), solver,
                   *solver_args, timeout=60)
    return proc, parse_result(proc.stdout)


@pytest.mark.parametrize("k", [2, 1])
def test_the_c_solver_answers_resets_pings_and_steps_in_groups_of_k(built_solvers, k):
    proc, result = link_check("steps", k, built_solvers.path("echo_solver"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # One group of two ranks (each computes half the observation), or two groups of one.
    assert result["solvers"] == 2 and result["run_size"] == 1
    assert result["groups"] == 2 // k and result["steps_checked"] == 3 * (2 // k)
    assert [row[:2] for row in result["table"]] == [[1, 0], [2, 1]]
    assert all(row[3].endswith("echo_solver") for row in result["table"])
    assert NON_ZERO_NOTE not in proc.stderr


def test_the_fortran_solver_speaks_the_same_protocol(built_solvers):
    proc, result = link_check("steps", 2, built_solvers.fortran("echo_solver_f"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert result["groups"] == 1 and result["steps_checked"] == 3


def test_a_run_that_ends_before_its_groups_start_ends_its_solvers_quietly(built_solvers):
    proc, result = link_check("early", 2, built_solvers.path("echo_solver"))
    # END carried the code (3); the solvers leave with 0 so that mpirl's rank 0 reports it.
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert result["solvers"] == 2
    assert "echo_solver: the run ended before it began (exit code 3)" in proc.stderr
    assert NON_ZERO_NOTE not in proc.stderr


def test_mpirl_fail_sends_its_message_and_the_other_groups_end(built_solvers):
    # Two groups of one: group 0 fails at step 2, group 1 hears END afterwards.
    proc, result = link_check("fail", 1, built_solvers.path("echo_solver"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert result["failed_at"] == 2 and result["message"] == "echo_solver: fail_at step 2"
    assert NON_ZERO_NOTE not in proc.stderr


def test_a_solver_that_never_calls_mpirl_init_is_named_at_the_deadline(built_solvers):
    proc, _ = link_check("steps", 1, built_solvers.path("echo_solver"), "--no-init", "30",
                         timeout_s="1")
    assert proc.returncode == 70, proc.stdout + proc.stderr
    assert ("mpirl: world ranks 1-2 did not arrive within startup_timeout_s 1 s; an MPMD "
            "solver must call mpirl_init first (exit code 70).") in proc.stderr


def test_a_solver_at_world_rank_0_says_mpirl_comes_first(built_solvers):
    solver = built_solvers.path("echo_solver")
    proc = run_mpi(1, solver, ":", "-n", "1", PYTHON, CHECK, "steps", "1", timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (f"mpirl_init: {solver} is world rank 0, but an MPMD launch starts mpirl first: "
            f"mpiexec -n N mpirl ... : -n S {solver}") in proc.stderr


def test_mpirl_processes_after_the_solvers_are_refused(built_solvers):
    proc = run_mpi(1, PYTHON, CHECK, "steps", "1", ":", "-n", "1",
                   built_solvers.path("echo_solver"), ":", "-n", "1", PYTHON, CHECK, "steps",
                   "1", timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert ("mpirl: world rank 2 runs mpirl after the solver's first process (world rank 1); "
            "an MPMD launch gives mpirl's processes first") in proc.stderr


def test_mpirl_refusing_its_layout_ends_the_solvers_with_its_code(built_solvers):
    # The CLI joins the apps before anything else: the layout counts mpirl's 2 ranks only, and
    # its error (exit 2) reaches the solvers as END instead of leaving them waiting.
    proc = run_mpi(2, str(BIN / "mpirl"), "doctor", "--config",
                   '{"num_rollout_workers": 5, "ranks_per_env": 1}', ":",
                   "-n", "2", built_solvers.path("echo_solver"), timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("mpirl: error: The layout needs 6 ranks") and \
        "the MPI world has 2" in lines[0], proc.stderr
    assert lines[1:] == ["echo_solver: the run ended before it began (exit code 2)"]


def test_python_m_mpirl_envs_solver_prints_the_files_a_build_needs(capsys):
    from mpirl.envs.solver.__main__ import main

    assert main(["--include", "--source", "--fortran"]) == 0
    include, source, fortran = map(Path, capsys.readouterr().out.split())
    assert (include / "mpirl_solver.h").is_file()
    assert source == include / "mpirl_solver.c" and source.is_file()
    assert fortran == include / "mpirl.f90" and fortran.is_file()
