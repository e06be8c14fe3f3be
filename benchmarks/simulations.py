"""Coupling a simulation to the rollout rank that drives it: what one env step's round trip costs
through mpirl's link, through a Redis server as Relexi couples FLEXI, and through a TCP socket as
RLlib's external envs talk to their policy server; a solver relaunched every training iteration
against one kept alive; and env steps per second per group for 1, 4 and 16 groups.

    python benchmarks/simulations.py --json benchmarks/simulations.json
    python benchmarks/simulations.py --quick --json /tmp/simulations.json   # 8 and 1,000 floats

**Coupling.** One round trip: the rollout side sends an action (4 float64) and the env side
answers with an observation of 8, 1,000 or 100,000 float64, with reward and done flags. Each
transport runs two processes (rank 0 the rollout side, the other the env side; MPI only starts
and ends them, except on mpirl's legs), timed at the rollout side, the first ``warmup`` steps
left out:

- ``mpirl_mpmd_c``: mpirl's own rollout side, ``mpirl.workers.sim_envs.SimEnvs``, built as
  ``EnvRunner`` builds it (a Solver env's spaces, one ``LinkedGroup``) and stepped as it steps
  env groups (``start``, ``wait_ready``, ``finish``: reply checks, outcome, autoreset), against
  ``examples/solvers/build/echo_solver`` (C, ``mpirl_solver.h``) as the second program of an
  MPMD launch, joined through ``mpirl.runtime.apps`` (HELLO/GO, the intercommunicator). The
  full mode only (it needs ``make solvers``); the ratios are taken against it.
- ``mpirl_inworld_python``: the same ``SimEnvs`` against mpirl's Python member loop
  (``mpirl.workers.sim_member.serve_group``, an echo ``Simulation``) on world rank 1, the link
  a duplicate of the world as in a run. The quick mode's only mpirl leg, and the ratios'
  reference when the C leg did not run.
- ``link_protocol_floor``: ``sim_link``'s protocol bare (``LinkRollout`` and
  ``python_member`` below: persistent requests, ``Test`` polling with mpirl's ``Backoff``, no
  checks, no vector-env bookkeeping), the floor under the two above. The full mode also runs
  ``link_protocol_floor_eager_16k``: the same with Open MPI's shared-memory eager limit at
  16 kB, so that 1,000 floats (8 kB) go eagerly.
- ``redis_tight`` and ``redis_10ms``: a redis-server of this machine's (Debian's), started on a
  free port for the run and stopped after it, through redis-py, with Relexi's pattern per step:
  the env side puts ``state`` and ``reward``; the rollout side polls for each (``EXISTS``), gets
  and deletes it, and puts ``actions``, which the env side polls for, gets and deletes. SmartRedis,
  Relexi's client, stores tensors with RedisAI's ``AI.TENSORSET``, which Debian's server lacks,
  and its wheel needs numpy < 2; the same commands through redis-py stand for it, with the
  payloads as raw float64 bytes. ``10ms`` sleeps 10 ms between polls (Relexi's
  ``poll_tensor(key, 10, ...)``), ``tight`` only yields the core (``sched_yield``).
- ``tcp``: a localhost TCP connection, ``TCP_NODELAY``, each message a frame of a 4-byte length
  and the raw bytes, blocking reads into preallocated buffers: the env side connects to the
  rollout side as RLlib's ``PolicyClient`` does to its policy server, without RLlib's HTTP and
  pickling (a lower bound on it).

**Relaunch vs kept alive.** The same Python solver (k = 2 ranks, a diffusion stencil with a halo
exchange per step, its root answering over mpirl's link) runs ``steps`` steps per iteration: once
started by ``mpiexec`` every iteration, as Relexi starts FLEXI, and once kept alive for every
iteration. The relaunched job's rollout rank is started with it (a stand-in for the trainer).
With ``--env-side c`` the solver is ``examples/solvers/build/rd_solver`` (its own defaults).

**Groups.** 1, 4 or 16 groups of k = 2 ranks (oversubscribed on this machine: each member's
step sleeps ``step_s``, as a solver computing on cores of its own; ``echo_solver``'s
``step_s``), twice:

- ``groups``: one rollout rank's ``SimEnvs`` over the C echo solver's groups (MPMD), sending
  the next STEP to whichever group answered (``start``/``wait_ready``/``finish``, as
  ``EnvRunner``): per-group steps/s against one group's, and the rollout rank's CPU per group
  step. The quick mode: 1 and 2 groups of the Python member, in-world.
- ``groups_train`` (the full mode): ``mpirl train --algo PPO --env mpirl/Solver-v0`` on 2
  mpirl ranks (the driver with the learner; one rollout rank) beside the solver's groups,
  ``rollout_fragment_length`` 100, one SGD step per iteration (sampling dominates): per-group
  env steps/s (progress.csv's ``env_steps_per_s``) against one group's, and rank 0's CPU per
  iteration (``perf/driver_cpu_ms_per_iter``) per group; medians after 2 iterations.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import (
    BenchError,
    attempt,
    emit,
    end_session,
    fmt,
    mpiexec_command,
    print_problems,
    print_table,
    ratio,
    run_main,
    run_metadata,
    run_process,
    run_role,
    write_report,
)

SCRIPT = Path(__file__)
ROOT = SCRIPT.parent.parent
ECHO_SOLVER = ROOT / "examples" / "solvers" / "build" / "echo_solver"
RD_SOLVER = ROOT / "examples" / "solvers" / "build" / "rd_solver"
FULL_SIZES = (8, 1_000, 100_000)
QUICK_SIZES = (8, 1_000)
ACTION_SIZE = 4
RATIO_SIZE = 1_000
"""The observation size of the issue's target: Redis at least 20x the link's round trip."""
TARGET_RATIO = 20.0
GROUP_TARGET = 0.9
"""Per-group steps/s at the most groups, as a share of one group's (the issue's target)."""
RELEXI_POLL_S = 0.01
EAGER_LEG = "link_protocol_floor_eager_16k"
EAGER_ENV = {"OMPI_MCA_btl_sm_eager_limit": "16384"}
"""The link again with Open MPI's shared-memory eager limit at 16 kB (default 4 kB), so that a
reply of 1,000 floats (8 kB) goes out in one message instead of a rendezvous."""


MPIRL_LEGS = {
    "mpirl_mpmd_c": ("simenvs", "c"),
    "mpirl_inworld_python": ("simenvs", "python"),
    "link_protocol_floor": ("link", "python"),
    EAGER_LEG: ("link", "python"),
}
"""mpirl's legs: the measured role and the env side. ``mpirl_*`` time mpirl's own rollout side
(``SimEnvs``) against the C echo solver in an MPMD launch or the Python member loop
(``serve_group``) on a world rank; ``link_protocol_floor*`` the bare protocol (``LinkRollout``
and ``python_member``, no SimEnvs checks), the floor under them."""
RATIO_LEGS = ("mpirl_mpmd_c", "mpirl_inworld_python")
"""The leg the others are divided by at 1,000 floats: the first of these that ran."""


@dataclass(frozen=True)
class Plan:
    sizes: tuple[int, ...]
    steps: int
    """Timed round trips per size (tight polling), after ``warmup``."""
    large_steps: int
    """The same for 100,000 floats and more."""
    slow_poll_steps: int
    """The same for Redis with a 10 ms poll interval (each takes 10-20 ms)."""
    warmup: int
    env_side: str
    relaunch_k: int
    relaunch_steps: int
    relaunch_iterations: int
    relaunch_cells: int
    """Grid points per solver rank."""
    groups: tuple[int, ...]
    groups_k: int
    groups_steps: int
    groups_step_s: float
    mpirl_legs: tuple[str, ...]
    """Which of ``MPIRL_LEGS`` to run."""
    train_fragment: int
    """The training runs' rollout_fragment_length; 0: no training runs (the quick mode)."""
    train_warmup: int
    train_iterations: int
    groups_side: str
    """The groups' solver: ``c`` (the echo solver, MPMD) or ``python`` (in-world members)."""


