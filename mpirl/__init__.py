"""mpirl: distributed reinforcement learning on MPI.

Rank 0 drives; every other rank hosts stateful workers (rollout, replay, learner) that rank 0 calls
asynchronously. See ``mpirl.runtime.run`` for the entry point and ``mpirl.core`` for the interfaces.
"""

import os as _os

# Under ULFM (mpiexec --with-ft ulfm) Open MPI's MPI_Finalize starts with a PMIx fence over the job
# that hung the survivors of a dead rank (all in usleep in ompi_mpi_finalize) in about 1 job in
# 10 here; skipping it (async_mpi_finalize) gave 0 hangs in 60. mpirl needs no such barrier: the
# driver finalizes last, after every worker has acknowledged the stop. Read at MPI_Init, so it is
# set before anything imports mpi4py.MPI; a value the user set wins.
if _os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() in ("1", "true", "yes", "on"):
    _os.environ.setdefault("OMPI_MCA_async_mpi_finalize", "1")

from mpirl.core import RankContext, Worker  # noqa: E402
from mpirl.dispatch import Future, WorkerGroup, WorkerHandle, wait
from mpirl.errors import ConfigError, LayoutError, MpirlError, RankLost, RemoteError, TaskTimeout
from mpirl.layout import Layout, Placement
from mpirl.runtime import Driver, RuntimeSettings, run

__version__ = "0.1.0"

__all__ = [
    "ConfigError", "Driver", "Future", "Layout", "LayoutError", "MpirlError", "Placement",
    "RankContext", "RankLost", "RemoteError", "RuntimeSettings", "TaskTimeout", "Worker",
    "WorkerGroup", "WorkerHandle", "__version__", "run", "wait",
]
