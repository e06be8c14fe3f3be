"""Which rank does what: the layout of roles over the MPI world.

Rank 0 is always the driver. The other ranks are assigned in this order: rollout workers, replay
shards, learners. Every rank computes the same assignment from the same config, so no message is
needed to agree on it, and a layout that does not fit the world fails on every rank at once.

World size 1 is the embedded local mode: every role with a non-zero count becomes one in-process
object on rank 0, behind the same handles the distributed mode uses.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mpirl.errors import ConfigError, LaunchError, LayoutError

DRIVER = "driver"
ROLLOUT = "rollout"
REPLAY = "replay"
LEARNER = "learner"
#: Worker roles in the order their ranks are assigned after the driver.
WORKER_ROLES = (ROLLOUT, REPLAY, LEARNER)

#: ``num_rollout_workers`` value meaning "every rank that the other roles leave".
AUTO = -1

#: Set to 1 to skip ``check_slurm_step`` (a launcher this check does not know).
SKIP_WORLD_SIZE_CHECK = "MPIRL_SKIP_WORLD_SIZE_CHECK"


def check_slurm_step(world_size: int, environ: Mapping[str, str] = os.environ) -> None:
    """Raise LaunchError, on every task, when srun started this process as one of N tasks but
    the MPI world has another size.

    A ``--mpi`` setting that does not fit the MPI library (pmi2 for Open MPI 5's wheel, say) does
    not fail: every task starts as a world of its own, and N copies of the job would run side by
    side. The check applies only to tasks that srun started itself (``SLURM_STEP_ID`` and
    ``SLURM_STEP_NUM_TASKS`` set). A batch script has no step id, so mpiexec inside an
    allocation is not checked: there ``SLURM_NTASKS`` describes the allocation, not mpiexec's
    ``-n``; nor is Open MPI's mpiexec run inside a step (it sets ``OMPI_COMM_WORLD_SIZE``).
    """
    if environ.get(SKIP_WORLD_SIZE_CHECK, "") not in ("", "0"):
        return
    step_tasks = environ.get("SLURM_STEP_NUM_TASKS", "")
    if "SLURM_STEP_ID" not in environ or not step_tasks.isdigit():
        return
    if "OMPI_COMM_WORLD_SIZE" in environ:
        return
    expected = int(step_tasks)
    if expected == world_size:
        return
    task = environ.get("SLURM_PROCID", "0")
    mpi = environ.get("SLURM_MPI_TYPE")
    started = f"srun{f' --mpi={mpi}' if mpi else ''} started {expected} tasks"
    got = ("each one is an MPI world of its own (a singleton)" if world_size == 1
           else f"MPI's world has {world_size}")
    raise LaunchError(
        f"{started}, but {got}: srun's --mpi does not fit this MPI library. Use srun "
        f"--mpi=pmix for Open MPI 5 or another PMIx-based MPI, --mpi=pmi2 for MPICH (srun "
        f"--mpi=list shows what this Slurm offers), or mpiexec inside the allocation "
        f"(mpirl slurm --launcher). Set {SKIP_WORLD_SIZE_CHECK}=1 to start anyway.",
        speaker=task == "0",
    )


#: Seconds between the exits of a heterogeneous srun step's components (``het_exit_delay``).
HET_EXIT_STAGGER_S = 2.0
#: The first Slurm whose srun keeps one PMIx abort agent for all components of a step.
SLURM_FIXED_HET_ABORT_AGENT = (24, 11)


def het_exit_delay(environ: Mapping[str, str] = os.environ,
                   slurm_version: Callable[[], tuple[int, int] | None] | None = None) -> float:
    """Seconds this task should wait after ``MPI_Finalize`` before it exits: under ``srun
    --mpi=pmix --het-group=...`` of a Slurm before 24.11, its component's index times
    ``HET_EXIT_STAGGER_S``; else 0.

    Such an srun starts a PMIx abort agent per component of a heterogeneous step but keeps one
    handle to them. When two components' tasks end in the same instant (they do: the finalize
    fence releases every rank at once), srun's per-component threads can join the same agent
    thread twice, and srun hangs after all tasks have exited, until the time limit (SchedMD
    ticket 16817). Components that end seconds apart stop the agents one after the other. The
    index comes from ``SLURM_PROCID`` and the components' task counts, because a task is not
    told its component. ``slurm_version``: (major, minor) of the srun on PATH, None if unknown
    (then the wait applies)."""
    if "SLURM_PMIXP_ABORT_AGENT_PORT" not in environ or "SLURM_STEP_ID" not in environ:
        return 0.0
    size, task = environ.get("SLURM_HET_SIZE", ""), environ.get("SLURM_PROCID", "")
    if not (size.isdigit() and task.isdigit()) or int(size) < 2:
        return 0.0
    first_task, component = 0, None
    for index in range(int(size)):
        tasks = environ.get(f"SLURM_NTASKS_HET_GROUP_{index}", "")
        if not tasks.isdigit():
            return 0.0
        first_task += int(tasks)
        if int(task) < first_task:
            component = index
            break
    if not component:
        return 0.0
    version = (slurm_version or srun_version)()
    if version is not None and version >= SLURM_FIXED_HET_ABORT_AGENT:
        return 0.0
    return component * HET_EXIT_STAGGER_S


def srun_version() -> tuple[int, int] | None:
    """(major, minor) of ``srun --version`` ("slurm 22.05.8"), or None if it cannot be read."""
    import shutil
    import subprocess

    srun = shutil.which("srun")
    if srun is None:
        return None
    try:
        out = subprocess.run([srun, "--version"], capture_output=True, text=True, timeout=10,
                             check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"(\d+)\.(\d+)", out)
    return (int(found[1]), int(found[2])) if found else None


@dataclass(frozen=True)
class Layout:
    """The requested number of ranks per role (rank 0, the driver, comes on top)."""

    num_rollout_workers: int = AUTO
    """Rollout ranks. -1 takes every rank left after the driver, replay shards and learners."""
    num_replay_shards: int = 0
    """Ranks each holding one shard of the replay buffer."""
    num_learners: int = 0
    """Learner ranks doing data-parallel SGD. 0 keeps the learner in the driver process."""

    def __post_init__(self) -> None:
        for name in ("num_rollout_workers", "num_replay_shards", "num_learners"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"{name} must be an integer, got {value!r}")
        if self.num_rollout_workers < AUTO:
            raise ConfigError(
                f"num_rollout_workers must be >= 0, or -1 for 'every rank left'; "
                f"got {self.num_rollout_workers}"
            )
        for name in ("num_replay_shards", "num_learners"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")

    def resolve(self, world_size: int) -> Placement:
        """Assign roles to the ranks of a world of ``world_size``; raise LayoutError if it can't."""
        if world_size < 1:
            raise LayoutError(f"world size must be at least 1, got {world_size}")
        if world_size == 1:
            # An automatic rollout count means "one" when there are no other ranks to fill.
            counts = self._counts(auto_value=1)
            local_roles = tuple(
                role for role, count in zip(WORKER_ROLES, counts, strict=True) if count
            )
            folded = tuple((role, count) for role, count in zip(WORKER_ROLES, counts, strict=True)
                           if count > 1)
            return Placement(world_size=1, roles=(DRIVER,), local_roles=local_roles,
                             folded=folded, configured_world_size=1 + sum(counts))
        fixed = self.num_replay_shards + self.num_learners
        if self.num_rollout_workers == AUTO:
            if 1 + fixed > world_size:
                raise LayoutError(
                    f"The layout needs at least {1 + fixed} ranks (1 driver + "
                    f"{self.num_replay_shards} replay + {self.num_learners} learner) but the MPI "
                    f"world has {world_size}. Launch with at least {1 + fixed} ranks "
                    f"(mpiexec -n {1 + fixed} ..., or srun -n {1 + fixed} ...), or lower "
                    f"num_replay_shards / num_learners."
                )
            rollout = world_size - 1 - fixed
        else:
            rollout = self.num_rollout_workers
            needed = 1 + rollout + fixed
            if needed != world_size:
                raise LayoutError(
                    f"The layout needs {needed} ranks (1 driver + {rollout} rollout + "
                    f"{self.num_replay_shards} replay + {self.num_learners} learner) but the MPI "
                    f"world has {world_size}. Launch with mpiexec -n {needed} (or srun -n "
                    f"{needed}), or change the layout so that 1 + num_rollout_workers + "
                    f"num_replay_shards + num_learners = {world_size}; num_rollout_workers=-1 "
                    f"takes every rank left."
                )
        roles = [DRIVER]
        for role, count in zip(
            WORKER_ROLES, (rollout, self.num_replay_shards, self.num_learners), strict=True
        ):
            roles.extend([role] * count)
        # None left is legitimate (the driver samples, as RLlib's num_env_runners 0), but
        # usually a launch one rank short: the placement's note says so.
        return Placement(world_size=world_size, roles=tuple(roles), local_roles=(),
                         no_rollout_rank_left=self.num_rollout_workers == AUTO and rollout == 0)

    def _counts(self, auto_value: int) -> tuple[int, int, int]:
        rollout = auto_value if self.num_rollout_workers == AUTO else self.num_rollout_workers
        return rollout, self.num_replay_shards, self.num_learners


