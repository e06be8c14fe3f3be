"""Runs nested in sub-communicators, as ``mpirl tune`` will make them: COMM_WORLD split into an
idle rank 0 (the controller-to-be) and trial slots of 2 ranks each, every slot running ordinary
mpirl runs on its own communicator, one after another on the same processes.

    mpiexec -n 5 python nested_runs.py calls
    mpiexec -n 5 python nested_runs.py train RUN_ROOT
    mpiexec -n 5 python nested_runs.py lost      # slot 1's worker freezes: the job must end

Every rank records what it saw; world rank 0 gathers the records (waiting without spinning a
core) and prints one line ``RESULT {json}`` that tests/test_nested_runs.py asserts on.
"""

from __future__ import annotations

import json
import os
import sys
import time

from mpi4py import MPI

import mpirl
from mpirl.errors import LaunchError
from mpirl.runtime.core import Worker
from mpirl.runtime.world import nested, run_comm, run_rank, run_size

SLOT_SIZE = 2
SETTINGS = mpirl.RuntimeSettings(print_layout=False, startup_timeout_s=60,
                                 shutdown_timeout_s=20)


class Where(Worker):
    """Says where it runs: its rank in the run (context and accessor) and in COMM_WORLD."""

    MESSAGES = ("where", "freeze")

    def __init__(self, context, label: str) -> None:
        super().__init__(context)
        self.label = label

    def where(self) -> dict:
        return {"label": self.label, "context_rank": self.context.rank, "run_rank": run_rank(),
                "run_size": run_size(), "world_rank": MPI.COMM_WORLD.Get_rank(),
                "nested": nested()}

    def freeze(self) -> None:
        """Stop this process (SIGSTOP): silent, as a rank whose node hung."""
        import os
        import signal

        print(f"FREEZING pid {os.getpid()}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)


def one_run(comm: MPI.Comm, label: str, exit_code: int | None) -> dict:
    """One run of a trivial driver program on ``comm`` that returns ``exit_code`` (None:
    raises once its workers have answered); what this rank saw of it."""
    seen: dict = {}

    def main(driver: mpirl.Driver) -> int:
        group = driver.spawn("rollout", Where, label)
        seen["workers"] = group.call("where", timeout=30)
        seen["driver"] = {"run_rank": run_rank(), "run_size": run_size(), "nested": nested(),
                          "world_rank": MPI.COMM_WORLD.Get_rank(),
                          "world_size": driver.placement.world_size}
        if exit_code is None:
            raise RuntimeError(f"{label} fails on purpose")
        return exit_code

    code = run(main, comm)
    return {"label": label, "code": code, **seen,
            "restored": run_comm() == MPI.COMM_WORLD}


def run(main, comm: MPI.Comm) -> int:
    return mpirl.run(main, mpirl.Layout(num_rollout_workers=-1), SETTINGS, comm=comm)


def calls(world: MPI.Comm, slot_comm: MPI.Comm | None, slot: int) -> dict:
    record: dict = {"runs": []}
    # Every rank but 0: one communicator of 4 (a driver and 3 rollout workers) for the last run.
    everyone = world.Split(0 if world.Get_rank() else MPI.UNDEFINED, key=world.Get_rank())
    if slot_comm is None:
        return record
    # As if srun had started the job's 5 tasks: srun's count is checked against COMM_WORLD, so
    # runs on communicators of 2 and 4 ranks start...
    os.environ.update(SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS=str(world.Get_size()))
    os.environ.pop("OMPI_COMM_WORLD_SIZE", None)
    # Two runs in a row on the slot's communicator, with exit codes of their own (slot 1's
    # second run fails: its driver program raises)...
    record["runs"].append(one_run(slot_comm, f"slot{slot}-first", 0))
    record["runs"].append(one_run(slot_comm, f"slot{slot}-second", 3 if slot == 0 else None))
    # ...then one on a new communicator spanning both slots.
    record["runs"].append(one_run(everyone, "everyone", 0))
    # The slot's communicator still works after the runs.
    record["slot_sum"] = slot_comm.allreduce(1)
    # ...and a step of 2 tasks (the slot's size) is not this MPI world: refused, on every rank.
    os.environ["SLURM_STEP_NUM_TASKS"] = str(slot_comm.Get_size())
    try:
        run(lambda driver: 0, slot_comm)
    except LaunchError:
        record["refused"] = True
    return record


def train(world: MPI.Comm, slot_comm: MPI.Comm | None, slot: int, root: str) -> dict:
    """Each slot trains PPO on CartPole on its own communicator, both slots at once, two
    trials in a row (as PBT runs them on one slot)."""
    if slot_comm is None:
        return {}
    rows = []
    for trial in range(2):
        config = {"num_envs_per_worker": 2, "rollout_fragment_length": 32 * (trial + 1),
                  "num_epochs": 2, "print_layout": False}
        row = mpirl.train("PPO", "CartPole-v1", config=config,
                          stop={"training_iteration": 2}, seed=slot,
                          run_dir=f"{root}/slot{slot}-trial{trial}", progress="off",
                          comm=slot_comm)
        rows.append(None if row is None else {"iteration": row["iteration"],
                                              "timesteps_total": row["timesteps_total"]})
    return {"rows": rows, "restored": run_comm() == MPI.COMM_WORLD}


def lost(world: MPI.Comm, slot_comm: MPI.Comm | None, slot: int) -> dict:
    """Slot 1's worker freezes in a call: its run's driver must name it (by its rank in the
    run) and end the job; slot 0 finishes a run of its own meanwhile."""
    if slot_comm is None:
        return {}
    if slot == 0:
        return one_run(slot_comm, "slot0", 0)
    settings = mpirl.RuntimeSettings(print_layout=True, heartbeat_interval_s=0.2,
                                     heartbeat_timeout_s=3.0)

    def main(driver: mpirl.Driver) -> int:
        group = driver.spawn("rollout", Where, "slot1")
        group.call("freeze", timeout=60)
        return 0

    return {"code": mpirl.run(main, mpirl.Layout(num_rollout_workers=-1), settings,
                              comm=slot_comm)}


def main() -> None:
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    slot = -1 if rank == 0 else (rank - 1) // SLOT_SIZE
    sub = world.Split(MPI.UNDEFINED if rank == 0 else slot, key=rank)
    slot_comm = None if sub == MPI.COMM_NULL else sub
    if sys.argv[1] == "calls":
        record = calls(world, slot_comm, slot)
    elif sys.argv[1] == "lost":
        record = lost(world, slot_comm, slot)
    else:
        record = train(world, slot_comm, slot, sys.argv[2])
    record.update(world_rank=rank, slot=slot)
    # World rank 0 has nothing to do meanwhile: it waits without spinning a core (2 cores here).
    barrier = world.Ibarrier()
    while not barrier.Test():
        time.sleep(0.01)
    records = world.gather(record, root=0)
    if rank == 0:
        print("RESULT " + json.dumps(records), flush=True)


if __name__ == "__main__":
    main()
