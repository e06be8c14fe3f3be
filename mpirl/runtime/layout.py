"""Which rank does what: the layout of roles over the MPI world.

Rank 0 is always the driver. The other ranks are assigned in this order: rollout workers (each
followed by the env ranks of its env groups, when ``ranks_per_env`` gives env instances ranks of
their own), replay shards, learners. Every rank computes the same assignment from the same
config, so no message is needed to agree on it, and a layout that does not fit the world fails
on every rank at once.

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
#: Ranks of env groups: one env instance (a ``mpirl.Simulation``) on ``ranks_per_env`` ranks.
ENV = "env"
REPLAY = "replay"
LEARNER = "learner"
#: Worker roles in the order their ranks are assigned after the driver.
WORKER_ROLES = (ROLLOUT, ENV, REPLAY, LEARNER)

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
class EnvGroup:
    """One env instance on k ranks of its own: env ranks of the run's world (``external``
    False; ``members`` are run ranks) or the ranks of a solver program launched beside the run
    in an MPMD launch (``external`` True; ``members`` are ranks of the solver's side of the
    link). Member 0 is the group's root, the one the rollout rank talks to."""

    index: int
    """0-based over the whole run."""
    rollout_rank: int
    """The run rank whose sampling core drives it (0 when the driver samples)."""
    members: tuple[int, ...]
    external: bool = False

    @property
    def root(self) -> int:
        return self.members[0]

    def describe(self, program: str = "") -> str:
        """``env group 2 (ranks 5-6)``, or ``env group 2 (./solver, solver ranks 4-5)`` for a
        solver program's group (``program``: its name as it introduced itself)."""
        kind = "solver ranks" if self.external else "ranks"
        first, last = self.members[0], self.members[-1]
        span = f"{first}" if first == last else f"{first}-{last}"
        return f"env group {self.index} ({program + ', ' if program else ''}{kind} {span})"


