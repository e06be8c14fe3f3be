"""Runs nested in sub-communicators (``mpirl.run(..., comm=sub)``), the ground ``mpirl tune``
stands on: COMM_WORLD split into an idle rank 0 and two trial slots of 2 ranks, each slot running
ordinary runs on its own communicator, several in a row on the same processes
(tests/programs/nested_runs.py)."""

from __future__ import annotations

import csv
import json
import re
import sys

import pytest
from conftest import PROGRAMS, parse_result, run_mpi
from mpi4py import MPI

from mpirl.runtime.world import nested, run_comm, running_on

PROGRAM = str(PROGRAMS / "nested_runs.py")


def by_world_rank(records: list[dict]) -> dict[int, dict]:
    return {record["world_rank"]: record for record in records}


def test_consecutive_runs_on_sub_communicators():
    proc = run_mpi(5, sys.executable, PROGRAM, "calls", timeout=90)
    assert proc.returncode == 0, proc.stderr
    records = by_world_rank(parse_result(proc.stdout))
    assert sorted(records) == [0, 1, 2, 3, 4]
    assert records[0]["runs"] == []  # world rank 0 took part in no run
    for slot, (driver_rank, worker_rank) in enumerate([(1, 2), (3, 4)]):
        driver, worker = records[driver_rank], records[worker_rank]
        labels = [f"slot{slot}-first", f"slot{slot}-second", "everyone"]
        assert [run["label"] for run in driver["runs"]] == labels
        assert [run["label"] for run in worker["runs"]] == labels
        # Each run's exit code reaches every rank of that run: slot 1's second run failed
        # (its driver program raised), slot 0's returned 3; both slots went on running.
        codes = [0, 3 if slot == 0 else 1, 0]
        assert [run["code"] for run in driver["runs"]] == codes
        assert [run["code"] for run in worker["runs"]] == codes
        for run in driver["runs"][:2]:
            # The slot's first rank drives (rank 0 of the run), the layout fits the slot.
            assert run["driver"] == {"run_rank": 0, "run_size": 2, "nested": True,
                                     "world_rank": driver_rank, "world_size": 2}
            assert run["workers"] == [{"label": run["label"], "context_rank": 1,
                                       "run_rank": 1, "run_size": 2,
                                       "world_rank": worker_rank, "nested": True}]
        # After every run the run's communicator is COMM_WORLD again, and the slot's own
        # communicator still works.
        for record in (driver, worker):
            assert all(run["restored"] for run in record["runs"])
            assert record["slot_sum"] == 2
            # srun's task count is checked against COMM_WORLD (5), not the run's communicator.
            assert record["refused"] is True
    # The last run spans both slots on a new communicator: world rank 1 drives 3 rollouts.
    everyone = records[1]["runs"][2]
    assert everyone["driver"]["run_size"] == 4 and everyone["driver"]["world_rank"] == 1
    assert [(w["run_rank"], w["world_rank"]) for w in everyone["workers"]] == [
        (1, 2), (2, 3), (3, 4)]
    assert "slot1-second fails on purpose" in proc.stderr
    assert "slot0" not in proc.stderr


def test_two_slots_train_ppo_concurrently_twice(tmp_path):
    proc = run_mpi(5, sys.executable, PROGRAM, "train", str(tmp_path), timeout=120)
    assert proc.returncode == 0, proc.stderr
    records = by_world_rank(parse_result(proc.stdout))
    for slot, (driver_rank, worker_rank) in enumerate([(1, 2), (3, 4)]):
        # Only each slot's driver gets the rows (as rank 0 does in an ordinary run).
        assert records[worker_rank]["rows"] == [None, None]
        assert records[driver_rank]["rows"] == [{"iteration": 2, "timesteps_total": 128},
                                                {"iteration": 2, "timesteps_total": 256}]
        for trial in range(2):
            run_dir = tmp_path / f"slot{slot}-trial{trial}"
            with open(run_dir / "progress.csv") as file:
                rows = list(csv.DictReader(file))
            assert [row["iteration"] for row in rows] == ["1", "2"]
            params = json.loads((run_dir / "params.json").read_text())
            assert params["world_size"] == 2
            assert params["layout"]["summary"].startswith("driver 1, rollout 1,")
            assert json.loads((run_dir / "result.json").read_text())["iteration"] == 2
        assert records[driver_rank]["restored"] and records[worker_rank]["restored"]
    # Each slot's driver said where its results are, once per trial.
    stopped = sorted(re.findall(r"Results in (\S+)", proc.stdout))
    assert stopped == sorted(str(tmp_path / f"slot{s}-trial{t}") for s in (0, 1) for t in (0, 1))


def test_a_lost_rank_in_a_nested_run_is_named_by_its_run_and_ends_the_job():
    proc = run_mpi(5, sys.executable, PROGRAM, "lost", timeout=60)
    assert proc.returncode == 70, proc.stdout + proc.stderr
    frozen = re.search(r"FREEZING pid (\d+)", proc.stdout)
    assert frozen, proc.stdout
    # Ranks as the nested run numbers them: its driver (world rank 3) is rank 0, the frozen
    # worker (world rank 4) rank 1.
    assert re.search(rf"lost rank 1 \(rollout 0\) on \S+ \(pid {frozen[1]}\): no heartbeat",
                     proc.stderr), proc.stderr
    assert "seen from rank 0 (driver 0)" in proc.stderr


def test_running_on_sets_and_restores_the_run_communicator():
    assert run_comm() == MPI.COMM_WORLD and not nested()
    with running_on(MPI.COMM_SELF) as comm:
        assert comm == MPI.COMM_SELF and run_comm() == MPI.COMM_SELF and nested()
        with running_on(None):  # None keeps the current one
            assert run_comm() == MPI.COMM_SELF
        with pytest.raises(ValueError, match="COMM_NULL"):
            with running_on(MPI.COMM_NULL):
                pass
        assert run_comm() == MPI.COMM_SELF
    assert run_comm() == MPI.COMM_WORLD and not nested()