FULL = dict(sizes=FULL_SIZES, steps=5000, large_steps=1000, slow_poll_steps=200, warmup=100,
            relaunch_k=2, relaunch_steps=100, relaunch_iterations=8, relaunch_cells=20_000,
            groups=(1, 4, 16), groups_k=2, groups_steps=300, groups_step_s=0.005,
            mpirl_legs=tuple(MPIRL_LEGS), groups_side="c", train_fragment=100, train_warmup=2,
            train_iterations=5)
QUICK = dict(sizes=QUICK_SIZES, steps=150, large_steps=50, slow_poll_steps=10, warmup=10,
             relaunch_k=2, relaunch_steps=20, relaunch_iterations=1, relaunch_cells=2_000,
             groups=(1, 2), groups_k=2, groups_steps=40, groups_step_s=0.005,
             mpirl_legs=("mpirl_inworld_python",), groups_side="python", train_fragment=0,
             train_warmup=0, train_iterations=0)


def steps_for(plan_steps: int, large_steps: int, size: int) -> int:
    return large_steps if size >= 100_000 else plan_steps


def summary(times_ns: list[int], cpu_s: float) -> dict[str, Any]:
    """Median, p90 and mean of the round trips in microseconds; the rollout side's CPU each."""
    us = sorted(t / 1e3 for t in times_ns)
    return {"median_us": statistics.median(us), "p90_us": us[int(0.9 * (len(us) - 1))],
            "mean_us": statistics.fmean(us), "steps": len(us), "rollout_cpu_us": cpu_s / len(us)
            * 1e6}


# The measured programs: mpirl's link.


def wait_all(requests: list[Any]) -> None:
    """Complete ``requests`` by polling with mpirl's Backoff, as the rollout side and the
    members do (a blocking wait in Open MPI spins a core)."""
    from mpi4py import MPI

    from mpirl.runtime.waiting import Backoff

    if MPI.Request.Testall(requests):
        return
    backoff = Backoff()
    while not MPI.Request.Testall(requests):
        backoff.sleep()


