"""The reaction-diffusion solver programs over sim_link, the rollout side played by hand (MPMD):

    mpiexec -n 1 python rd_link_check.py K : -n 2 build/rd_solver : -n 2 build/rd_solver_f

It joins the apps, SETUPs the solver processes into groups of K (default env_config), and drives
every group through rd_trajectory.c's run (RESET from 12345, 40 STEPs with its actions, a RESET
without a seed halfway), then END. Prints ``RESULT {json}``: per group its program and the lines
of tests/programs/rd_trajectories.py (reset or step, t, reward, obs).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import solver_link_check
from mpi4py import MPI
from rd_trajectories import SEED, STEPS, action

from mpirl.runtime import apps, sim_link

OBS, ACT = 8, 4
# solver_link_check's SETUP reads its sizes from these.
solver_link_check.OBS, solver_link_check.ACT = OBS, ACT


def command(link: MPI.Intercomm, root: int, code: int, arg: float,
            act: list[float] | None = None) -> np.ndarray:
    row = np.zeros(sim_link.COMMAND_HEADER + ACT)
    row[0], row[1] = code, arg
    if act is not None:
        row[sim_link.COMMAND_HEADER:] = act
    link.Send([row, MPI.DOUBLE], root, sim_link.TAG_COMMAND)
    reply = np.zeros(sim_link.REPLY_HEADER + OBS)
    link.Recv([reply, MPI.DOUBLE], root, sim_link.TAG_REPLY)
    assert reply[0] == arg, (reply, arg)  # not ERROR_SEQ: the solver did not fail
    return reply


def trajectory(link: MPI.Intercomm, root: int) -> list[list[float]]:
    reply = command(link, root, sim_link.RESET, SEED)
    lines = [[0, 0, 0.0, *reply[4:].tolist()]]
    for t in range(STEPS):
        if t == STEPS // 2:
            reply = command(link, root, sim_link.RESET, sim_link.NO_SEED)
            lines.append([0, t, 0.0, *reply[4:].tolist()])
        reply = command(link, root, sim_link.STEP, t + 1, [action(t, i) for i in range(ACT)])
        assert reply[2] == 0.0 and reply[3] == 0.0, reply  # 40 of max_steps 100
        lines.append([1, t, float(reply[1]), *reply[4:].tolist()])
    return lines


def main() -> None:
    k = int(sys.argv[1])
    apps.join_apps(60.0)
    link = apps.solver_link()
    roots = solver_link_check.setup(link, k, {})
    programs = {p.solver_rank: Path(p.program).name for p in apps.solver_table()}
    result = {"groups": [{"program": programs[root], "lines": trajectory(link, root)}
                         for root in roots]}
    for root in roots:
        row = np.zeros(sim_link.COMMAND_HEADER + ACT)
        row[0] = sim_link.END
        link.Send([row, MPI.DOUBLE], root, sim_link.TAG_COMMAND)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
