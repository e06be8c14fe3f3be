"""The run's world: the communicator that one mpirl run spans.

An ordinary run spans ``MPI.COMM_WORLD``. A run may instead span a sub-communicator (``mpirl
tune`` splits the world into one communicator per trial slot and runs an ordinary run in each):
then that communicator's rank 0 is the run's driver, the layout is resolved against its size, and
"my rank" and "rank 0" mean ranks in it. Code that needs either asks here, never
``MPI.COMM_WORLD``, so that nothing above the runtime knows whether its run is nested::

    sub = MPI.COMM_WORLD.Split(slot, key=rank)
    mpirl.run(main, layout, comm=sub)          # or: with running_on(sub): mpirl.train(...)

``run`` sets the run's communicator for its whole length, and puts back the previous one when it
returns. ``running_on`` sets it around more than one run, or around what comes before a run (the
checks ``make_request`` makes on every rank, where only rank 0 speaks). It is one per process,
not per thread: the driver thread of ``mpirl.Algorithm`` and the script's own thread share it.

In an MPMD launch with a solver program (``mpiexec -n 3 mpirl ... : -n 8 ./solver``) the world
holds the solver's processes too: ``mpirl.runtime.apps`` then sets mpirl's own processes as the
*app communicator* (``set_app_comm``), which takes COMM_WORLD's place everywhere here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from mpi4py import MPI

from mpirl.runtime import startup

# The first import of mpi4py.MPI ran MPI_Init. The CLI marks this point itself, right after
# MPI_Init; a script that calls mpirl.run or mpirl.train gets it marked here.
startup.mark("mpi_ready")

_current: MPI.Comm | None = None
_app: MPI.Comm | None = None


def app_comm() -> MPI.Comm:
    """mpirl's own processes: ``MPI.COMM_WORLD``, or in an MPMD launch with a solver program
    the part of it that runs mpirl (``set_app_comm``)."""
    return MPI.COMM_WORLD if _app is None else _app


def set_app_comm(comm: MPI.Comm | None) -> None:
    """Make ``comm`` (mpirl's processes of an MPMD world) stand for ``MPI.COMM_WORLD`` in this
    process from now on: the default run communicator and the base of ``nested``. None: back
    to COMM_WORLD. Called once, before anything uses the run's communicator."""
    global _app
    if comm is not None and comm == MPI.COMM_NULL:
        raise ValueError("the app communicator must hold this rank, got COMM_NULL")
    _app = comm


def run_comm() -> MPI.Comm:
    """The communicator of the run this process is in (or about to start): the one given to
    ``run`` or ``running_on``, else ``app_comm()`` (``MPI.COMM_WORLD`` unless an MPMD launch
    set mpirl's part of it)."""
    return app_comm() if _current is None else _current


def run_rank() -> int:
    """This process's rank in its run (0: the run's driver)."""
    return run_comm().Get_rank()


def run_size() -> int:
    """The number of ranks in this process's run."""
    return run_comm().Get_size()


def nested() -> bool:
    """True when the run's communicator is not ``app_comm()`` (``MPI.COMM_WORLD`` unless an
    MPMD launch set mpirl's part of it)."""
    return run_comm() != app_comm()


@contextlib.contextmanager
def running_on(comm: MPI.Comm | None) -> Iterator[MPI.Comm]:
    """Make ``comm`` the run's communicator inside the block (None: keep the current one);
    the previous one comes back on leaving it."""
    global _current
    previous = _current
    if comm is not None:
        if comm == MPI.COMM_NULL:
            raise ValueError("a run needs a communicator this rank belongs to, got COMM_NULL")
        _current = comm
    try:
        yield run_comm()
    finally:
        _current = previous