@dataclass(frozen=True)
class Layout:
    """The requested number of ranks per role (rank 0, the driver, comes on top)."""

    num_rollout_workers: int = AUTO
    """Rollout ranks. -1 takes every rank left after the driver, replay shards and learners."""
    num_replay_shards: int = 0
    """Ranks each holding one shard of the replay buffer."""
    num_learners: int = 0
    """Learner ranks doing data-parallel SGD. 0 keeps the learner in the driver process."""
    ranks_per_env: int = 0
    """Ranks of each env instance (an env group); 0 steps the envs inside the rollout process."""
    envs_per_rollout: int = 1
    """Env groups each rollout rank drives (``num_envs_per_worker``); used with ranks_per_env."""

    def __post_init__(self) -> None:
        for name in ("num_rollout_workers", "num_replay_shards", "num_learners",
                     "ranks_per_env", "envs_per_rollout"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"{name} must be an integer, got {value!r}")
        if self.num_rollout_workers < AUTO:
            raise ConfigError(
                f"num_rollout_workers must be >= 0, or -1 for 'every rank left'; "
                f"got {self.num_rollout_workers}"
            )
        for name in ("num_replay_shards", "num_learners", "ranks_per_env"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.envs_per_rollout < 1:
            raise ConfigError(f"num_envs_per_worker must be >= 1, got {self.envs_per_rollout}")

    def resolve(self, world_size: int, solver_ranks: int = 0) -> Placement:
        """Assign roles to the ranks of a world of ``world_size``; raise LayoutError if it can't.

        ``solver_ranks``: the ranks of a solver program launched beside the run (MPMD), outside
        ``world_size``; they form the env groups, k consecutive ranks each, group g driven by
        rollout worker g // num_envs_per_worker. 0: env groups (with ranks_per_env) are env
        ranks of the run's own world, each rollout rank's right after it."""
        if world_size < 1:
            raise LayoutError(f"world size must be at least 1, got {world_size}")
        k = self.ranks_per_env
        if solver_ranks and not k:
            raise LayoutError(
                f"the MPMD job has {solver_ranks} solver ranks, but ranks_per_env is 0; set "
                f"ranks_per_env to the ranks of one solver instance (an env group)")
        if world_size == 1:
            return self._resolve_local(solver_ranks)
        fixed = self.num_replay_shards + self.num_learners
        in_world = k > 0 and not solver_ranks
        per_rollout = 1 + self.envs_per_rollout * k if in_world else 1
        if in_world and self.num_rollout_workers == 0:
            raise LayoutError(
                f"ranks_per_env {k} needs rollout ranks to drive its env groups; set "
                f"num_rollout_workers to -1 or at least 1, or ranks_per_env 0")
        if self.num_rollout_workers == AUTO:
            if 1 + fixed > world_size:
                raise LayoutError(
                    f"The layout needs at least {1 + fixed} ranks (1 driver + "
                    f"{self.num_replay_shards} replay + {self.num_learners} learner) but the MPI "
                    f"world has {world_size}. Launch with at least {1 + fixed} ranks "
                    f"(mpiexec -n {1 + fixed} ..., or srun -n {1 + fixed} ...), or lower "
                    f"num_replay_shards / num_learners."
                )
            rest = world_size - 1 - fixed
            if in_world and (rest % per_rollout or rest == 0):
                raise LayoutError(self._env_fit_message(world_size, None))
            rollout = rest // per_rollout
        else:
            rollout = self.num_rollout_workers
            needed = 1 + rollout * per_rollout + fixed
            if needed != world_size:
                if in_world:
                    raise LayoutError(self._env_fit_message(world_size, rollout))
                raise LayoutError(
                    f"The layout needs {needed} ranks (1 driver + {rollout} rollout + "
                    f"{self.num_replay_shards} replay + {self.num_learners} learner) but the MPI "
                    f"world has {world_size}. Launch with mpiexec -n {needed} (or srun -n "
                    f"{needed}), or change the layout so that 1 + num_rollout_workers + "
                    f"num_replay_shards + num_learners = {world_size}; num_rollout_workers=-1 "
                    f"takes every rank left."
                )
        roles = [DRIVER]
        groups: list[EnvGroup] = []
        for _ in range(rollout):
            rollout_rank = len(roles)
            roles.append(ROLLOUT)
            if in_world:
                for _j in range(self.envs_per_rollout):
                    first = len(roles)
                    groups.append(EnvGroup(len(groups), rollout_rank,
                                           tuple(range(first, first + k))))
                    roles.extend([ENV] * k)
        roles.extend([REPLAY] * self.num_replay_shards)
        roles.extend([LEARNER] * self.num_learners)
        if solver_ranks:
            groups = self._external_groups(solver_ranks, [r for r, role in enumerate(roles)
                                                          if role == ROLLOUT] or [0])
        # None left is legitimate (the driver samples, as RLlib's num_env_runners 0), but
        # usually a launch one rank short: the placement's note says so.
        return Placement(world_size=world_size, roles=tuple(roles), local_roles=(),
                         no_rollout_rank_left=self.num_rollout_workers == AUTO and rollout == 0,
                         env_groups=tuple(groups), ranks_per_env=k, solver_ranks=solver_ranks)

    def _resolve_local(self, solver_ranks: int) -> Placement:
        # An automatic rollout count means "one" when there are no other ranks to fill.
        counts = self._counts(auto_value=1)
        local_roles = tuple(
            role for role, count in zip(_COUNTED_ROLES, counts, strict=True) if count
        )
        folded = tuple((role, count) for role, count in zip(_COUNTED_ROLES, counts, strict=True)
                       if count > 1)
        groups: tuple[EnvGroup, ...] = ()
        folded_k = 0
        if solver_ranks:
            groups = tuple(self._external_groups(solver_ranks, [0] * max(1, counts[0])))
        elif self.ranks_per_env:
            folded_k = self.ranks_per_env
        configured = 1 + counts[0] * (1 + self.envs_per_rollout * folded_k) + sum(counts[1:])
        return Placement(world_size=1, roles=(DRIVER,), local_roles=local_roles,
                         folded=folded, configured_world_size=configured, env_groups=groups,
                         ranks_per_env=self.ranks_per_env, solver_ranks=solver_ranks,
                         folded_ranks_per_env=folded_k)

    def _external_groups(self, solver_ranks: int, rollout_ranks: list[int]) -> list[EnvGroup]:
        k, envs = self.ranks_per_env, self.envs_per_rollout
        needed = len(rollout_ranks) * envs * k
        if solver_ranks != needed:
            raise LayoutError(
                f"the MPMD job has {solver_ranks} solver ranks; {len(rollout_ranks)} rollout x "
                f"{envs} envs (num_envs_per_worker) x ranks_per_env {k} need {needed}. Launch "
                f"the solver with -n {needed} after ':', or change num_rollout_workers / "
                f"num_envs_per_worker / ranks_per_env.")
        return [EnvGroup(g, rollout_ranks[g // envs], tuple(range(g * k, (g + 1) * k)), True)
                for g in range(needed // k)]

    def _env_fit_message(self, world_size: int, rollout: int | None) -> str:
        """The one line for a world that env groups do not fit: the sizes that would."""
        k, envs = self.ranks_per_env, self.envs_per_rollout
        fixed = self.num_replay_shards + self.num_learners
        per = 1 + envs * k
        formula = (f"1 + R x (1 + {envs} x {k}) + {self.num_replay_shards} replay + "
                   f"{self.num_learners} learner ranks")
        head = f"ranks_per_env {k} with num_envs_per_worker {envs} needs {formula}"
        if rollout is not None:
            needed = 1 + rollout * per + fixed
            return (f"{head}: {needed} for {rollout} rollout ranks (num_rollout_workers); the "
                    f"MPI world has {world_size}. Launch with mpiexec -n {needed}, or change "
                    f"num_rollout_workers (-1 fits R to the world) / ranks_per_env / "
                    f"num_envs_per_worker.")
        sizes = [1 + r * per + fixed for r in range(1, 4)]
        below = max(1, (world_size - 1 - fixed) // per)
        suggest = sorted({1 + below * per + fixed, 1 + (below + 1) * per + fixed})
        return (f"{head}: {sizes[0]}, {sizes[1]} or {sizes[2]} for 1, 2 or 3 rollout ranks; the "
                f"MPI world has {world_size}. Launch with mpiexec -n {suggest[0]} (or "
                f"{suggest[-1]}), or change ranks_per_env / num_envs_per_worker.")

    def _counts(self, auto_value: int) -> tuple[int, int, int]:
        rollout = auto_value if self.num_rollout_workers == AUTO else self.num_rollout_workers
        return rollout, self.num_replay_shards, self.num_learners


#: The roles whose counts the layout gives directly (env ranks follow from ranks_per_env).
_COUNTED_ROLES = (ROLLOUT, REPLAY, LEARNER)


@dataclass(frozen=True)
class Placement:
    """A layout resolved against a world size: the role of every rank.

    ``roles[r]`` is the role of world rank ``r``. In local mode (``world_size == 1``) the worker
    roles live in-process on rank 0 and are listed in ``local_roles``. ``env_groups``: the env
    instances with ranks of their own, in-world (env ranks) or external (a solver program's).
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
    env_groups: tuple[EnvGroup, ...] = ()
    #: k, as configured (0: envs in the rollout process)
    ranks_per_env: int = 0
    #: ranks of a solver program beside the run (MPMD), outside ``world_size``
    solver_ranks: int = 0
    #: Local mode: the ranks_per_env that ran as in-process envs (k = 1) instead
    folded_ranks_per_env: int = 0

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

    def groups_of(self, rollout_rank: int) -> tuple[EnvGroup, ...]:
        """The env groups the sampling core on ``rollout_rank`` drives, in order."""
        return tuple(g for g in self.env_groups if g.rollout_rank == rollout_rank)

    def group_of(self, rank: int) -> EnvGroup | None:
        """The in-world env group that run rank ``rank`` is a member of, else None."""
        for group in self.env_groups:
            if not group.external and rank in group.members:
                return group
        return None

    def _shown_roles(self) -> tuple[str, ...]:
        """Roles the summary and record name: env only where there are env ranks."""
        return tuple(r for r in (DRIVER, *WORKER_ROLES) if r != ENV or self.count(ENV))

    def summary(self) -> str:
        """One line such as ``driver 1, rollout 4, replay 0, learner 2 (world size 7)``, or
        ``driver 1, rollout 2, env 16 (8 groups x 2), replay 0, learner 0 (world size 19)``."""
        parts = []
        for role in self._shown_roles():
            part = f"{role} {self.count(role)}"
            if role == ENV:
                part += f" ({self._groups_x_k()})"
            parts.append(part)
        if self.solver_ranks:
            parts.append(f"solver {self.solver_ranks} ({self._groups_x_k()})")
        mode = "local mode, all roles in-process" if self.local else f"world size {self.world_size}"
        if self.solver_ranks:
            mode += f" + {self.solver_ranks} solver ranks"
        return ", ".join(parts) + f" ({mode})"

    def _groups_x_k(self) -> str:
        n = len(self.env_groups)
        return f"{n} group{'s' if n != 1 else ''} x {self.ranks_per_env}"

    def fold_note(self) -> str | None:
        """Local mode's one line on the roles it ran as one worker though the layout asks for
        more (None when it asks for no more): what ran differs from the config."""
        if not self.folded and not self.folded_ranks_per_env:
            return None
        keys = {ROLLOUT: "num_rollout_workers", REPLAY: "num_replay_shards",
                LEARNER: "num_learners"}
        folded = [f"{keys[role]} {count} -> 1" for role, count in self.folded]
        if self.folded_ranks_per_env:
            folded.append(f"ranks_per_env {self.folded_ranks_per_env} -> envs in-process (k=1)")
        return (f"local mode (world size 1) runs one in-process worker per role: "
                f"{', '.join(folded)}; launch {self.configured_world_size} ranks (mpiexec -n "
                f"{self.configured_world_size}) to run the layout as configured")

    def note(self) -> str | None:
        """The one line to print first when what runs is likely not what was meant: local mode's
        folded roles, or an automatic rollout count that found no rank left (the driver
        samples); None otherwise."""
        if self.folded or self.folded_ranks_per_env:
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

    def env_group_rows(self, hosts: Mapping[int, str] | Sequence[str] | None = None,
                       solvers: Sequence[Any] = ()) -> list[tuple]:
        """The rows of the start-up ``env groups`` table: group, rollout rank, its ranks (run
        ranks, or ``solver a-b``), their hosts (in-world, when ``hosts`` by rank is given;
        external, from ``solvers``, ``apps.SolverProcess`` in rank order)."""
        rows = []
        for group in self.env_groups:
            span = (f"{group.members[0]}-{group.members[-1]}" if len(group.members) > 1
                    else str(group.members[0]))
            where = "-"
            if hosts is not None and not group.external:
                where = ",".join(sorted({hosts[r] for r in group.members}))
            elif group.external and solvers:
                where = ",".join(sorted({solvers[r].host for r in group.members
                                         if r < len(solvers)}))
            rows.append((group.index, group.rollout_rank,
                         f"solver {span}" if group.external else span, where))
        return rows

    def record(self, hosts: Mapping[int, str] | Sequence[str] | None = None,
               solvers: Sequence[Any] = ()) -> dict[str, Any]:
        """The layout that ran, as params.json keeps it: the world ranks of each role (in local
        mode an in-process role is on rank 0), the world size, and what local mode folded;
        with env groups, ``ranks_per_env`` and each group (``hosts``: each rank's host;
        ``solvers``: a solver program's processes, ``apps.SolverProcess`` in rank order, whose
        world ranks, hosts, pids and program an external group records)."""
        record: dict[str, Any] = {
            "summary": self.summary(), "world_size": self.world_size, "local_mode": self.local,
            "ranks": {role: self.ranks(role) for role in self._shown_roles()},
        }
        if self.folded:
            record["folded"] = {role: count for role, count in self.folded}
        if self.ranks_per_env:
            record["ranks_per_env"] = self.ranks_per_env
            record["env_groups"] = [
                {"group": g.index, "rollout_rank": g.rollout_rank, "ranks": list(g.members),
                 "external": g.external,
                 **({"hosts": [hosts[r] for r in g.members]}
                    if hosts is not None and not g.external else {}),
                 **(_solver_record(g, solvers) if g.external and solvers else {})}
                for g in self.env_groups]
            if self.solver_ranks:
                record["solver_ranks"] = self.solver_ranks
        return record


def _solver_record(group: EnvGroup, solvers: Sequence[Any]) -> dict[str, Any]:
    members = [solvers[r] for r in group.members if r < len(solvers)]
    return {"world_ranks": [p.world_rank for p in members], "hosts": [p.host for p in members],
            "pids": [p.pid for p in members],
            "program": members[0].program if members else ""}


#: The columns of the start-up ``env groups`` table.
ENV_GROUP_TABLE_COLUMNS = ("group", "rollout", "ranks", "hosts")
#: The columns of the start-up ``solver ranks`` table (an MPMD launch with a solver program).
SOLVER_TABLE_COLUMNS = ("world", "group", "member", "host", "pid", "program")


def solver_rows(placement: Placement, solvers: Sequence[Any]) -> list[tuple]:
    """The rows of the ``solver ranks`` table: each solver process (``apps.SolverProcess``, in
    the solver program's rank order) with its world rank, env group and member in it."""
    k = max(1, placement.ranks_per_env)
    return [(p.world_rank, i // k, i % k, p.host, p.pid, p.program)
            for i, p in enumerate(solvers)]


def parse_solver_row(line: str) -> dict[str, Any] | None:
    """One data row of the start-up ``solver ranks`` table as ``{"world", "group", "member",
    "host", "pid", "program"}``, or None for any other line: how tests find a solver's pids."""
    cells = line.split(maxsplit=len(SOLVER_TABLE_COLUMNS) - 1)
    if len(cells) != len(SOLVER_TABLE_COLUMNS) or not all(
            cells[i].isdigit() for i in (0, 1, 2, 4)):
        return None
    return {"world": int(cells[0]), "group": int(cells[1]), "member": int(cells[2]),
            "host": cells[3], "pid": int(cells[4]), "program": cells[5]}


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
