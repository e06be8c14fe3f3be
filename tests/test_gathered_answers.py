"""The rollout ranks' answers to a synchronous sampling round reach rank 0 through one gather on
weights_comm, not a message each (``sample_with_new_weights``); the fake-worker side of it is in
test_sample_with_weights."""

from __future__ import annotations

import csv
import json
import sys

from conftest import run_mpi

MPIRL = [sys.executable, "-m", "mpirl"]

GATHER_PROGRAM = r"""
import json
from mpi4py import MPI
from mpirl.runtime.ulfm import gather_bytes
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
# Sizes differ, one is empty (a call that raised sends no metrics) and one is over 16 kB.
payload = bytes([rank]) * {0: 0, 1: 3, 2: 0, 3: 40_000}.get(rank, rank)
parts = gather_bytes(comm, payload, 60.0, "the test gather")
if rank == 0:
    print(json.dumps([[len(p), sorted(set(p))] for p in parts]))
else:
    assert parts is None
"""


def test_gather_bytes_hands_rank_0_every_payload_in_rank_order():
    proc = run_mpi(5, sys.executable, "-c", GATHER_PROGRAM, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [
        [0, []], [3, [1]], [0, []], [40_000, [3]], [4, [4]]]


def test_ppo_rank_0_takes_no_message_per_answer(tmp_path):
    """With the learner on rank 0 each rollout rank sends it one message per iteration, its
    batch; the answers come in the gather (a message each would make 3 per rollout rank: the
    call, the batch and the answer)."""
    run_dir = tmp_path / "run"
    proc = run_mpi(5, *MPIRL, "train", "--algo", "PPO", "--env", "CartPole-v1", "--run-dir",
                   str(run_dir), "--progress", "off", "--config",
                   json.dumps({"num_epochs": 1, "rollout_fragment_length": 32}),
                   "--stop", '{"training_iteration": 4}', timeout=240)
    assert proc.returncode == 0, proc.stderr
    with open(run_dir / "progress.csv") as file:
        rows = list(csv.DictReader(file))
    rollout_ranks = int(float(rows[-1]["num_rollout_workers"]))
    assert rollout_ranks == 4
    # Iterations 2-4 (the first has the startup's messages): a call and a batch per rank.
    for row in rows[1:]:
        assert float(row["perf/driver_msgs_per_iter"]) == 2 * rollout_ranks, row
    assert float(rows[-1]["timesteps_total"]) == 4 * 4 * 32 * int(
        json.loads((run_dir / "params.json").read_text())["config"]["num_envs_per_worker"])
