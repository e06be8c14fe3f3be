"""Start-up, phase by phase: when each rank reached each point, counted from its process start.

Every rank marks the points it passes (``mark``); the host exchange at start-up carries each
rank's marks to rank 0, which adds its own later ones (workers built, first iteration) and
writes them to the run directory as ``startup.json``. Nothing here talks to other ranks.

The points, in the order a rank passes them:

- ``process_start``: the kernel started the process (read from ``/proc``; Linux only);
- ``mpirl_imported``: the interpreter is up and ``import mpirl`` has begun;
- ``mpi_ready``: ``mpi4py.MPI`` is imported, so ``MPI_Init`` is done;
- ``imports_done`` (the CLI): the command's modules are imported (torch, gymnasium, h5py);
- ``run_start``: ``mpirl.run`` was called: the command's checks of its request (the env built
  once for its spaces, the model checked) are behind it;
- ``ranks_connected``: every rank arrived, and the channels and communicators exist;
- ``workers_built`` (rank 0): the algorithm and its workers (envs, models) are built;
- ``first_iteration`` (rank 0): the first training iteration has ended.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ORDER = ("process_start", "mpirl_imported", "mpi_ready", "imports_done", "run_start",
         "ranks_connected", "workers_built", "first_iteration")
"""Every point, in the order a rank passes it."""

STARTUP_FILE = "startup.json"

DEFAULT_TIMEOUT_S = 600.0
"""``startup_timeout_s`` unless the config says: how long a start-up wait lasts (MPI_Init under
ULFM, the MPMD start-up, every rank's arrival) before it ends the job."""

_marks: dict[str, float] = {}


def mark(name: str, at: float | None = None) -> None:
    """Record that this rank reached ``name`` now (or at ``at``, a ``time.time()``); only the
    first time counts, so a second run in the same process does not move it."""
    if name not in ORDER:
        raise ValueError(f"unknown start-up point {name!r}; known: {', '.join(ORDER)}")
    _marks.setdefault(name, time.time() if at is None else at)


def marks() -> dict[str, float]:
    """This rank's points so far (wall-clock seconds since the epoch), process start included
    where ``/proc`` tells it."""
    if "process_start" not in _marks and (started := process_start_time()) is not None:
        _marks["process_start"] = started
    if "mpirl_imported" not in _marks:
        # The package's own clock, read without importing the top layer from the engine.
        _marks["mpirl_imported"] = sys.modules["mpirl"]._IMPORTED_AT
    return {name: _marks[name] for name in ORDER if name in _marks}


def process_start_time() -> float | None:
    """When the kernel started this process (``time.time()`` scale, about 10 ms precision), or
    None where ``/proc`` does not say (not Linux)."""
    try:
        stat = Path(f"/proc/{os.getpid()}/stat").read_text()
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError):
        return None
    # Field 22, after the command name (which may hold spaces) in parentheses.
    started_ticks = int(stat.rsplit(")", 1)[1].split()[19])
    age_s = uptime_s - started_ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - max(age_s, 0.0)


def phases(points: dict[str, float]) -> dict[str, float]:
    """Seconds from each point to the next one reached, named by the later point."""
    names = [name for name in ORDER if name in points]
    return {later: round(points[later] - points[earlier], 3)
            for earlier, later in zip(names, names[1:], strict=False)}


def report(driver_points: dict[str, float], rank_points: list[dict[str, float]],
           env_groups: dict[str, Any] | None = None) -> dict[str, Any]:
    """What ``startup.json`` holds: rank 0's phases, the slowest rank in each phase that every
    rank passes, and the time from the first process start of the job to the first iteration;
    ``env_groups`` (``{groups, k, external}``) when the run has env groups."""
    slowest: dict[str, dict[str, float]] = {}
    for rank, points in enumerate(rank_points):
        for name, seconds in phases(points).items():
            if seconds > slowest.get(name, {"seconds": -1.0})["seconds"]:
                slowest[name] = {"rank": rank, "seconds": seconds}
    starts = [p["process_start"] for p in rank_points if "process_start" in p]
    launched = min(starts) if starts else driver_points.get("process_start")
    out: dict[str, Any] = {"ranks": len(rank_points)}
    if launched is not None and "first_iteration" in driver_points:
        out["launch_to_first_iteration_s"] = round(driver_points["first_iteration"] - launched, 3)
    out["driver_phases_s"] = phases(driver_points)
    out["slowest_rank_phases_s"] = slowest
    out["driver_points"] = driver_points
    if env_groups is not None:
        out["env_groups"] = env_groups
    return out


def write_report(run_dir: Path, driver_points: dict[str, float],
                 rank_points: list[dict[str, float]],
                 env_groups: dict[str, Any] | None = None) -> Path:
    """Write ``startup.json`` into ``run_dir``; return its path."""
    path = Path(run_dir) / STARTUP_FILE
    path.write_text(json.dumps(report(driver_points, rank_points, env_groups), indent=1) + "\n")
    return path
