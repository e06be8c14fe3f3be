"""An env rank: one member of an env group, running its share of a ``mpirl.Simulation``.

Each env rank of the run's world (``ranks_per_env`` k >= 1) hosts a ``SimulationMember``; the
driver makes one long call, ``serve``, which runs ``serve_group`` until the group is told to
end. What crosses ranks (``mpirl.runtime.sim_link``): SETUP from the rollout rank to every
member; COMMANDs from the rollout rank to the group's root, which broadcasts each to the group;
the root's REPLY (or ERROR) back; END from the driver (link rank 0) to every member at shutdown.
Every wait polls with back-off: no core spins, and no blocking receive waits on a peer that may
be gone (the heartbeat ends the job if one is).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from mpi4py import MPI

from mpirl.envs.simulation import Simulation
from mpirl.runtime import sim_link
from mpirl.runtime.core import RankContext, Worker
from mpirl.runtime.waiting import Backoff
from mpirl.workers.env_spec import EnvSpec

__all__ = ["SimulationMember", "serve_group"]


class SimulationMember(Worker):
    """One env rank's member of its env group (``context.group_comm``); driven over
    ``context.sim_link`` by the rollout rank that owns the group."""

    MESSAGES = ("serve",)

    def __init__(self, context: RankContext, env: EnvSpec) -> None:
        super().__init__(context)
        group = context.placement.group_of(context.rank)
        if group is None or context.group_comm is None or context.sim_link is None:
            raise ValueError(f"rank {context.rank} is in no env group")
        simulation = env.simulation_class()
        if simulation is None:
            raise ValueError(f"{env.env_id!r} is not an mpirl.Simulation")
        self.group = group
        self.simulation_class = simulation

    def serve(self) -> int:
        """Run this member's share of the group until END; return END's exit code."""
        backoff = self.context.collective_backoff or (1e-3, 0.0)
        return serve_group(self.context.sim_link, self.context.group_comm,
                           self.simulation_class, self.group.rollout_rank,
                           Backoff(max_sleep_s=backoff[0], sleep_share=backoff[1]))


def serve_group(link: MPI.Comm, group_comm: MPI.Comm, simulation_class: type[Simulation],
                rollout_rank: int, backoff: Backoff, driver_rank: int = 0) -> int:
    """A member's whole life: SETUP, the Simulation built on ``group_comm`` from SETUP's
    env_config, then COMMANDs until END. Collective over ``group_comm``; the root (its rank 0)
    talks to ``rollout_rank`` on ``link``. Returns the exit code END carried, after the
    driver's END has reached this member (so no message to it is left unreceived)."""
    ended = _Ended()
    setup = np.zeros(sim_link.SETUP_LEN, np.int64)
    if not _take(link, rollout_rank, sim_link.TAG_SETUP, setup, ended, driver_rank, backoff):
        return ended.code
    if setup[sim_link.SETUP_MAGIC] != sim_link.MAGIC or \
            setup[sim_link.SETUP_VERSION] != sim_link.VERSION:
        raise RuntimeError(f"SETUP from rank {rollout_rank} is not of protocol version "
                           f"{sim_link.VERSION}: {setup[:2].tolist()}")
    text = np.zeros(int(setup[sim_link.SETUP_JSON_BYTES]), np.uint8)
    if not _take(link, rollout_rank, sim_link.TAG_SETUP_JSON, text, ended, driver_rank,
                 backoff):
        return ended.code
    env_config: dict[str, Any] = json.loads(text.tobytes().decode()) if text.size else {}
    root = group_comm.Get_rank() == 0
    obs_size = int(setup[sim_link.SETUP_OBS_SIZE])
    discrete = setup[sim_link.SETUP_ACTION_KIND] == sim_link.ACTION_DISCRETE
    row = np.zeros(sim_link.COMMAND_HEADER + int(setup[sim_link.SETUP_ACTION_SIZE]))
    reply = np.zeros(sim_link.REPLY_HEADER + obs_size)
    simulation: Simulation | None = None
    failure: str | None = None
    try:
        simulation = simulation_class(group_comm, **env_config)
    except Exception as error:  # noqa: BLE001 - the root reports it at the first command
        failure = f"{type(error).__name__}: {error}"
    while True:
        if root and not _next_command(link, rollout_rank, row, ended, driver_rank, backoff):
            row[:2] = (sim_link.END, ended.code)
        _broadcast(group_comm, row, link, ended, driver_rank, backoff)
        code = int(row[0])
        if code == sim_link.END:
            ended.code = ended.code if ended.got else int(row[1])
            break
        reply[:] = 0.0
        reply[0] = row[1]
        try:
            if failure is not None:
                raise RuntimeError(failure)
            if code == sim_link.RESET:
                seed = int(row[1])
                obs = simulation.reset(None if seed == sim_link.NO_SEED else seed)
                if root:
                    reply[4:] = np.ravel(obs)
            elif code == sim_link.STEP:
                action = int(row[2]) if discrete else row[2:]
                result = simulation.step(action)
                if root:
                    obs, reward, terminated, truncated = result
                    reply[1:4] = (reward, bool(terminated), bool(truncated))
                    reply[4:] = np.ravel(obs)
        except Exception as error:  # noqa: BLE001 - the rollout rank names it and ends the run
            if failure is None:
                failure = f"{type(error).__name__}: {error}"
                if not root:
                    failure += f" (member {group_comm.Get_rank()}, rank {link.Get_rank()})"
                    # Straight to the rollout rank too: the root may be stuck in a collective
                    # of the simulation that this member left.
                    _send(link, _text(failure), rollout_rank, sim_link.TAG_ERROR, backoff,
                          MPI.BYTE)
        # Whether any member failed (a flag per command, over the group): the root then answers
        # ERROR with the failed member's message, and no member computes again.
        failed_member = _failed_member(group_comm, failure is not None, link, ended,
                                       driver_rank, backoff)
        if failed_member == _ABANDONED:
            break
        if failed_member >= 0:
            failure = _member_failure(group_comm, failed_member, failure, backoff)
            if root:
                reply[0] = sim_link.ERROR_SEQ
                _send(link, reply, rollout_rank, sim_link.TAG_REPLY, backoff)
                _send(link, _text(failure), rollout_rank, sim_link.TAG_ERROR, backoff,
                      MPI.BYTE)
            continue
        if root:
            _send(link, reply, rollout_rank, sim_link.TAG_REPLY, backoff)
    if simulation is not None:
        simulation.close()
    if not ended.got:
        _take(link, MPI.PROC_NULL, -1, None, ended, driver_rank, backoff)
    return ended.code


