"""mpirl: distributed reinforcement learning on MPI.

Rank 0 drives; every other rank hosts stateful workers (rollout, replay, learner) that rank 0 calls
asynchronously. See ``mpirl.runtime.run`` for the entry point and ``mpirl.core`` for the interfaces.
"""

from __future__ import annotations

import importlib
import os as _os
from typing import TYPE_CHECKING, Any

# Under ULFM (mpiexec --with-ft ulfm) Open MPI's MPI_Finalize starts with a PMIx fence over the job
# that hung the survivors of a dead rank (all in usleep in ompi_mpi_finalize) in about 1 job in
# 10 here; skipping it (async_mpi_finalize) gave 0 hangs in 60. mpirl needs no such barrier: the
# driver finalizes last, after every worker has acknowledged the stop. Read at MPI_Init, so it is
# set before anything imports mpi4py.MPI; a value the user set wins.
if _os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() in ("1", "true", "yes", "on"):
    _os.environ.setdefault("OMPI_MCA_async_mpi_finalize", "1")

__version__ = "0.1.0"

# Imported on first use: importing mpi4py.MPI initializes MPI, and `mpirl launch` (a supervisor
# that runs outside MPI) must be able to import mpirl without becoming an MPI singleton.
_EXPORTS = {
    "RankContext": "mpirl.core", "Worker": "mpirl.core",
    "Future": "mpirl.dispatch", "WorkerGroup": "mpirl.dispatch",
    "WorkerHandle": "mpirl.dispatch", "wait": "mpirl.dispatch",
    "ConfigError": "mpirl.errors", "LayoutError": "mpirl.errors", "MpirlError": "mpirl.errors",
    "RankLost": "mpirl.errors", "RemoteError": "mpirl.errors", "TaskTimeout": "mpirl.errors",
    "Layout": "mpirl.layout", "Placement": "mpirl.layout",
    "Driver": "mpirl.runtime", "RuntimeSettings": "mpirl.runtime", "run": "mpirl.runtime",
}

__all__ = [
    "ConfigError", "Driver", "Future", "Layout", "LayoutError", "MpirlError", "Placement",
    "RankContext", "RankLost", "RemoteError", "RuntimeSettings", "TaskTimeout", "Worker",
    "WorkerGroup", "WorkerHandle", "__version__", "run", "wait",
]

if TYPE_CHECKING:
    from mpirl.core import RankContext, Worker
    from mpirl.dispatch import Future, WorkerGroup, WorkerHandle, wait
    from mpirl.errors import (
        ConfigError,
        LayoutError,
        MpirlError,
        RankLost,
        RemoteError,
        TaskTimeout,
    )
    from mpirl.layout import Layout, Placement
    from mpirl.runtime import Driver, RuntimeSettings, run


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mpirl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
