"""The MPMD start-up: finding a solver program's processes in ``MPI.COMM_WORLD``.

``mpiexec -n 3 mpirl train ... : -n 8 ./solver`` starts one MPI world of 11 processes: mpirl's
and the solver's (C, C++ or Fortran, through ``mpirl/envs/solver/mpirl_solver.h``). MPI_APPNUM
cannot tell them apart everywhere (srun's ``--multi-prog`` starts one app; some PMIs give -1), so
the processes introduce themselves (``sim_link``'s HELLO and GO): every process but world rank 0
sends world rank 0 a HELLO (``"mpirl|pid|host|argv0"``, or ``"solver|..."`` from
``mpirl_init``); rank 0 answers each with GO = ``[solver processes S, world rank of the first]``.
A world without solvers stops there: one round of 256-byte messages.

With solvers every process splits COMM_WORLD into mpirl's part and the solver's, and the two
parts build an intercommunicator (the *link* to the external env groups: its remote ranks are
the solver's ranks). mpirl's part then stands for COMM_WORLD in this process
(``world.set_app_comm``), so the layout, heartbeats and ULFM see only mpirl's ranks.

mpirl's processes come first in the world (a solver at world rank 0 is refused by
``mpirl_init``) and the solver's form one block after them. ``join_apps`` runs once per
process, right after MPI_Init, before anything else uses COMM_WORLD (``mpirl.cli``).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from mpirl.errors import EXIT_RANK_LOST, LayoutError
from mpirl.runtime import sim_link, startup, world
from mpirl.runtime.waiting import Backoff

#: How long world rank 0 waits for every HELLO unless the config's startup_timeout_s says.
DEFAULT_TIMEOUT_S = startup.DEFAULT_TIMEOUT_S
#: How long mpirl's rank 0 gives each END to leave (eager in practice: it completes at once).
END_TIMEOUT_S = 5.0

MPIRL_KIND = "mpirl"
SOLVER_KIND = "solver"


@dataclass(frozen=True)
class SolverProcess:
    """One process of the solver program, as its HELLO described it."""

    world_rank: int
    pid: int
    host: str
    program: str  # its argv[0]

    @property
    def solver_rank(self) -> int:
        """Its rank in the solver program (the link's remote rank); set by ``join_apps``."""
        return self.world_rank - _state.first_solver


@dataclass
class _Apps:
    solvers: tuple[SolverProcess, ...] = ()
    first_solver: int = 0
    link: MPI.Intercomm | None = None
    joined: bool = False
    ended: bool = False
    join_s: float = 0.0


_state = _Apps()


def join_apps(timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
    """Take part in the MPMD start-up on ``MPI.COMM_WORLD``; returns the number of solver
    processes (0: a world of mpirl alone, nothing changed). Collective over COMM_WORLD; a second
    call returns at once. World rank 0 waits ``timeout_s`` for every HELLO, then names the
    ranks that never came and ends the job (exit 70)."""
    if _state.joined:
        return len(_state.solvers)
    started = time.perf_counter()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        _state.joined = True
        return 0
    go = np.zeros(sim_link.GO_LEN, dtype=np.int64)
    if rank == 0:
        hellos = _collect_hellos(comm, size, timeout_s)
        solvers = [hello for hello in hellos if hello.kind == SOLVER_KIND]
        first = solvers[0].world_rank if solvers else 0
        _check_order(hellos, first)
        go[:] = (len(solvers), first)
        requests = [comm.Isend([go, MPI.INT64_T], r, sim_link.TAG_GO) for r in range(1, size)]
        _wait_all(requests)
        _state.solvers = tuple(SolverProcess(h.world_rank, h.pid, h.host, h.program)
                               for h in solvers)
    else:
        _send_hello_wait_go(comm, rank, go, timeout_s)
    count, first = int(go[0]), int(go[1])
    _state.first_solver = first
    _state.joined = True
    if count == 0:
        return 0
    mpirl_part = comm.Split(0, rank)
    # Only mpirl's rank 0 read the HELLOs: the table reaches mpirl's other ranks here.
    _state.solvers = mpirl_part.bcast(_state.solvers, root=0)
    _state.link = mpirl_part.Create_intercomm(0, comm, first, sim_link.TAG_INTERCOMM)
    world.set_app_comm(mpirl_part)
    _state.join_s = time.perf_counter() - started
    return count


def solver_link() -> MPI.Intercomm | None:
    """The intercommunicator to the solver program (remote ranks: the solver's ranks), or None
    in a world without solvers."""
    return _state.link


def solver_table() -> tuple[SolverProcess, ...]:
    """The solver's processes in world order (empty without solvers)."""
    return _state.solvers


def solver_ranks() -> int:
    """The number of solver processes (0 without solvers)."""
    return len(_state.solvers)


def join_seconds() -> float:
    """How long the start-up with solvers took on this process (HELLOs, GO, the split and the
    intercommunicator; for startup.json's ``solver_hello_s``); 0.0 without solvers."""
    return _state.join_s


def end_solvers(code: int) -> None:
    """Send END (``[END, code]``) to every solver process, once per process, from mpirl's rank
    0 (a no-op elsewhere and without solvers): how a run that ends before its groups started
    (a config error, a LayoutError) lets its solvers leave with ``code`` instead of hanging.
    The driver's shutdown should call it too (not send END on its own), so that a solver
    hears END once."""
    link = _state.link
    if link is None or _state.ended or link.Get_rank() != 0:
        return
    _state.ended = True
    end = np.array([sim_link.END, code], dtype=np.int64)
    try:
        requests = [link.Isend([end, MPI.INT64_T], r, sim_link.TAG_END)
                    for r in range(link.Get_remote_size())]
        deadline = time.monotonic() + END_TIMEOUT_S
        backoff = Backoff()
        while not MPI.Request.Testall(requests):
            if time.monotonic() > deadline:
                for request in requests:
                    request.Cancel()
                return
            backoff.sleep()
    except MPI.Exception:
        # A solver that left already (after mpirl_fail, or lost) has nothing more to hear;
        # the run's own exit code says what happened.
        pass


@dataclass(frozen=True)
class _Hello:
    world_rank: int
    kind: str
    pid: int
    host: str
    program: str


def _hello_bytes() -> bytearray:
    text = f"{MPIRL_KIND}|{os.getpid()}|{socket.gethostname()}|{sys.argv[0] if sys.argv else ''}"
    buffer = bytearray(sim_link.HELLO_BYTES)
    data = text.encode("utf-8", "replace")[:sim_link.HELLO_BYTES - 1]
    buffer[:len(data)] = data
    return buffer


def _parse_hello(world_rank: int, buffer: bytearray) -> _Hello:
    text = bytes(buffer).split(b"\0", 1)[0].decode("utf-8", "replace")
    parts = text.split("|", 3)
    if len(parts) != 4 or parts[0] not in (MPIRL_KIND, SOLVER_KIND) or not parts[1].isdigit():
        raise LayoutError(f"world rank {world_rank} sent a start-up message mpirl cannot read "
                          f"({text[:60]!r}); is it another program's message on COMM_WORLD?")
    return _Hello(world_rank, parts[0], int(parts[1]), parts[2], parts[3])


def _collect_hellos(comm: MPI.Comm, size: int, timeout_s: float) -> list[_Hello]:
    hellos: dict[int, _Hello] = {}
    buffer, status = bytearray(sim_link.HELLO_BYTES), MPI.Status()
    start, backoff = time.monotonic(), Backoff()
    while len(hellos) < size - 1:
        message = comm.Improbe(MPI.ANY_SOURCE, sim_link.TAG_HELLO, status)
        if message is not None:
            buffer[:] = bytes(sim_link.HELLO_BYTES)
            message.Recv([buffer, MPI.CHAR])
            source = status.Get_source()
            hellos[source] = _parse_hello(source, buffer)
            backoff.reset()
            continue
        if time.monotonic() - start > timeout_s:
            missing = sorted(set(range(1, size)) - set(hellos))
            _end_start_up(f"world {_rank_list(missing)} did not arrive within "
                          f"startup_timeout_s {timeout_s:g} s; an MPMD solver must call "
                          f"mpirl_init first")
        backoff.sleep()
    own = _Hello(0, MPIRL_KIND, os.getpid(), socket.gethostname(), sys.argv[0])
    return [own, *(hellos[r] for r in sorted(hellos))]


def _check_order(hellos: list[_Hello], first: int) -> None:
    """mpirl's processes first, then the solver's, as one block each."""
    kinds = [hello.kind for hello in hellos]
    if SOLVER_KIND not in kinds:
        return
    if MPIRL_KIND in kinds[first:]:
        late = [h.world_rank for h in hellos[first:] if h.kind == MPIRL_KIND]
        verb = "run" if len(late) > 1 else "runs"
        _end_start_up(f"world {_rank_list(late)} {verb} mpirl after the solver's first process "
                      f"(world rank {first}); an MPMD launch gives mpirl's processes first, then "
                      f"the solver's: mpiexec -n N mpirl ... : -n S ./solver", code=2)


def _send_hello_wait_go(comm: MPI.Comm, rank: int, go: np.ndarray, timeout_s: float) -> None:
    hello = _hello_bytes()
    sent = comm.Isend([hello, MPI.CHAR], 0, sim_link.TAG_HELLO)
    start, backoff = time.monotonic(), Backoff()
    while not comm.Iprobe(0, sim_link.TAG_GO):
        # Twice rank 0's deadline, so that rank 0 is the one to name who is missing.
        if time.monotonic() - start > 2 * timeout_s:
            _end_start_up(f"world rank {rank} waited {2 * timeout_s:g} s (twice "
                          f"startup_timeout_s) for world rank 0 to answer its start-up message; "
                          f"ending this rank")
        backoff.sleep()
    comm.Recv([go, MPI.INT64_T], 0, sim_link.TAG_GO)
    sent.Wait()


def _wait_all(requests: list[MPI.Request]) -> None:
    backoff = Backoff()
    while not MPI.Request.Testall(requests):
        backoff.sleep()


def _rank_list(ranks: list[int]) -> str:
    """``rank 3`` or ``ranks 3-10, 12``."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


def _end_start_up(message: str, code: int = EXIT_RANK_LOST) -> None:
    from mpirl.runtime.heartbeat import abort_this_rank

    print(f"mpirl: {message} (exit code {code}).", file=sys.stderr, flush=True)
    abort_this_rank(code)
