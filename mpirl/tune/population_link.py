"""How the ranks of a population talk: the runtime's transport over the communicator the runtime
gives the population (``run_comm()``: COMM_WORLD for ``mpirl tune``, unless a caller nests it),
watched by the runtime's heartbeat.

What crosses ranks, on the population's own channel (tags in ``mpirl.runtime.dispatch``), between
the controller (rank 0) and each slot's leader (the slot's rank 0, the driver of every run in it):

* controller -> leader: a task (``TASK``): run a segment, send the trial's newest checkpoint to
  other leaders, receive one, or quit;
* leader -> controller: the outcome (``RESULT``): exit code and the segment's last row;
* leader -> leader: PBT's exploit, a whole checkpoint (``CHECKPOINT``), point to point;
* controller -> leader: a stop request while a segment runs (``STOP_TRIAL``).

Inside a slot the leader passes each task on to the other ranks of the slot (``TASK``, on the
slot's own channel).

No silent hang: the waits whose end is known (a checkpoint copied, sends taken) have a deadline,
the runs' ``task_timeout_s``. Waiting for the next task or for a segment's outcome has none a
clock could give (a trial runs as long as it runs), so every rank runs a heartbeat with the
controller, and the controller with every rank: a rank that dies or falls silent ends the job
with a message that names it, as in any run. Every wait polls and sleeps, so idle ranks leave
the cores to the trials that run.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from mpi4py import MPI

from mpirl.errors import TaskTimeout
from mpirl.runtime.driver import RuntimeSettings
from mpirl.runtime.heartbeat import Heartbeat
from mpirl.runtime.transport import Channel
from mpirl.runtime.waiting import Backoff

CONTROLLER = 0


def idle_backoff() -> Backoff:
    """Polls of an idle rank: sleeps from 0.1 ms doubling to 10 ms, no spinning (a population's
    ranks wait for whole trial segments, on machines with more ranks than cores)."""
    return Backoff(spin_s=0.0, min_sleep_s=1e-4, max_sleep_s=0.01)


def receive(channel: Channel, source: int, tag: int, timeout_s: float | None, what: str,
            idle: Callable[[], None] | None = None) -> tuple[Any, int]:
    """The next message of ``tag`` from ``source`` (``MPI.ANY_SOURCE`` allowed) and its sender.
    ``idle()`` runs between polls. After ``timeout_s`` (None: as long as the heartbeat says the
    sender lives) a TaskTimeout names ``what`` was awaited."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    backoff = idle_backoff()
    while (item := channel.poll(source, tag)) is None:
        if idle is not None:
            idle()
        if deadline is not None and time.monotonic() > deadline:
            sender = "any rank" if source == MPI.ANY_SOURCE else f"rank {source}"
            raise TaskTimeout(f"mpirl tune: no {what} from {sender} within {timeout_s:g} s "
                              f"(task_timeout_s)")
        channel.flush()  # drop the sends that have completed meanwhile
        backoff.sleep()
    return item


def _describe(rank: int, ranks_per_trial: int) -> str:
    if rank == CONTROLLER:
        return "the population controller (rank 0)"
    slot, member = divmod(rank - 1, ranks_per_trial)
    return f"rank {rank} ({'leader' if member == 0 else 'a member'} of trial slot {slot})"


class PopulationLink:
    """The population's channel between the controller and the slot leaders, and its heartbeat.

    Collective over ``comm``: every rank creates it at the same point, and closes it."""

    def __init__(self, comm: MPI.Comm, ranks_per_trial: int, settings: RuntimeSettings) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.timeout_s = settings.task_timeout_s
        self.channel = Channel(comm)
        peers = range(1, comm.Get_size()) if self.rank == CONTROLLER else (CONTROLLER,)
        self.heartbeat = Heartbeat(
            comm, peers, settings.heartbeat_interval_s, settings.heartbeat_timeout_s,
            lambda rank: _describe(rank, ranks_per_trial)).start()

    def isend(self, message: Any, dest: int, tag: int) -> None:
        """Start sending ``message`` to ``dest``; ``flush`` waits until it has been taken."""
        self.channel.isend(message, dest, tag)

    def isend_many(self, message: Any, dests: list[int], tag: int) -> None:
        """Start sending ``message`` to each of ``dests`` (pickled once)."""
        self.channel.isend_many(message, dests, tag)

    def receive(self, source: int, tag: int, what: str, *, waits_for_a_trial: bool = False,
                idle: Callable[[], None] | None = None) -> tuple[Any, int]:
        """The next message of ``tag`` from ``source`` and its sender. A wait that lasts as
        long as a trial runs (``waits_for_a_trial``) has no deadline but the heartbeat's; any
        other has ``task_timeout_s``."""
        return receive(self.channel, source, tag, None if waits_for_a_trial else self.timeout_s,
                       what, idle)

    def poll(self, source: int, tag: int) -> Any | None:
        """A message of ``tag`` from ``source`` if one has come, else None."""
        item = self.channel.poll(source, tag)
        return None if item is None else item[0]

    def flush(self, what: str) -> None:
        """Wait until every message sent has been taken; TaskTimeout after ``task_timeout_s``."""
        if not self.channel.flush(timeout=self.timeout_s):
            raise TaskTimeout(f"mpirl tune: {what} not taken within {self.timeout_s:g} s "
                              f"(task_timeout_s)")

    def close(self) -> None:
        """Stop the heartbeat and free the communicators (sends still pending complete first)."""
        self.heartbeat.stop()
        self.heartbeat.free()
        for comm in (self.channel.comm, self.channel.bulk):
            with contextlib.suppress(MPI.Exception):
                comm.Free()
