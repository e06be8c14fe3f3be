"""Start-up: what mpirl sets before MPI_Init so that every rank starts fast."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import mpi_env, mpiexec_command

from mpirl import _all_ranks_on_one_node

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

