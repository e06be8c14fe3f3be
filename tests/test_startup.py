"""Start-up: what mpirl sets before MPI_Init so that every rank starts fast, and the phases
startup.json reports (the file itself is checked in test_long_runs)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from conftest import mpi_env, mpiexec_command

from mpirl import _all_ranks_on_one_node
from mpirl.runtime import startup

ONE_NODE_CASES = [
    ({"OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "3"}, True),
    ({"OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, False),
    ({"SLURM_STEP_NUM_NODES": "1", "PMIX_RANK": "0"}, True),
    ({"SLURM_STEP_NUM_NODES": "2", "PMIX_RANK": "0"}, False),
    ({}, True),  # a singleton
    ({"PMI_RANK": "0", "PMI_SIZE": "64"}, False),  # some other launcher: maybe many nodes
]


@pytest.mark.parametrize(("environ", "one_node"), ONE_NODE_CASES)
def test_one_node_is_read_from_the_launchers_variables(environ, one_node):
    assert _all_ranks_on_one_node(environ) is one_node


# Each rank imports mpirl before MPI, then shows what MPI_Init saw and that ranks still talk.
RANK_PROGRAM = (
    "import os, mpirl\n"
    "from mpi4py import MPI\n"
    "total = MPI.COMM_WORLD.allreduce(1)\n"
    "print('BTL', os.environ.get('OMPI_MCA_btl'), total, flush=True)\n"
)


def _btl_seen_by_ranks(env_btl: str | None) -> list[str]:
    env = mpi_env()
    env.pop("OMPI_MCA_btl", None)  # the test process's own import of mpirl set it
    if env_btl is not None:
        env["OMPI_MCA_btl"] = env_btl
    proc = subprocess.run(mpiexec_command(2, sys.executable, "-c", RANK_PROGRAM),
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    return sorted(line for line in proc.stdout.splitlines() if line.startswith("BTL"))


def test_ranks_on_one_node_start_without_the_libfabric_btl():
    assert _btl_seen_by_ranks(None) == ["BTL ^ofi 2", "BTL ^ofi 2"]


def test_a_btl_the_user_chose_wins():
    assert _btl_seen_by_ranks("self,sm,tcp") == ["BTL self,sm,tcp 2", "BTL self,sm,tcp 2"]



def test_phases_are_named_by_the_point_that_ends_them_and_skip_missing_points():
    points = {"process_start": 10.0, "mpirl_imported": 10.1, "mpi_ready": 10.3,
              "run_start": 12.0, "first_iteration": 13.5}
    assert startup.phases(points) == {"mpirl_imported": 0.1, "mpi_ready": 0.2, "run_start": 1.7,
                                      "first_iteration": 1.5}


def test_the_report_names_the_slowest_rank_and_counts_from_the_first_process_start():
    driver = {"process_start": 10.0, "mpi_ready": 10.5, "first_iteration": 14.0}
    ranks = [driver, {"process_start": 9.8, "mpi_ready": 11.8}, {"process_start": 10.1,
                                                                    "mpi_ready": 10.2}]
    report = startup.report(driver, ranks)
    assert report["ranks"] == 3
    assert report["launch_to_first_iteration_s"] == 4.2  # from rank 1's start at 9.8
    assert report["slowest_rank_phases_s"]["mpi_ready"] == {"rank": 1, "seconds": 2.0}
    assert report["driver_phases_s"] == {"mpi_ready": 0.5, "first_iteration": 3.5}


def test_a_fresh_process_started_before_mpirl_was_imported():
    """In a process of its own: the suite's process may have started hours ago on CI."""
    launched = time.time()
    out = subprocess.run(
        [sys.executable, "-c", "import mpirl, json; from mpirl.runtime import startup; "
         "print(json.dumps([startup.process_start_time(), mpirl._IMPORTED_AT, "
         "list(startup.marks())[:2]]))"],
        capture_output=True, text=True, timeout=60, check=True).stdout
    started, imported, first_points = json.loads(out)
    assert started is not None, "Linux's /proc gives the start time"
    # Clock ticks are 10 ms; the kernel's start time is rounded down to one.
    assert launched - 0.05 < started <= imported + 0.05
    assert imported < time.time()
    assert first_points == ["process_start", "mpirl_imported"]


def test_an_unknown_point_is_refused_and_a_point_is_kept_from_its_first_mark():
    with pytest.raises(ValueError, match="unknown start-up point 'warmup'"):
        startup.mark("warmup")
    startup.mark("workers_built", at=5.0)
    startup.mark("workers_built", at=9.0)
    assert startup.marks()["workers_built"] == 5.0