class LinkRollout:
    """The rollout side of one group over ``link`` (sim_link's protocol): SETUP to each member,
    then a COMMAND to the group's root and its REPLY back per step, through persistent requests
    on preallocated float64 rows."""

    def __init__(self, link: Any, members: list[int], group: int, obs_size: int,
                 config: dict[str, Any]) -> None:
        import numpy as np
        from mpi4py import MPI

        from mpirl.runtime import sim_link as sl

        self.link, self.root = link, members[0]
        payload = json.dumps(config).encode()
        setup = np.zeros(sl.SETUP_LEN, dtype=np.int64)
        setup[[sl.SETUP_MAGIC, sl.SETUP_VERSION, sl.SETUP_GROUP, sl.SETUP_GROUP_SIZE,
               sl.SETUP_OBS_SIZE, sl.SETUP_ACTION_SIZE, sl.SETUP_ACTION_KIND, sl.SETUP_SEED,
               sl.SETUP_ROLLOUT_RANK, sl.SETUP_JSON_BYTES, sl.SETUP_NUM_GROUPS]] = [
            sl.MAGIC, sl.VERSION, group, len(members), obs_size, ACTION_SIZE, sl.ACTION_BOX, group,
            link.rank, len(payload), 1]
        rows = np.repeat(setup[None, :], len(members), axis=0)
        rows[:, sl.SETUP_MEMBER] = range(len(members))
        sends = []
        for member, rank in enumerate(members):
            sends += [link.Isend(rows[member], rank, sl.TAG_SETUP),
                      link.Isend(payload, rank, sl.TAG_SETUP_JSON)]
        wait_all(sends)
        self.command = np.zeros(sl.COMMAND_HEADER + ACTION_SIZE)
        # One spare column: a longer reply than announced arrives whole and can be told apart.
        self.reply = np.zeros(sl.REPLY_HEADER + obs_size + 1)
        self.requests = [link.Recv_init(self.reply, self.root, sl.TAG_REPLY),
                         link.Send_init(self.command, self.root, sl.TAG_COMMAND)]
        self.status = MPI.Status()

    def start(self, code: int, arg: float) -> None:
        from mpi4py import MPI

        self.command[0], self.command[1] = code, arg
        self.command[2:] = arg % 3 - 1.0
        # The receive first, so that a large reply meets a posted receive.
        MPI.Prequest.Startall(self.requests)

    def ready(self) -> bool:
        from mpi4py import MPI

        return MPI.Request.Testall(self.requests)

    def round_trip(self, code: int, arg: float) -> None:
        self.start(code, arg)
        wait_all(self.requests)
        if self.reply[0] != arg:
            raise RuntimeError(f"reply {self.reply[0]} to command {arg}")

    def end(self) -> None:
        from mpirl.runtime import sim_link as sl

        self.command[0] = sl.END
        self.link.Send(self.command, self.root, sl.TAG_COMMAND)


def python_member(link: Any, rollout: int, group_comm: Any,
                  step: Callable[[Any, Any], None] | None = None) -> None:
    """A Python env member over ``link``: SETUP, then every COMMAND from ``rollout`` (taken by
    the group's root, broadcast to the group), ``step(action, obs)`` on every member, the root's
    REPLY; until END. Without ``step``, an echo (the obs is left as it is)."""
    import numpy as np

    from mpirl.runtime import sim_link as sl

    setup = np.zeros(sl.SETUP_LEN, dtype=np.int64)
    wait_all([link.Irecv(setup, rollout, sl.TAG_SETUP)])
    payload = bytearray(int(setup[sl.SETUP_JSON_BYTES]))
    wait_all([link.Irecv(payload, rollout, sl.TAG_SETUP_JSON)])
    obs_size, action_size = int(setup[sl.SETUP_OBS_SIZE]), int(setup[sl.SETUP_ACTION_SIZE])
    root = group_comm.rank == 0
    command = np.zeros(sl.COMMAND_HEADER + action_size)
    reply = np.zeros(sl.REPLY_HEADER + obs_size)
    obs = reply[sl.REPLY_HEADER:]
    take = link.Recv_init(command, rollout, sl.TAG_COMMAND) if root else None
    answer = link.Send_init(reply, rollout, sl.TAG_REPLY) if root else None
    while True:
        if root:
            take.Start()
            wait_all([take])
        if group_comm.size > 1:
            wait_all([group_comm.Ibcast(command, 0)])
        code = int(command[0])
        if code == sl.END:
            break
        if step is not None and code == sl.STEP:
            step(command[sl.COMMAND_HEADER:], obs)
        if root:
            reply[0], reply[1] = command[1], 0.0
            answer.Start()
            wait_all([answer])


def link_and_peer(env_side: str) -> tuple[Any, int]:
    """The link communicator and the env side's rank on it, at the rollout side (rank 0)."""
    from mpi4py import MPI

    if env_side == "python":
        return MPI.COMM_WORLD.Dup(), 1
    # An MPMD launch beside examples/solvers/build/echo_solver: the handshake of issue 49's
    # mpirl.runtime.apps gives the intercommunicator; the solver's root is its remote rank 0.
    from mpirl.runtime import apps

    apps.join_apps(60.0)
    link = apps.solver_link()
    if link is None:
        raise BenchError("no solver program joined the MPMD launch")
    return link, 0


def link_role(size: int, steps: int, warmup: int, env_side: str) -> None:
    """Under mpiexec: world rank 0 drives one echo group over mpirl's link and times it."""
    from mpi4py import MPI

    from mpirl.runtime import sim_link as sl

    world = MPI.COMM_WORLD
    if env_side == "python" and world.rank == 1:
        python_member(world.Dup(), 0, MPI.COMM_SELF)
        return
    link, root = link_and_peer(env_side)
    rollout = LinkRollout(link, [root], 0, size, {"observation_size": size})
    rollout.round_trip(sl.RESET, 0)
    times, clock = [], time.perf_counter_ns
    cpu = 0.0
    for seq in range(1, warmup + steps + 1):
        start, start_cpu = clock(), time.thread_time()
        rollout.round_trip(sl.STEP, seq)
        if seq > warmup:
            times.append(clock() - start)
            cpu += time.thread_time() - start_cpu
    rollout.end()
    emit(summary(times, cpu))


# The measured programs: mpirl's own rollout side (SimEnvs), as EnvRunner builds it.


def echo_simulation() -> type:
    """The in-world Python member's simulation: the echo solver's contract (its observation
    left as it is, reward 0, never done), each member sleeping ``step_s`` per step. Built on
    first use, so that the orchestrator need not import mpirl."""
    import numpy as np

    from mpirl.envs.simulation import Simulation, solver_spaces

    class EchoSimulation(Simulation):
        def __init__(self, comm: Any, **env_config: Any) -> None:
            super().__init__(comm)
            self.observation_space, self.action_space = solver_spaces(env_config)
            self.obs = np.zeros(self.observation_space.shape)
            self.step_s = float(env_config.get("step_s", 0.0))
            self.root = comm.Get_rank() == 0

        def reset(self, seed: int | None = None) -> Any:
            return self.obs if self.root else None

        def step(self, action: Any) -> Any:
            if self.step_s:
                time.sleep(self.step_s)
            return (self.obs, 0.0, False, False) if self.root else None

    return EchoSimulation