#: ``_failed_member``'s answer when the driver's END came first.
_ABANDONED = -2
_DATATYPES = {"q": MPI.INT64_T, "l": MPI.INT64_T, "d": MPI.DOUBLE, "B": MPI.BYTE}


class _Ended:
    """Whether the driver's END has reached this member, and its exit code."""

    __slots__ = ("got", "code", "buffer")

    def __init__(self) -> None:
        self.got, self.code = False, 0
        self.buffer = np.zeros(2, np.int64)


def _poll_end(link: MPI.Comm, ended: _Ended, driver_rank: int) -> bool:
    if ended.got:
        return True
    if link.Iprobe(driver_rank, sim_link.TAG_END):
        link.Recv([ended.buffer, MPI.INT64_T], driver_rank, sim_link.TAG_END)
        ended.got, ended.code = True, int(ended.buffer[1])
    return ended.got


def _take(link: MPI.Comm, source: int, tag: int, buffer: np.ndarray | None, ended: _Ended,
          driver_rank: int, backoff: Backoff) -> bool:
    """Receive ``buffer`` from ``source`` (True), or the driver's END first (False)."""
    backoff.reset()
    while True:
        if source != MPI.PROC_NULL and link.Iprobe(source, tag):
            link.Recv([buffer, _DATATYPES[buffer.dtype.char]], source, tag)
            return True
        if _poll_end(link, ended, driver_rank):
            return False
        backoff.sleep()


def _next_command(link: MPI.Comm, rollout_rank: int, row: np.ndarray, ended: _Ended,
                  driver_rank: int, backoff: Backoff) -> bool:
    """The root: the next COMMAND into ``row`` (True), or the driver's END (False)."""
    if ended.got:
        return False
    return _take(link, rollout_rank, sim_link.TAG_COMMAND, row, ended, driver_rank, backoff)


def _broadcast(group_comm: MPI.Comm, row: np.ndarray, link: MPI.Comm, ended: _Ended,
               driver_rank: int, backoff: Backoff) -> None:
    """The root's row to every member, waited on with back-off; a member takes the driver's
    END meanwhile (the root broadcasts END after it)."""
    if group_comm.Get_size() == 1:
        return
    request = group_comm.Ibcast([row, MPI.DOUBLE], root=0)
    backoff.reset()
    while not request.Test():
        if group_comm.Get_rank():
            _poll_end(link, ended, driver_rank)
        backoff.sleep()


def _text(message: str) -> np.ndarray:
    return np.frombuffer(message.encode()[:4096], np.uint8)


def _failed_member(group_comm: MPI.Comm, failed: bool, link: MPI.Comm, ended: _Ended,
                   driver_rank: int, backoff: Backoff) -> int:
    """The lowest member that failed at this command (this one if ``failed``), or -1: one
    small allreduce per command, polled with back-off. The driver's END ends the wait
    (``_ABANDONED``): a member stuck in the simulation's own collective may never come, and
    END reaches every member, so none waits here for one that left."""
    size = group_comm.Get_size()
    if size == 1:
        return 0 if failed else -1
    flag = np.array([group_comm.Get_rank() if failed else size], np.int64)
    lowest = np.zeros(1, np.int64)
    request = group_comm.Iallreduce([flag, MPI.INT64_T], [lowest, MPI.INT64_T], MPI.MIN)
    backoff.reset()
    while not request.Test():
        if _poll_end(link, ended, driver_rank):
            return _ABANDONED
        backoff.sleep()
    return int(lowest[0]) if lowest[0] < size else -1


def _member_failure(group_comm: MPI.Comm, member: int, failure: str | None,
                    backoff: Backoff) -> str:
    """The failed member's message on every member (the root sends it to the rollout rank)."""
    if group_comm.Get_size() == 1:
        return failure or ""
    data = np.zeros(4096, np.uint8)
    length = np.zeros(1, np.int64)
    if group_comm.Get_rank() == member:
        text = _text(failure or "")
        data[:text.size], length[0] = text, text.size
    for buffer, datatype in ((length, MPI.INT64_T), (data, MPI.BYTE)):
        request = group_comm.Ibcast([buffer, datatype], root=member)
        backoff.reset()
        while not request.Test():
            backoff.sleep()
    return data[:int(length[0])].tobytes().decode(errors="replace")


def _send(link: MPI.Comm, data: np.ndarray, dest: int, tag: int, backoff: Backoff,
          datatype: MPI.Datatype = MPI.DOUBLE) -> None:
    """Send with back-off; a rollout rank that is gone leaves this wait to the heartbeat,
    which ends the job."""
    request = link.Isend([data, datatype], dest, tag)
    backoff.reset()
    while not request.Test():
        backoff.sleep()
