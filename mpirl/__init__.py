"""mpirl: distributed reinforcement learning on MPI.

Rank 0 drives; every other rank hosts stateful workers (rollout, replay, learner) that rank 0 calls
asynchronously. ``mpirl.train`` runs a whole training run; ``mpirl.run`` (``mpirl.runtime.driver``)
runs a driver function of your own over workers (``mpirl.runtime.core``).
"""

from __future__ import annotations

import importlib
import os as _os
import time as _time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

_IMPORTED_AT = _time.time()
"""When ``import mpirl`` began: the interpreter's own start-up ended (mpirl.runtime.startup)."""

# Under ULFM (mpiexec --with-ft ulfm) Open MPI's MPI_Finalize starts with a PMIx fence over the job
# that hung the survivors of a dead rank (all in usleep in ompi_mpi_finalize) in about 1 job in
# 10 here; skipping it (async_mpi_finalize) gave 0 hangs in 60. mpirl needs no such barrier: the
# driver finalizes last, after every worker has acknowledged the stop. Read at MPI_Init, so it is
# set before anything imports mpi4py.MPI; a value the user set wins.
if _os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() in ("1", "true", "yes", "on"):
    _os.environ.setdefault("OMPI_MCA_async_mpi_finalize", "1")

# The only one-sided MPI that mpirl uses is ES's node-local shared window (osc sm). The Open MPI
# wheel's UCX component fails its query on hosts without UCX devices and prints an error on
# every rank that opens a window; leaving it out costs nothing.
_os.environ.setdefault("OMPI_MCA_osc", "^ucx")


def _all_ranks_on_one_node(environ: Mapping[str, str] = _os.environ) -> bool:
    """Whether the launcher placed every rank of this job on this node (False when unsure)."""
    world, local = environ.get("OMPI_COMM_WORLD_SIZE"), environ.get("OMPI_COMM_WORLD_LOCAL_SIZE")
    if world and local:  # mpiexec (prterun) says how many ranks share this node
        return world == local
    step_nodes = environ.get("SLURM_STEP_NUM_NODES")
    if step_nodes:  # srun
        return step_nodes == "1"
    # No launcher at all is a singleton; an unknown launcher may span nodes.
    return not any(k in environ for k in ("PMIX_RANK", "PMI_RANK", "PMI_SIZE"))


# Open MPI's libfabric BTL (ofi) probes its providers in MPI_Init: 1.1 s per rank here, against
# 0.1 s without it, and every rank pays it at every start. Ranks on one node talk through shared
# memory (btl sm), so leave ofi out there; across nodes it may be the interconnect, so keep it.
# A value the user set wins.
if _all_ranks_on_one_node():
    _os.environ.setdefault("OMPI_MCA_btl", "^ofi")

__version__ = "0.2.0"

# Imported on first use: importing mpi4py.MPI initializes MPI, and `mpirl launch` (a supervisor
# that runs outside MPI) must be able to import mpirl without becoming an MPI singleton.
_EXPORTS = {
    "RankContext": "mpirl.runtime.core", "Worker": "mpirl.runtime.core",
    "Future": "mpirl.runtime.dispatch", "WorkerGroup": "mpirl.runtime.dispatch",
    "WorkerHandle": "mpirl.runtime.dispatch", "wait": "mpirl.runtime.dispatch",
    "ConfigError": "mpirl.errors", "LayoutError": "mpirl.errors", "MpirlError": "mpirl.errors",
    "RankLost": "mpirl.errors", "RemoteError": "mpirl.errors", "TaskTimeout": "mpirl.errors",
    "Layout": "mpirl.runtime.layout", "Placement": "mpirl.runtime.layout",
    "Driver": "mpirl.runtime.driver", "RuntimeSettings": "mpirl.runtime.driver",
    "run": "mpirl.runtime.driver",
    "train": "mpirl.api", "Algorithm": "mpirl.api", "RunFailed": "mpirl.api",
    "open_dataset": "mpirl.data.reader", "Callbacks": "mpirl.workers.callbacks",
    "CallbackError": "mpirl.errors",
    "Simulation": "mpirl.envs.simulation", "SimulationError": "mpirl.errors",
}

__all__ = [
    "Algorithm", "CallbackError", "Callbacks", "RunFailed", "open_dataset", "train",
    "ConfigError", "Driver", "Future", "Layout", "LayoutError", "MpirlError", "Placement",
    "RankContext", "RankLost", "RemoteError", "RuntimeSettings", "TaskTimeout", "Worker",
    "WorkerGroup", "WorkerHandle", "__version__", "run", "wait", "Simulation", "SimulationError",
]

if TYPE_CHECKING:
    from mpirl.api import Algorithm, RunFailed, train
    from mpirl.data.reader import open_dataset
    from mpirl.envs.simulation import Simulation
    from mpirl.errors import (
        CallbackError,
        ConfigError,
        LayoutError,
        MpirlError,
        RankLost,
        RemoteError,
        SimulationError,
        TaskTimeout,
    )
    from mpirl.runtime.core import RankContext, Worker
    from mpirl.runtime.dispatch import Future, WorkerGroup, WorkerHandle, wait
    from mpirl.runtime.driver import Driver, RuntimeSettings, run
    from mpirl.runtime.layout import Layout, Placement
    from mpirl.workers.callbacks import Callbacks


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mpirl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