def simenvs_groups(env_side: str, groups: int, k: int) -> tuple[Any, list[Any]] | None:
    """The link and ``groups`` LinkedGroups of k members, at the rollout side (world rank 0);
    None on a member (an in-world Python one, which has served its group by then)."""
    from mpi4py import MPI

    from mpirl.runtime.waiting import Backoff
    from mpirl.workers.sim_envs import LinkedGroup
    from mpirl.workers.sim_member import serve_group

    if env_side == "python":
        # As a run's env ranks: the link a duplicate of the world, the group a split of it.
        world = MPI.COMM_WORLD
        link = world.Dup()
        group = -1 if world.rank == 0 else (world.rank - 1) // k
        group_comm = world.Split(group + 1, world.rank)
        if world.rank > 0:
            serve_group(link, group_comm, echo_simulation(), 0, Backoff())
            return None
        first = 1
    else:
        link, first = link_and_peer(env_side)
    members = [tuple(range(first + g * k, first + (g + 1) * k)) for g in range(groups)]
    return link, [LinkedGroup(g, m[0], m, f"env group {g}") for g, m in enumerate(members)]


def make_simenvs(link: Any, linked: list[Any], size: int, step_s: float) -> Any:
    """``SimEnvs`` as ``EnvRunner._env_groups_of`` builds it (a Solver env's spaces)."""
    from mpirl.envs.simulation import solver_spaces
    from mpirl.workers.sim_envs import SimEnvs

    env_config = {"observation_size": size, "action_size": ACTION_SIZE, "step_s": step_s}
    observation_space, action_space = solver_spaces(env_config)
    return SimEnvs(link, linked, observation_space, action_space, env_config, 0,
                   num_groups=len(linked), timeout_s=120.0, backoff=None,
                   where="the benchmark's rollout rank")


def end_simenvs(envs: Any, link: Any, env_side: str) -> None:
    """END to each group (SimEnvs.close), then the driver's END to every member, as a run's
    shutdown sends them."""
    import numpy as np
    from mpi4py import MPI

    from mpirl.runtime import apps
    from mpirl.runtime import sim_link as sl

    envs.close()
    if env_side != "python":
        apps.end_solvers(0)
        return
    end = np.array([sl.END, 0], dtype=np.int64)
    wait_all([link.Isend([end, MPI.INT64_T], rank, sl.TAG_END)
              for group in envs.groups for rank in group.members])


def simenvs_role(size: int, steps: int, warmup: int, env_side: str) -> None:
    """World rank 0 times ``SimEnvs``' round trip with one group of one member, through
    ``start``, ``wait_ready`` and ``finish`` as EnvRunner steps env groups."""
    import numpy as np

    made = simenvs_groups(env_side, 1, 1)
    if made is None:
        return
    link, linked = made
    envs = make_simenvs(link, linked, size, 0.0)
    envs.reset()
    rows, actions = np.arange(1), np.zeros((1, ACTION_SIZE), np.float32)
    times, cpu, clock = [], 0.0, time.perf_counter_ns
    for seq in range(warmup + steps):
        start, start_cpu = clock(), time.thread_time()
        actions[0] = seq % 3 - 1.0
        envs.start(rows, actions)
        envs.finish(envs.wait_ready())
        if seq >= warmup:
            times.append(clock() - start)
            cpu += time.thread_time() - start_cpu
    end_simenvs(envs, link, env_side)
    emit(summary(times, cpu))


def groups_role(groups: int, k: int, steps: int, step_s: float, env_side: str) -> None:
    """World rank 0 drives ``groups`` groups of k members through ``SimEnvs``, sending the next
    STEP to whichever group answered (``start``/``wait_ready``/``finish``, as EnvRunner); each
    member's step sleeps ``step_s`` (the C echo solver's ``step_s``, or the Python member's)."""
    import numpy as np
    from mpi4py import MPI

    made = simenvs_groups(env_side, groups, k)
    if made is None:
        return
    link, linked = made
    envs = make_simenvs(link, linked, 8, step_s)
    envs.reset()
    actions = np.zeros((groups, ACTION_SIZE), np.float32)
    done = np.zeros(groups, np.int64)
    start, start_cpu = time.perf_counter(), time.thread_time()
    envs.start(np.arange(groups), actions)
    while envs.in_flight.any():
        ready = envs.wait_ready()
        envs.finish(ready)
        rows = np.flatnonzero(ready)
        done[rows] += 1
        again = rows[done[rows] < steps]
        if again.size:
            envs.start(again, actions[:again.size])
    wall, cpu = time.perf_counter() - start, time.thread_time() - start_cpu
    end_simenvs(envs, link, env_side)
    ranks = MPI.COMM_WORLD.size
    emit({"steps_per_s_per_group": steps / wall, "rollout_cpu_us_per_group_step":
          cpu / (steps * groups) * 1e6, "ranks": ranks, "wall_s": wall, "solver": env_side})


# The measured programs: Redis as Relexi, a TCP socket as RLlib's external env.


class Redis:
    """The commands Relexi's SmartRedis client sends, through redis-py, counted."""

    def __init__(self, port: int, poll_s: float) -> None:
        import redis

        self.client = redis.Redis("127.0.0.1", port)
        self.poll_s, self.commands = poll_s, 0

    def put(self, key: str, data: Any) -> None:
        self.client.set(key, data.tobytes())
        self.commands += 1

    def poll_get(self, key: str, into: Any) -> None:
        """``poll_tensor`` (EXISTS until found, sleeping between tries), ``get_tensor``,
        ``delete_tensor``."""
        import numpy as np

        while True:
            self.commands += 1
            if self.client.exists(key):
                break
            if self.poll_s:
                time.sleep(self.poll_s)
            else:
                # Tight, but yielding: with the server and both sides on 2 cores, a bare spin
                # would keep the server waiting for a core.
                os.sched_yield()
        data = self.client.get(key)
        self.client.delete(key)
        self.commands += 2
        into[:] = np.frombuffer(data, dtype=np.float64)


