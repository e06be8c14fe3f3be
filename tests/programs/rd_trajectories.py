"""The reaction-diffusion env's trajectory for k = 1, 2 and 4 members (COMM_WORLD split into
groups; run under ``mpiexec -n 4``), for tests/test_reaction_diffusion.py.

World rank 0 is the root of every group and prints ``RESULT {json}``: per k the lines
rd_trajectory.c prints (reset or step, t, reward, obs), the same from seed with zero actions,
and the error a group of 4 gives for n_points 30."""

from __future__ import annotations

import json
import sys

from mpi4py import MPI

from mpirl.envs.reaction_diffusion import ReactionDiffusion
from mpirl.errors import ConfigError

SEED, STEPS = 12345, 40


def action(t: int, i: int) -> float:
    """examples/solvers/rd_trajectory.c's rd_trajectory_action."""
    return float((7 * t + 3 * i) % 11 - 5) / 5.0


def trajectory(comm: MPI.Comm, act=action) -> list[list[float]] | None:
    """rd_trajectory.c's run: reset from SEED, STEPS steps, a reset without a seed halfway."""
    env = ReactionDiffusion(comm)
    m = env.num_actuators
    lines = []
    obs = env.reset(SEED)
    lines.append([0, 0, 0.0, *(obs.tolist() if obs is not None else [])])
    for t in range(STEPS):
        if t == STEPS // 2:
            obs = env.reset(None)
            lines.append([0, t, 0.0, *(obs.tolist() if obs is not None else [])])
        out = env.step([act(t, i) for i in range(m)])
        if out is not None:
            obs, reward, _, _ = out
            lines.append([1, t, reward, *obs.tolist()])
    env.close()
    return lines if comm.Get_rank() == 0 else None


def main() -> int:
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    result: dict = {}
    for k in (1, 2, 4):
        group = world.Split(rank // k, rank)
        result[str(k)] = trajectory(group)
        if k == 1:
            result["zero"] = trajectory(group, lambda t, i: 0.0)
        group.Free()
    try:
        ReactionDiffusion(world, n_points=30)
        result["uneven"] = None
    except ConfigError as error:
        result["uneven"] = str(error)
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