@dataclass(frozen=True)
class Placement:
    """A layout resolved against a world size: the role of every rank.

    ``roles[r]`` is the role of world rank ``r``. In local mode (``world_size == 1``) the worker
    roles live in-process on rank 0 and are listed in ``local_roles``.
    """

    world_size: int
    roles: tuple[str, ...]
    local_roles: tuple[str, ...]
    #: Local mode: each role the layout gives several workers, with that number; it runs as one
    #: in-process worker all the same.
    folded: tuple[tuple[str, int], ...] = ()
    #: Local mode: the world size that would run the layout as configured.
    configured_world_size: int = 1
    #: ``num_rollout_workers`` -1 ("every rank left") found no rank left: the driver samples.
    no_rollout_rank_left: bool = False

    @property
    def local(self) -> bool:
        """True in the embedded local mode (world size 1)."""
        return self.world_size == 1

    def ranks(self, role: str) -> list[int]:
        """World ranks holding ``role``, in order; ``[0]`` for an in-process role in local mode."""
        _check_role(role)
        if self.local:
            return [0] if role == DRIVER or role in self.local_roles else []
        return [rank for rank, r in enumerate(self.roles) if r == role]

    def count(self, role: str) -> int:
        """How many workers hold ``role`` (in-process ones included)."""
        return len(self.ranks(role))

    def role_index(self, rank: int) -> int:
        """Position of ``rank`` among the ranks of its own role."""
        role = self.roles[rank]
        return self.roles[:rank].count(role)

    def summary(self) -> str:
        """One line such as ``driver 1, rollout 4, replay 0, learner 2 (world size 7)``."""
        parts = [f"{role} {self.count(role)}" for role in (DRIVER, *WORKER_ROLES)]
        mode = "local mode, all roles in-process" if self.local else f"world size {self.world_size}"
        return ", ".join(parts) + f" ({mode})"

    def fold_note(self) -> str | None:
        """Local mode's one line on the roles it ran as one worker though the layout asks for
        more (None when it asks for no more): what ran differs from the config."""
        if not self.folded:
            return None
        keys = {ROLLOUT: "num_rollout_workers", REPLAY: "num_replay_shards",
                LEARNER: "num_learners"}
        folded = ", ".join(f"{keys[role]} {count} -> 1" for role, count in self.folded)
        return (f"local mode (world size 1) runs one in-process worker per role: {folded}; "
                f"launch {self.configured_world_size} ranks (mpiexec -n "
                f"{self.configured_world_size}) to run the layout as configured")

    def note(self) -> str | None:
        """The one line to print first when what runs is likely not what was meant: local mode's
        folded roles, or an automatic rollout count that found no rank left (the driver
        samples); None otherwise."""
        if self.folded:
            return self.fold_note()
        if not self.no_rollout_rank_left:
            return None
        needed = self.world_size + 1
        others = " + ".join(f"{self.count(role)} {role}" for role in (REPLAY, LEARNER)
                            if self.count(role))
        return (f"no rank is left for rollout workers (world size {self.world_size} = 1 driver "
                f"+ {others}): the driver samples (rollout 0); launch {needed} ranks (mpiexec "
                f"-n {needed}) for one rollout rank, or set num_rollout_workers 0 if none is "
                f"meant")

    def record(self) -> dict[str, Any]:
        """The layout that ran, as params.json keeps it: the world ranks of each role (in local
        mode an in-process role is on rank 0), the world size, and what local mode folded."""
        record: dict[str, Any] = {
            "summary": self.summary(), "world_size": self.world_size, "local_mode": self.local,
            "ranks": {role: self.ranks(role) for role in (DRIVER, *WORKER_ROLES)},
        }
        if self.folded:
            record["folded"] = {role: count for role, count in self.folded}
        return record


def _check_role(role: str) -> None:
    if role not in (DRIVER, *WORKER_ROLES):
        raise ValueError(f"unknown role {role!r}; roles are {', '.join((DRIVER, *WORKER_ROLES))}")


#: The columns of the start-up table that every run prints (``mpirl.runtime.driver``).
LAYOUT_TABLE_COLUMNS = ("rank", "role", "index", "host", "pid", "device", "rss MB")


def parse_layout_row(line: str) -> dict[str, Any] | None:
    """One data row of the start-up table as ``{"rank", "role", "index", "host", "pid",
    "device", "rss_mb"}``, or None for any other line: how tools that watch a run (tests, the
    soak and recovery benchmarks) find each rank's process."""
    cells = line.split()
    if len(cells) != len(LAYOUT_TABLE_COLUMNS) or not all(
            cells[i].isdigit() for i in (0, 2, 4, 6)):
        return None
    return {"rank": int(cells[0]), "role": cells[1], "index": int(cells[2]), "host": cells[3],
            "pid": int(cells[4]), "device": cells[5], "rss_mb": int(cells[6])}


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Render rows as a plain, aligned text table (it must read well in a Slurm log file)."""
    cells = [list(map(str, header))] + [list(map(str, row)) for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