def redis_role(port: int, sizes: list[int], plan: dict[str, int]) -> None:
    """Under mpiexec -n 2: rank 0 the rollout side, rank 1 the env side, for every size and
    both poll intervals."""
    import numpy as np
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    results: dict[str, dict[str, Any]] = {}
    for leg, poll_s in (("redis_tight", 0.0), ("redis_10ms", RELEXI_POLL_S)):
        results[leg] = {}
        for size in sizes:
            steps = (plan["slow_poll_steps"] if poll_s else
                     steps_for(plan["steps"], plan["large_steps"], size))
            warmup = min(plan["warmup"], steps)
            client = Redis(port, poll_s)
            action, flags, obs = np.zeros(ACTION_SIZE), np.zeros(3), np.zeros(size)
            world.Barrier()
            if world.rank == 1:
                for _ in range(warmup + steps):
                    client.put("state", obs)
                    client.put("reward", flags)
                    client.poll_get("actions", action)
                    obs[0] = action[0]
                world.send(client.commands, 0)
                continue
            times, cpu, clock = [], 0.0, time.perf_counter_ns
            for seq in range(warmup + steps):
                start, start_cpu = clock(), time.thread_time()
                client.poll_get("state", obs)
                client.poll_get("reward", flags)
                action[:] = seq
                client.put("actions", action)
                if seq >= warmup:
                    times.append(clock() - start)
                    cpu += time.thread_time() - start_cpu
            env_commands = world.recv(source=1)
            results[leg][str(size)] = {**summary(times, cpu), "commands_per_step":
                                       (client.commands + env_commands) / (warmup + steps)}
    if world.rank == 0:
        emit(results)


def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    while view:
        got = sock.recv_into(view)
        if not got:
            raise ConnectionError("peer closed the connection")
        view = view[got:]


