"""The rollout side of sim_link, played by hand against a solver program (MPMD):

    mpiexec -n 1 python solver_link_check.py MODE K : -n S examples/solvers/build/echo_solver

It joins the apps (``mpirl.runtime.apps.join_apps``), sends each solver process its SETUP
(groups of K), then, by MODE:

* ``steps``: per group RESET, PING, three STEPs (the third truncates), END; checks each reply
  against echo_solver's formulas.
* ``early``: no SETUP: ``end_solvers(3)``, as a run that ends before its groups start.
* ``fail``: RESET, then STEPs until the reply says ERROR_SEQ; receives the message.
* ``signals``: first SIGUSR1, SIGUSR2 and SIGTERM to every solver process (mpirl's stop
  requests, which srun and mpiexec pass to the whole step), then as ``steps``.

Prints one ``RESULT {json}`` line; an assertion failure ends it with a traceback.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

from mpirl.runtime import apps, sim_link

OBS, ACT, EPISODE = 5, 2, 3
SEED = 7


def setup(link: MPI.Intercomm, k: int, config: dict) -> list[int]:
    """SETUP every solver process into groups of k; returns each group's root (remote rank)."""
    solvers = link.Get_remote_size()
    assert solvers % k == 0, (solvers, k)
    text = json.dumps(config).encode()
    roots = []
    requests = []
    for r in range(solvers):
        group, member = divmod(r, k)
        fields = np.zeros(sim_link.SETUP_LEN, dtype=np.int64)
        fields[sim_link.SETUP_MAGIC] = sim_link.MAGIC
        fields[sim_link.SETUP_VERSION] = sim_link.VERSION
        fields[sim_link.SETUP_GROUP] = group
        fields[sim_link.SETUP_MEMBER] = member
        fields[sim_link.SETUP_GROUP_SIZE] = k
        fields[sim_link.SETUP_OBS_SIZE] = OBS
        fields[sim_link.SETUP_ACTION_SIZE] = ACT
        fields[sim_link.SETUP_ACTION_KIND] = sim_link.ACTION_BOX
        fields[sim_link.SETUP_SEED] = 100 + group
        fields[sim_link.SETUP_ROLLOUT_RANK] = link.Get_rank()
        fields[sim_link.SETUP_JSON_BYTES] = len(text)
        fields[sim_link.SETUP_NUM_GROUPS] = solvers // k
        requests.append(link.Isend([fields, MPI.INT64_T], r, sim_link.TAG_SETUP))
        requests.append(link.Isend([text, MPI.CHAR], r, sim_link.TAG_SETUP_JSON))
        if member == 0:
            roots.append(r)
        # Buffers must live until the sends complete.
        setup.keep.append(fields)  # type: ignore[attr-defined]
    MPI.Request.Waitall(requests)
    return roots


setup.keep = []  # type: ignore[attr-defined]


def command(link: MPI.Intercomm, root: int, code: int, arg: float,
            action: np.ndarray | None = None) -> np.ndarray:
    """Send one COMMAND to a group's root and return its REPLY (none for END)."""
    row = np.zeros(sim_link.COMMAND_HEADER + ACT)
    row[0], row[1] = code, arg
    if action is not None:
        row[sim_link.COMMAND_HEADER:] = action
    link.Send([row, MPI.DOUBLE], root, sim_link.TAG_COMMAND)
    if code == sim_link.END:
        return row
    reply = np.zeros(sim_link.REPLY_HEADER + OBS + 1)  # a spare column catches a longer reply
    status = MPI.Status()
    link.Recv([reply, MPI.DOUBLE], root, sim_link.TAG_REPLY, status)
    assert status.Get_count(MPI.DOUBLE) == sim_link.REPLY_HEADER + OBS, status.Get_count(MPI.DOUBLE)
    return reply[:-1]


def steps(link: MPI.Intercomm, roots: list[int]) -> dict:
    checked = 0
    for g, root in enumerate(roots):
        reply = command(link, root, sim_link.RESET, SEED + g)
        assert reply[0] == SEED + g and reply[1] == 0.0, reply
        assert np.array_equal(reply[4:], SEED + g + 0.5 * np.arange(OBS)), reply
        reply = command(link, root, sim_link.PING, 42)
        assert reply[0] == 42 and not reply[1:].any(), reply
        for t in range(1, EPISODE + 1):
            action = np.array([0.25 * t + g, -1.5])
            reply = command(link, root, sim_link.STEP, 1000 + t, action)
            expected = action[np.arange(OBS) % ACT] + 1000 * t + np.arange(OBS)
            assert reply[0] == 1000 + t, reply
            assert reply[1] == t + action.sum(), reply
            assert reply[2] == 0.0 and reply[3] == float(t == EPISODE), reply
            assert np.array_equal(reply[4:], expected), (reply, expected)
            checked += 1
    for root in roots:
        command(link, root, sim_link.END, 0)
    return {"groups": len(roots), "steps_checked": checked}


def fail(link: MPI.Intercomm, roots: list[int]) -> dict:
    root = roots[0]
    command(link, root, sim_link.RESET, SEED)
    for t in range(1, 10):
        reply = command(link, root, sim_link.STEP, t, np.zeros(ACT))
        if reply[0] == sim_link.ERROR_SEQ:
            status = MPI.Status()
            link.Probe(root, sim_link.TAG_ERROR, status)
            message = bytearray(status.Get_count(MPI.CHAR))
            link.Recv([message, MPI.CHAR], root, sim_link.TAG_ERROR)
            # As the run's driver would: the other groups hear END too.
            apps.end_solvers(2)
            return {"failed_at": t, "message": message.decode()}
    raise AssertionError("no ERROR reply")


def main() -> None:
    mode, k = sys.argv[1], int(sys.argv[2])
    timeout = float(sys.argv[3]) if len(sys.argv) > 3 else apps.DEFAULT_TIMEOUT_S
    start = time.perf_counter()
    count = apps.join_apps(timeout)
    joined_s = time.perf_counter() - start
    link = apps.solver_link()
    result: dict = {"solvers": count, "join_s": round(joined_s, 4),
                    "table": [[p.world_rank, p.solver_rank, p.pid, p.program]
                              for p in apps.solver_table()]}
    if count:
        from mpirl.runtime.world import run_comm

        result["run_size"] = run_comm().Get_size()
        if mode == "signals":
            for solver in apps.solver_table():
                for signum in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM):
                    os.kill(solver.pid, signum)
            time.sleep(0.3)  # long enough for a default action to end a process
            result["signalled"] = count
            mode = "steps"
        if mode == "early":
            apps.end_solvers(3)
        else:
            roots = setup(link, k, {"episode_length": EPISODE,
                                    "fail_at": 2 if mode == "fail" else 0})
            result.update(steps(link, roots) if mode == "steps" else fail(link, roots))
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
