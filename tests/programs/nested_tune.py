"""``mpirl tune`` on the communicator the runtime gives it, not COMM_WORLD: world rank 0 stays
out, and world ranks 1.. run the population's command (``mpirl.cli.main``) inside
``running_on(sub)``.

    mpiexec -n 4 python nested_tune.py TUNE_DIR [TUNE ARGS...]

TUNE ARGS (what follows ``mpirl tune --run-dir TUNE_DIR``) default to two PPO trials, one rank
each. Each rank of the population prints ``CODE <world rank> <exit code>``.
"""

from __future__ import annotations

import sys
import time

from mpi4py import MPI

from mpirl.cli import main as mpirl_main
from mpirl.runtime.world import running_on

DEFAULT = ["--ranks-per-trial", "1", "--space", '{"lr": [0.001, 0.0003]}', "--", "--algo",
           "PPO", "--env", "CartPole-v1", "--config", '{"num_envs_per_worker": 1}', "--stop",
           '{"training_iteration": 2}']


def main() -> None:
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    sub = world.Split(MPI.UNDEFINED if rank == 0 else 0, key=rank)
    if sub != MPI.COMM_NULL:
        with running_on(sub):
            code = mpirl_main(["tune", "--run-dir", sys.argv[1], *(sys.argv[2:] or DEFAULT)])
        print(f"CODE {rank} {code}", flush=True)
    # World rank 0 has nothing to do meanwhile: it waits without spinning a core.
    barrier = world.Ibarrier()
    while not barrier.Test():
        time.sleep(0.01)


if __name__ == "__main__":
    main()
