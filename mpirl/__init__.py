"""mpirl: distributed reinforcement learning on MPI.

Rank 0 drives; every other rank hosts stateful workers (rollout, replay, learner) that rank 0 calls
asynchronously. See ``mpirl.runtime.run`` for the entry point and ``mpirl.core`` for the interfaces.
"""

from mpirl.core import RankContext, Worker
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