def tcp_role(sizes: list[int], plan: dict[str, int]) -> None:
    """Under mpiexec -n 2: rank 0 listens (the policy server), rank 1 connects (the external
    env) and sends each reply as a length-prefixed frame; the action comes back the same way."""
    import numpy as np
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    header = struct.Struct("<I")
    if world.rank == 0:
        server = socket.create_server(("127.0.0.1", 0))
        world.bcast(server.getsockname()[1], 0)
        sock, _ = server.accept()
        server.close()
    else:
        sock = socket.create_connection(("127.0.0.1", world.bcast(None, 0)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    results: dict[str, Any] = {}
    for size in sizes:
        steps = steps_for(plan["steps"], plan["large_steps"], size)
        warmup = min(plan["warmup"], steps)
        # Each frame's header and body in one preallocated buffer: one sendall per message.
        reply_frame = bytearray(header.size + 8 * (4 + size))
        command_frame = bytearray(header.size + 8 * (2 + ACTION_SIZE))
        for frame in (reply_frame, command_frame):
            header.pack_into(frame, 0, len(frame) - header.size)
        reply = np.frombuffer(reply_frame, dtype=np.float64, offset=header.size)
        command = np.frombuffer(command_frame, dtype=np.float64, offset=header.size)
        world.Barrier()
        if world.rank == 1:
            for _ in range(warmup + steps):
                sock.sendall(reply_frame)
                recv_exactly(sock, memoryview(command_frame))
                reply[0] = command[1]
            continue
        times, cpu, clock = [], 0.0, time.perf_counter_ns
        for seq in range(warmup + steps):
            start, start_cpu = clock(), time.thread_time()
            recv_exactly(sock, memoryview(reply_frame))
            command[1] = seq
            sock.sendall(command_frame)
            if seq >= warmup:
                times.append(clock() - start)
                cpu += time.thread_time() - start_cpu
        results[str(size)] = summary(times, cpu)
    sock.close()
    if world.rank == 0:
        emit(results)


# The measured programs: a solver's iterations, and many groups.


def diffusion_step(group_comm: Any, cells: int) -> Callable[[Any, Any], None]:
    """One explicit diffusion step on ``cells`` points per member, one ghost value swapped with
    each neighbour in the group per step: a small domain-decomposed solver."""
    import numpy as np
    from mpi4py import MPI

    rank, size = group_comm.rank, group_comm.size
    u = np.sin(np.linspace(0.0, np.pi, cells + 2)) * (rank + 1)
    left = rank - 1 if rank > 0 else MPI.PROC_NULL
    right = rank + 1 if rank < size - 1 else MPI.PROC_NULL

    def step(action: Any, obs: Any) -> None:
        group_comm.Sendrecv(u[1:2], left, 0, u[-1:], right, 0)
        group_comm.Sendrecv(u[-2:-1], right, 1, u[0:1], left, 1)
        u[1:-1] += 0.2 * (u[:-2] - 2.0 * u[1:-1] + u[2:]) + 1e-3 * action[0]
        obs[:] = u[1:1 + len(obs)]

    return step


def iterations_role(k: int, steps: int, iterations: int, cells: int, env_side: str) -> None:
    """Under mpiexec -n 1+k: rank 0 runs ``iterations`` iterations of a RESET and ``steps``
    steps over mpirl's link; ranks 1..k are the Python solver's group. With ``env_side`` c,
    rank 0 alone, beside the C reaction-diffusion solver's k ranks (MPMD)."""
    from mpi4py import MPI

    from mpirl.runtime import sim_link as sl

    if env_side == "python":
        world = MPI.COMM_WORLD
        link = world.Dup()
        group_comm = world.Split(0 if world.rank == 0 else 1, world.rank)
        if world.rank > 0:
            python_member(link, 0, group_comm, diffusion_step(group_comm, cells))
            return
        members = list(range(1, k + 1))
    else:
        link, _ = link_and_peer(env_side)
        members = list(range(k))
    # 8 observations and 4 actions: the reaction-diffusion env's 8 sensors and 4 actuators.
    rollout = LinkRollout(link, members, 0, 8, {"cells": cells})
    seconds = []
    for _ in range(iterations):
        start = time.perf_counter()
        rollout.round_trip(sl.RESET, 0)
        for seq in range(1, steps + 1):
            rollout.round_trip(sl.STEP, seq)
        seconds.append(time.perf_counter() - start)
    rollout.end()
    emit({"iteration_s": seconds})


# The orchestrator.


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def redis_missing() -> str | None:
    """Why the Redis legs cannot run here, or None."""
    if shutil.which("redis-server") is None:
        return "redis-server is not on PATH (Debian: apt-get install redis-server; or make bench)"
    try:
        import redis  # noqa: F401
    except ImportError as error:
        return f"redis-py is not installed ({error}); pip install -e '.[bench]'"
    return None


def with_redis_server(measure: Callable[[int], dict[str, Any]]) -> dict[str, Any]:
    """``measure(port)`` with a redis-server of its own on a free port, no persistence."""
    import redis

    port = free_port()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--protected-mode", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 10.0
        while True:
            try:
                redis.Redis("127.0.0.1", port).ping()
                break
            except redis.ConnectionError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise BenchError(f"redis-server on port {port} did not start") from None
                time.sleep(0.05)
        return measure(port)
    finally:
        end_session(server)


def mpmd_command(mpirl_ranks: int, args: list[str], solver_ranks: int) -> list[str]:
    """This script's ``args`` on ``mpirl_ranks`` ranks beside the C echo solver's."""
    return [*mpiexec_command(mpirl_ranks, sys.executable, str(SCRIPT), *args), ":", "-n",
            str(solver_ranks), str(ECHO_SOLVER)]


def measure_leg(plan: Plan, leg: str, size: int) -> dict[str, Any]:
    """One of ``MPIRL_LEGS`` at one observation size."""
    role, env_side = MPIRL_LEGS[leg]
    steps = steps_for(plan.steps, plan.large_steps, size)
    args = ["--role", role, "--size", str(size), "--steps", str(steps), "--warmup",
            str(plan.warmup), "--env-side", env_side]
    if env_side == "python":
        command = mpiexec_command(2, sys.executable, str(SCRIPT), *args)
    else:
        command = mpmd_command(1, args, 1)
    extra_env = EAGER_ENV if leg == EAGER_LEG else None
    return run_process(command, f"{leg}, {size} floats", 300, extra_env,
                       want_result=True).result


def solver_missing() -> str | None:
    if os.access(ECHO_SOLVER, os.X_OK):
        return None
    return f"{ECHO_SOLVER.relative_to(ROOT)} is not built (make solvers)"


def coupling_legs(plan: Plan, quick: bool) -> dict[str, Any]:
    """Every transport, every size: ``{leg: {size: summary}}`` or ``{leg: {"error"/"skipped"}}``."""
    legs: dict[str, Any] = {}
    for leg in plan.mpirl_legs:
        if MPIRL_LEGS[leg][1] == "c" and solver_missing():
            legs[leg] = {"skipped": solver_missing()}
            continue
        legs[leg] = {}
        for size in plan.sizes:
            legs[leg][str(size)] = attempt(
                f"{leg}, {size} floats", lambda leg=leg, size=size: measure_leg(plan, leg, size),
                lambda r: f"median {r['median_us']:.1f} us, p90 {r['p90_us']:.1f} us")
    sizes_args = ["--sizes", ",".join(map(str, plan.sizes)), *steps_args(plan)]
    missing = redis_missing()
    if missing:
        legs["redis_tight"] = legs["redis_10ms"] = {"skipped": missing}
    else:
        both = attempt("Redis (tight and 10 ms polling)", lambda: with_redis_server(
            lambda port: run_role(SCRIPT, "redis", quick, ["--port", str(port), *sizes_args],
                                  ranks=2, name="redis").result))
        legs["redis_tight"] = both.get("redis_tight", both)
        legs["redis_10ms"] = both.get("redis_10ms", both)
    legs["tcp"] = attempt("TCP, length-prefixed frames",
                          lambda: run_role(SCRIPT, "tcp", quick, sizes_args, ranks=2).result)
    return legs


def steps_args(plan: Plan) -> list[str]:
    return ["--steps", str(plan.steps), "--large-steps", str(plan.large_steps),
            "--slow-poll-steps", str(plan.slow_poll_steps), "--warmup", str(plan.warmup)]


def iterations_job(plan: Plan, iterations: int, quick: bool, name: str) -> Any:
    """One job of ``iterations`` iterations: the Python solver's k ranks beside the rollout
    rank, or (``--env-side c``) the C reaction-diffusion solver's as a second program."""
    args = ["--k", str(plan.relaunch_k), "--steps", str(plan.relaunch_steps), "--cells",
            str(plan.relaunch_cells), "--iterations", str(iterations), "--env-side",
            plan.env_side, *(["--quick"] if quick else [])]
    if plan.env_side == "python":
        return run_role(SCRIPT, "iterations", False, args, ranks=1 + plan.relaunch_k,
                        name=name)
    command = [*mpiexec_command(1, sys.executable, str(SCRIPT), "--role", "iterations", *args),
               ":", "-n", str(plan.relaunch_k), str(RD_SOLVER)]
    return run_process(command, name, 300, want_result=True)


def relaunch(plan: Plan, quick: bool) -> dict[str, Any]:
    """Seconds per iteration: one job per iteration against one job for all of them."""
    relaunched = [iterations_job(plan, 1, quick, f"relaunched iteration {i}").wall_s
                  for i in range(plan.relaunch_iterations)]
    kept = iterations_job(plan, plan.relaunch_iterations, quick, "kept alive")
    kept_s = kept.result["iteration_s"]
    result = {"k": plan.relaunch_k, "steps_per_iteration": plan.relaunch_steps,
              "iterations": plan.relaunch_iterations, "solver": plan.env_side,
              "relaunched_s_per_iteration": statistics.median(relaunched),
              "relaunched_s": relaunched,
              "kept_alive_s_per_iteration": statistics.median(kept_s), "kept_alive_s": kept_s,
              "kept_alive_job_s": kept.wall_s}
    result["relaunched_over_kept_alive"] = ratio(result["relaunched_s_per_iteration"],
                                                 result["kept_alive_s_per_iteration"])
    return result


def groups(plan: Plan, quick: bool) -> dict[str, Any]:
    """Per-group steps/s and the rollout rank's CPU per group step, by number of groups: one
    rollout rank's SimEnvs over the C echo solver's groups (MPMD; the Python member's in-world
    where the solver is not built or in the quick mode)."""
    side = "c" if plan.groups_side == "c" and not solver_missing() else "python"
    by_groups: dict[str, Any] = {}
    for count in plan.groups:
        args = ["--role", "groups", "--groups", str(count), "--k", str(plan.groups_k),
                "--steps", str(plan.groups_steps), "--step-s", str(plan.groups_step_s),
                "--env-side", side]
        members = count * plan.groups_k
        command = (mpiexec_command(1 + members, sys.executable, str(SCRIPT), *args)
                   if side == "python" else mpmd_command(1, args, members))
        by_groups[str(count)] = run_process(command, f"{count} groups", 600,
                                            want_result=True).result
    one = by_groups[str(plan.groups[0])]["steps_per_s_per_group"]
    most = by_groups[str(plan.groups[-1])]["steps_per_s_per_group"]
    return {"k": plan.groups_k, "step_s": plan.groups_step_s, "steps": plan.groups_steps,
            "solver": side, "by_groups": by_groups,
            "per_group_vs_one": {n: e["steps_per_s_per_group"] / one for n, e in
                                 by_groups.items()},
            "target_met": most / one >= GROUP_TARGET}


TRAIN_COLUMNS = ("env_steps_per_s", "time_this_iter_s", "perf/driver_cpu_ms_per_iter",
                 "perf/driver_hosted_cpu_ms_per_iter", "perf/driver_idle_cpu_ms_per_iter",
                 "perf/driver_threads_cpu_ms_per_iter", "perf/driver_own_cpu_ms_per_iter")
"""progress.csv's columns the training runs report (medians over the measured iterations)."""


def train_run(plan: Plan, count: int, run_dir: Path) -> dict[str, Any]:
    """``mpirl train`` (PPO, 2 mpirl ranks: the driver with the learner, one rollout rank)
    beside the C echo solver's ``count`` groups of k ranks (MPMD), each step sleeping
    ``step_s``; medians of progress.csv's ``TRAIN_COLUMNS`` after the first iterations."""
    import csv

    config = {"ranks_per_env": plan.groups_k, "num_envs_per_worker": count,
              "rollout_fragment_length": plan.train_fragment, "num_epochs": 1,
              # One SGD step per iteration whatever the groups: sampling dominates.
              "minibatch_size": plan.train_fragment * max(plan.groups),
              "env_config": {"observation_size": 8, "action_size": ACTION_SIZE,
                             "step_s": plan.groups_step_s}}
    iterations = plan.train_warmup + plan.train_iterations
    mpirl = str(Path(sys.executable).with_name("mpirl"))
    command = [*mpiexec_command(2, mpirl, "train", "--algo", "PPO", "--env", "mpirl/Solver-v0",
                                "--progress", "off", "--run-dir", str(run_dir), "--stop",
                                json.dumps({"training_iteration": iterations}), "--config",
                                json.dumps(config)),
               ":", "-n", str(count * plan.groups_k), str(ECHO_SOLVER)]
    finished = run_process(command, f"mpirl train, {count} groups", 600)
    with open(run_dir / "progress.csv", newline="") as file:
        rows = list(csv.DictReader(file))[plan.train_warmup:]
    if not rows:
        raise BenchError(f"{run_dir}/progress.csv has no iteration after the first "
                         f"{plan.train_warmup}")
    medians = {column: statistics.median(float(row[column]) for row in rows)
               for column in TRAIN_COLUMNS}
    return {"iterations": len(rows), "job_s": finished.wall_s,
            "env_steps_per_s_per_group": medians["env_steps_per_s"] / count,
            "driver_cpu_ms_per_iter_per_group": medians["perf/driver_cpu_ms_per_iter"] / count,
            "driver_own_cpu_ms_per_iter_per_group":
                medians["perf/driver_own_cpu_ms_per_iter"] / count,
            **{column: value for column, value in medians.items()}}


def train_groups(plan: Plan, run_root: Path) -> dict[str, Any]:
    """The groups again in real training runs: per-group env steps/s against one group's, and
    rank 0's (the driver's) CPU per iteration, per group."""
    if solver_missing():
        return {"skipped": solver_missing()}
    by_groups = {str(count): train_run(plan, count, run_root / f"groups_{count}")
                 for count in plan.groups}
    one = by_groups[str(plan.groups[0])]["env_steps_per_s_per_group"]
    most = by_groups[str(plan.groups[-1])]["env_steps_per_s_per_group"]
    return {"algo": "PPO", "k": plan.groups_k, "step_s": plan.groups_step_s,
            "rollout_fragment_length": plan.train_fragment, "solver": "c", "mpirl_ranks": 2,
            "by_groups": by_groups,
            "per_group_vs_one": {n: e["env_steps_per_s_per_group"] / one
                                 for n, e in by_groups.items()},
            "target_met": most / one >= GROUP_TARGET}


def coupling_table(legs: dict[str, Any], sizes: tuple[int, ...]) -> None:
    rows = [("transport", *(f"{size:,} floats median / p90 us" for size in sizes))]
    for leg, entry in legs.items():
        cells = [leg]
        for size in sizes:
            point = entry.get(str(size), {})
            cells.append(f"{fmt(point.get('median_us'), 1)} / {fmt(point.get('p90_us'), 1)}")
        rows.append(tuple(cells))
    print_table(rows)


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="8 and 1,000 floats, fewer steps, 1 and 2 groups")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--env-side", choices=("python", "c"), default="python",
                        help="the relaunch leg's solver: a Python program, or the C "
                             "reaction-diffusion solver of examples/solvers/build (MPMD); the "
                             "other legs choose theirs (see the module's docstring)")
    hidden = argparse.SUPPRESS
    parser.add_argument("--role", help=hidden, choices=["simenvs", "link", "redis", "tcp",
                                                        "iterations", "groups"])
    for name, kind in (("size", int), ("steps", int), ("large-steps", int),
                       ("slow-poll-steps", int), ("warmup", int), ("port", int), ("k", int),
                       ("iterations", int), ("cells", int), ("groups", int),
                       ("step-s", float), ("sizes", str)):
        parser.add_argument(f"--{name}", type=kind, help=hidden)
    args = parser.parse_args()
    if args.role is not None:
        return run_measured(args)
    plan = Plan(**(QUICK if args.quick else FULL), env_side=args.env_side)
    missing = [str(path.relative_to(ROOT)) for path in (ECHO_SOLVER, RD_SOLVER)
               if not os.access(path, os.X_OK)]
    if plan.env_side == "c" and missing:
        parser.error(f"--env-side c needs {' and '.join(missing)} (make solvers)")
    legs = coupling_legs(plan, args.quick)
    print_problems(legs)
    print("one env step's round trip (action out, observation back), microseconds:")
    coupling_table(legs, plan.sizes)
    ran = [leg for leg, entry in legs.items() if entry and not ({"error", "skipped"} & set(entry))]
    reference = next((leg for leg in RATIO_LEGS if leg in ran), None)
    link_median = legs[reference][str(RATIO_SIZE)]["median_us"] if reference else None
    over = {leg: ratio(legs[leg].get(str(RATIO_SIZE), {}).get("median_us"), link_median)
            for leg in legs if leg != reference}
    print(f"at {RATIO_SIZE:,} floats, against {reference}: "
          + ", ".join(f"{leg} {fmt(value, 1)}x" for leg, value in over.items()))
    relaunched = attempt("relaunch vs kept alive", lambda: relaunch(plan, args.quick),
                         lambda r: f"{r['relaunched_s_per_iteration']:.3f} s per iteration "
                                   f"relaunched, {r['kept_alive_s_per_iteration']:.3f} s kept "
                                   f"alive")
    scaling = attempt("groups", lambda: groups(plan, args.quick),
                      lambda r: "per-group steps/s against one group's: " + ", ".join(
                          f"{n} groups {v:.2f}" for n, v in r["per_group_vs_one"].items()))
    if plan.train_fragment:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="mpirl-sim-bench-") as run_root:
            training = attempt("groups in PPO runs", lambda: train_groups(plan, Path(run_root)),
                               lambda r: "per-group env steps/s against one group's: " +
                               ", ".join(f"{n} groups {v:.2f}"
                                         for n, v in r.get("per_group_vs_one", {}).items()))
    else:
        training = {"skipped": "the full mode only (three training runs)"}
    report = {
        "meta": run_metadata(args.quick, plan, ("mpi4py", "numpy", "redis")),
        "legs_run": ran,
        "coupling": legs,
        "ratio_reference": reference,
        "over_mpirl_at_1000": over,
        "target_20x_met": (over["redis_tight"] >= TARGET_RATIO
                           if over["redis_tight"] is not None else None),
        "relaunch": relaunched,
        "groups": scaling,
        "groups_train": training,
    }
    write_report(report, args.json)
    failed = [name for name, entry in (*legs.items(), ("relaunch", relaunched),
                                       ("groups", scaling), ("groups_train", training))
              if "error" in entry]
    return 1 if failed else 0


def run_measured(args: argparse.Namespace) -> int:
    """A measured program (``--role``), started by the orchestrator under mpiexec."""
    plan = {"steps": args.steps, "large_steps": args.large_steps,
            "slow_poll_steps": args.slow_poll_steps, "warmup": args.warmup}
    sizes = [int(size) for size in (args.sizes or "").split(",") if size]
    if args.role == "simenvs":
        simenvs_role(args.size, args.steps, args.warmup, args.env_side)
    elif args.role == "link":
        link_role(args.size, args.steps, args.warmup, args.env_side)
    elif args.role == "redis":
        redis_role(args.port, sizes, plan)
    elif args.role == "tcp":
        tcp_role(sizes, plan)
    elif args.role == "iterations":
        iterations_role(args.k, args.steps, args.iterations, args.cells, args.env_side)
    else:
        groups_role(args.groups, args.k, args.steps, args.step_s, args.env_side)
    return 0


if __name__ == "__main__":
    run_main(main)
