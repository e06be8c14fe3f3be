"""Start-up, the driver, and shutdown: one program on every rank.

``run(main, layout)`` is called by every rank. Rank 0 runs ``main(driver)``; every other rank
serves the tasks the driver sends until the driver shuts the job down. All ranks return the same
exit code::

    def main(driver):
        echoes = driver.spawn("rollout", Echo)          # one Echo on every rollout rank
        print(echoes.call("ping"))
        return 0

    sys.exit(mpirl.run(main, Layout(num_rollout_workers=-1)))

With ``mpiexec -n 1`` or no launcher at all (world size 1) every role is in-process and the same
``main`` runs unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
import pickle
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from mpirl.errors import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_RANK_LOST,
    ConfigError,
    MpirlError,
    RankLost,
    SimulationStuck,
)
from mpirl.runtime import apps, sim_link, startup
from mpirl.runtime import signals as stop_signals
from mpirl.runtime.core import RankContext, Worker
from mpirl.runtime.dispatch import HOST, SIGNAL, Dispatcher, WorkerGroup, WorkerHandle
from mpirl.runtime.heartbeat import (
    SETUP,
    Heartbeat,
    abort_this_rank,
    require_thread_multiple,
)
from mpirl.runtime.host import WorkerHost
from mpirl.runtime.layout import (
    DRIVER,
    ENV,
    ENV_GROUP_TABLE_COLUMNS,
    LAYOUT_TABLE_COLUMNS,
    LEARNER,
    ROLLOUT,
    SOLVER_TABLE_COLUMNS,
    WORKER_ROLES,
    Layout,
    Placement,
    check_slurm_step,
    format_table,
    solver_rows,
)
from mpirl.runtime.memory import MIB, rss_bytes
from mpirl.runtime.transport import Channel
from mpirl.runtime.ulfm import failed_world_ranks, fault_tolerant, is_process_failure
from mpirl.runtime.waiting import DRIVER_CPU, Backoff, reduce_timer_slack
from mpirl.runtime.world import nested, run_comm, running_on

#: The values of the learner_device key.
LEARNER_DEVICES = ("auto", "cpu")
MEMORY_REPORT_S = 5.0
"""How often ``Driver.memory_report`` reads the memory anew. Memory changes slowly, and a
report of 64 ranks took about 0.28 ms of rank 0's CPU per iteration here (cold caches): 7% of
all its driving of PPO."""


@dataclass(frozen=True)
class RuntimeSettings:
    """How the runtime waits, bounds and watches. Every field is a config key of the same name."""

    max_calls_in_flight: int = 16
    """Unanswered calls allowed per worker rank; one more waits for a slot."""
    task_timeout_s: float = 3600.0
    """Longest wait for any single answer when the caller gives no timeout, and for the other
    members of the weight broadcast."""
    stuck_task_timeout_s: float = 300.0
    """A worker rank whose main thread has used no CPU for this long while in a task (or in
    start-up) is stuck: the job ends naming the rank and the task (exit code 70), within this
    plus heartbeat_interval_s. Any CPU use counts as progress, so long computations are safe."""
    startup_timeout_s: float = startup.DEFAULT_TIMEOUT_S
    """Longest wait at start-up for every rank to arrive; a rank that does not is named and the
    job ends (exit code 70). Under ULFM also the longest wait in MPI_Init, where a rank lost
    while the job starts would leave the others for ever."""
    heartbeat_interval_s: float = 1.0
    """Seconds between heartbeats."""
    heartbeat_timeout_s: float = 20.0
    """A rank silent this long is declared lost and the job ends (exit code 70)."""
    shutdown_timeout_s: float = 30.0
    """How long the driver waits for workers to acknowledge shutdown before aborting the job."""
    poll_max_sleep_s: float = 1e-3
    """Longest sleep between polls of an idle rank (bounds idle wake-ups and added latency)
    during the first ``poll_max_sleep_s / poll_sleep_share`` seconds of a wait."""
    poll_sleep_share: float = 1 / 64
    """After that, a wait of t seconds sleeps up to ``t * poll_sleep_share`` between polls (at
    most 16 ms), so that it ends at most that share late and wakes the rank less often: each
    wake-up costs 10-20 us of CPU. 0 keeps every sleep at ``poll_max_sleep_s``."""
    print_layout: bool = True
    """Print the rank/role table once at start-up (rank 0 only)."""
    learner_device: str = "auto"
    """Where learner ranks train: auto (a GPU where CUDA is there, else the CPU) or cpu. A GPU
    pays for image models; on the H200 it trained CartPole's MLP at 0.6-0.8x the speed of 16
    CPU cores and Atari's CNN at 6-8x (benchmarks/RESULTS.md)."""
    survive_rollout_loss: bool = True
    """Go on without a rollout rank that died instead of ending the job. Only where MPI reports
    process failures (Open MPI's ``mpiexec --with-ft ulfm``); the loss of any other rank, or any
    loss without that, still ends the job (exit code 70)."""

    def __post_init__(self) -> None:
        if self.learner_device not in LEARNER_DEVICES:
            raise ConfigError(f'config key "learner_device" must be one of '
                              f"{', '.join(LEARNER_DEVICES)}, got {self.learner_device!r}")
        # Checked here, on every rank before MPI traffic, not first by the heartbeat thread.
        for key in ("heartbeat_timeout_s", "stuck_task_timeout_s"):
            if not getattr(self, key) > self.heartbeat_interval_s:
                raise ConfigError(
                    f'config key "{key}" = {getattr(self, key):g} is out of range: must be '
                    f"greater than heartbeat_interval_s ({self.heartbeat_interval_s:g})")


class Driver:
    """Rank 0's handle on the job: creates worker groups and reaches their ranks.

    Only rank 0 has a Driver. In local mode it creates workers in-process.
    """

    def __init__(self, placement: Placement, context: RankContext, settings: RuntimeSettings,
                 dispatcher: Dispatcher | None, contexts: dict[str, RankContext] | None = None,
                 hosts: list[dict] | None = None, heartbeat: Heartbeat | None = None) -> None:
        self.placement = placement
        self.heartbeat = heartbeat
        self.context = context
        self.settings = settings
        self.dispatcher = dispatcher
        self.hosts = hosts or []
        self._local_contexts = contexts or {}
        self._object_ids = itertools.count(HOST + 1)
        self._stop_request: str | None = None
        #: The signal behind ``stop_requested`` (None until one came): its exit code differs.
        self.stop_signal: int | None = None
        #: What start-up printed (the layout table): a run's output.log begins with it.
        self.layout_report = ""
        self._perf_mark = self._perf_counters()
        self._memory: dict[str, float] = {}  # the last memory report, and when it was made
        self._memory_at = -math.inf
        self._ended_groups = False
        #: An env group did not answer in time (``SimulationStuck``): its ranks take no stop.
        self.groups_stuck = False

    def stop_requested(self) -> str | None:
        """Whether a stop signal reached any rank: e.g. ``"SIGUSR2 on rank 3 (rollout 1)"``, or
        None. Cheap enough to call every iteration (one probe)."""
        if self._stop_request is None:
            signum, rank = stop_signals.received(), 0
            if signum is None and self.dispatcher is not None:
                item = self.dispatcher.poll_any(SIGNAL)
                if item is not None:
                    signum, rank = item
            if signum is not None:
                role = self.placement.roles[rank]
                where = f"rank {rank} ({role} {self.placement.role_index(rank)})"
                self._stop_request = f"{stop_signals.signal_name(signum)} on {where}"
                self.stop_signal = signum
        return self._stop_request

    @property
    def local(self) -> bool:
        return self.placement.local

    def memory_report(self) -> dict[str, float]:
        """Resident memory in MiB: ``perf/driver_rss_mb`` (rank 0) and, when there are worker
        ranks, ``perf/max_worker_rss_mb`` and ``perf/max_<role>_rss_mb`` for each role with
        ranks: the largest of their latest heartbeats (a rank not heard from yet is left out).
        Made afresh at most every ``MEMORY_REPORT_S`` seconds, or while a role is not heard
        from yet; the same numbers in between."""
        now = time.monotonic()
        if now - self._memory_at < MEMORY_REPORT_S and not any(
                math.isnan(value) for value in self._memory.values()):
            return dict(self._memory)
        self._memory = self._measure_memory()
        self._memory_at = now
        return dict(self._memory)

    def _measure_memory(self) -> dict[str, float]:
        report = {"perf/driver_rss_mb": round(rss_bytes() / MIB, 1)}
        if self.heartbeat is None:
            return report
        by_role: dict[str, float] = {}
        for rank, rss in self.heartbeat.peer_rss_bytes().items():
            role = self.placement.roles[rank]
            by_role[role] = max(by_role.get(role, 0.0), round(rss / MIB, 1))
        # The same keys every iteration (NaN until a rank is heard from): progress.csv gets
        # its columns from its first row, and a later one costs a rewrite of the file.
        report["perf/max_worker_rss_mb"] = max(by_role.values(), default=math.nan)
        for role in WORKER_ROLES:
            if self.placement.count(role):
                report[f"perf/max_{role}_rss_mb"] = by_role.get(role, math.nan)
        return report

    def _perf_counters(self) -> tuple[float, ...]:
        """Rank 0's CPU seconds so far (all its threads, a learner hosted here included); the
        driving thread's, and of that its idle polls and hosted workers' methods; and the
        messages and bytes it has sent and received on its channels."""
        channels = [c for c in (self.dispatcher.channel if self.dispatcher else None,
                                self.context.data_channel) if c is not None]
        return (time.process_time(), time.thread_time(), DRIVER_CPU.idle_s, DRIVER_CPU.hosted_s,
                sum(c.messages_sent + c.messages_received for c in channels),
                sum(c.bytes_sent + c.bytes_received for c in channels))

    def perf_report(self) -> dict[str, float]:
        """Rank 0's cost since the last call (one training iteration), from the thread that
        drives: ``perf/driver_cpu_ms_per_iter`` (the whole process: every thread, a learner
        hosted here included), split into ``perf/driver_hosted_cpu_ms_per_iter`` (the methods
        of worker objects in rank 0's process), ``perf/driver_idle_cpu_ms_per_iter`` (polls that
        found nothing), ``perf/driver_own_cpu_ms_per_iter`` (the rest of the driving thread:
        dispatching calls, taking answers, merging metrics, logging) and
        ``perf/driver_threads_cpu_ms_per_iter`` (other threads: heartbeat, writers);
        ``perf/driver_msgs_per_iter`` and ``perf/driver_bytes_per_iter``, sent and received
        together."""
        now = self._perf_counters()
        before, self._perf_mark = self._perf_mark, now
        process, thread, idle, hosted, msgs, nbytes = (a - b for a, b in zip(now, before,
                                                                               strict=True))
        ms = 1e3
        return {"perf/driver_cpu_ms_per_iter": round(process * ms, 3),
                "perf/driver_hosted_cpu_ms_per_iter": round(hosted * ms, 3),
                "perf/driver_idle_cpu_ms_per_iter": round(idle * ms, 3),
                "perf/driver_own_cpu_ms_per_iter": round(max(0.0, thread - idle - hosted) * ms, 3),
                "perf/driver_threads_cpu_ms_per_iter": round(max(0.0, process - thread) * ms, 3),
                "perf/driver_msgs_per_iter": msgs,
                "perf/driver_bytes_per_iter": nbytes}

    def spawn(self, role: str, cls: type[Worker], *args: Any, local_if_empty: bool = False,
              members: list[int] | None = None, beside: WorkerGroup | None = None,
              **kwargs: Any) -> WorkerGroup:
        """Create ``cls(context, *args, **kwargs)`` on every rank of ``role``; wait until all exist.

        Raises ``RemoteError`` naming the rank if a constructor raises there. An empty role gives an
        empty group, or with ``local_if_empty`` one object in the driver's process (a learner
        when ``num_learners`` is 0, say). ``members`` picks some ranks of the role by index
        (a multi-agent policy's learners); the group's handles are indexed within them.
        ``beside`` (a group of this role) puts each new object on the rank of that group's
        worker of the same index and gives the constructor that worker's object (``beside=``):
        workers that share a rank's sampling core. Their handles say so (``shares_rank``).
        """
        if role not in WORKER_ROLES:
            raise ValueError(f"workers are spawned on {', '.join(WORKER_ROLES)}; got {role!r}")
        if not (isinstance(cls, type) and issubclass(cls, Worker)):
            raise TypeError(f"spawn needs a subclass of mpirl.Worker, got {cls!r}")
        object_id = next(self._object_ids)
        ranks = self.placement.ranks(role)
        if members is not None and ranks:
            ranks = [ranks[i] for i in members]
        if beside is not None:
            ranks = [] if all(h.in_process for h in beside) else beside.ranks
        if self.dispatcher is None or (local_if_empty and not ranks):
            if not ranks and not local_if_empty:
                return WorkerGroup(role, cls, [])
            context = self._local_contexts.get(role) or dataclasses.replace(self.context, role=role)
            if beside is not None:
                kwargs = {**kwargs, "beside": beside[0].local_object}
            obj = cls(context, *args, **kwargs)
            handle = WorkerHandle(None, 0, role, 0, object_id, cls, obj)
            handle.shares_rank = beside is not None
            return WorkerGroup(role, cls, [handle])
        shared = None if beside is None else beside[0].object_id
        futures = [
            self.dispatcher.submit(rank, HOST, "spawn", (object_id, cls, args, kwargs, shared), {})
            for rank in ranks
        ]
        errors = []
        for future in futures:
            try:
                future.result()
            except MpirlError as error:
                errors.append(error)
        if errors:
            # No half-built groups: drop the objects that were created before reporting.
            for future in futures:
                if future._ok:
                    self.dispatcher.submit(future.rank, HOST, "drop", (object_id,), {}).result()
            raise errors[0]
        handles = [
            WorkerHandle(self.dispatcher, rank, role, index, object_id, cls)
            for index, rank in enumerate(ranks)
        ]
        for handle in handles:
            handle.shares_rank = beside is not None
        return WorkerGroup(role, cls, handles)

    def _end_env_groups(self, exit_code: int) -> None:
        """END on the link to every member of every env group, so that the long ``serve``
        calls of env ranks return before the stop and a solver program's ranks leave their
        loop (sent once; a member takes it whenever it waits, and an END its rollout rank sent
        already does not hurt). External groups' members are the link's remote ranks."""
        link = self.context.sim_link
        if link is None or self._ended_groups:
            return
        self._ended_groups = True
        if self.placement.env_groups[0].external:
            # One sender of END to a solver program, whoever ends first: the run here, or
            # mpirl.cli on any exit (apps.end_solvers sends it once per process).
            apps.end_solvers(exit_code)
            return
        message = np.array([sim_link.END, exit_code], np.int64)
        lost = self.dispatcher.lost if self.dispatcher is not None else ()
        members = [r for g in self.placement.env_groups for r in g.members
                   if g.external or r not in lost]
        requests = [link.Isend([message, MPI.INT64_T], r, sim_link.TAG_END) for r in members]
        deadline = time.monotonic() + self.settings.shutdown_timeout_s
        backoff = Backoff(max_sleep_s=self.settings.poll_max_sleep_s)
        while not MPI.Request.Testall(requests) and time.monotonic() < deadline:
            backoff.sleep()

    def _shutdown(self, exit_code: int, heartbeat: Heartbeat | None) -> bool:
        """Tell every worker rank to stop with ``exit_code``; True if all acknowledged in time."""
        self._end_env_groups(exit_code)
        if self.dispatcher is None:
            return True
        try:
            # Standing calls end before the stop that would end them; a run that failed may
            # fail here too, and then its ranks are ended the hard way.
            self.dispatcher.release_all()
        except Exception:  # noqa: BLE001 - the run's own error has been reported
            return False
        workers = [r for r in range(1, self.placement.world_size) if r not in self.dispatcher.lost]
        futures = [self.dispatcher.submit(rank, HOST, "stop", (exit_code,), {}) for rank in workers]
        try:
            for future in futures:
                try:
                    future.result(timeout=self.settings.shutdown_timeout_s)
                except RankLost:
                    pass  # a rollout rank lost (and survived) while shutting down
                if heartbeat is not None:
                    heartbeat.forget(future.rank)
        except MpirlError:
            return False
        return self.dispatcher.channel.flush(timeout=self.settings.shutdown_timeout_s)


def run(main: Callable[[Driver], int | None], layout: Layout,
        settings: RuntimeSettings | None = None, stop_signals_enabled: bool = False,
        comm: MPI.Comm | None = None) -> int:
    """Run ``main`` on rank 0 and serve workers on every other rank; return the job's exit code.

    Call it on every rank. Raises ``LayoutError`` on every rank, before any communication, when
    the world size does not fit ``layout``, or (``LaunchError``) when srun started more tasks
    than the MPI world holds. If ``main`` raises, the error is printed on rank 0 and
    every rank returns a non-zero code (the error's ``exit_code`` for an ``MpirlError``).

    With ``stop_signals_enabled``, SIGUSR1/SIGUSR2/SIGTERM and SIGINT on any rank no longer end
    the process; ``main`` must poll ``driver.stop_requested()`` and end the run itself.

    ``comm`` is the run's world: its rank 0 is the driver and the layout is resolved against
    its size (default: the current run communicator of ``mpirl.runtime.world``, which is
    ``MPI.COMM_WORLD`` unless a caller set another). Call it on every rank of ``comm``. A run
    on a sub-communicator is nested: the same processes may run again on it (or on another one)
    once this returns, and the communicators the run made are freed. A rank lost in a nested
    run still ends the whole MPI job (``MPI_Abort`` on the run's communicator kills every
    process of the job in Open MPI).
    """
    startup.mark("run_start")
    settings = settings or RuntimeSettings()
    # Whether srun's tasks form one MPI world is a question about COMM_WORLD, nested or not.
    check_slurm_step(MPI.COMM_WORLD.Get_size())
    with running_on(comm) as world:
        # An MPMD launch's solver processes are env groups of the run on the whole world (a
        # run nested on a sub-communicator, a tune trial, has none of them).
        placement = layout.resolve(world.Get_size(),
                                   solver_ranks=apps.solver_ranks() if comm is None else 0)
        if not placement.local:
            require_thread_multiple()
        if stop_signals_enabled:
            stop_signals.install()
        try:
            if placement.local:
                return _run_local(main, placement, settings)
            return _run_distributed(main, placement, settings, world)
        finally:
            if stop_signals_enabled:
                stop_signals.settle()


def run_prepared(prepare: Callable[[], tuple[Callable[[Driver], int | None], Layout,
                                             RuntimeSettings]],
                 stop_signals_enabled: bool = False) -> int:
    """``run`` for a command whose set-up only rank 0 needs (``mpirl train``): rank 0 calls
    ``prepare()``, which returns ``(main, layout, settings)`` or raises; the layout and settings
    reach the other ranks (``prepared_on_rank0``), which never call ``prepare`` nor import what it
    imports (torch, on ranks that only sample in NumPy). An ``MpirlError`` from ``prepare`` is
    raised on rank 0 alone, to be reported once; the other ranks return its exit code.
    """
    world = run_comm()
    if world.Get_size() == 1:
        return run(*prepare(), stop_signals_enabled=stop_signals_enabled)
    try:
        main, layout, settings = prepared_on_rank0(prepare)
    except MpirlError as error:
        if world.Get_rank() == 0:
            raise
        return error.exit_code
    return run(main if world.Get_rank() == 0 else _serve_only, layout, settings,
               stop_signals_enabled=stop_signals_enabled)


def prepared_on_rank0(prepare: Callable[[], tuple[Any, Layout, RuntimeSettings]]
                      ) -> tuple[Any, Layout, RuntimeSettings]:
    """Rank 0 of the run's world calls ``prepare()``, which returns ``(value, layout,
    settings)``; every rank gets the layout and settings, rank 0 alone the value (the others
    None). An error of ``prepare`` is raised on every rank: on rank 0 as it was; on the others
    a copy of an ``MpirlError`` (a ``ConfigError`` stays one), else an ``MpirlError`` with its
    exit code.

    The other ranks wait for rank 0 in ``_all_arrive``, polling with back-off, for at most twice
    the default ``startup_timeout_s``; past that they end the job (exit code 70), not hang.
    """
    world = run_comm()
    if world.Get_size() == 1:
        return prepare()
    rank = world.Get_rank()
    failure: BaseException | None = None
    verdict: tuple[Any, ...] | None = None
    value = None
    if rank == 0:
        try:
            value, layout, settings = prepare()
            verdict = ("ok", layout, settings)
        except BaseException as error:  # noqa: BLE001 - every rank must hear of any failure
            failure = error
            verdict = ("failed", getattr(error, "exit_code", EXIT_FAILURE),
                       _pickled_error(error))
    _all_arrive(world, "the preparation of the run", RuntimeSettings.startup_timeout_s,
                lambda r: f"rank {r}")
    verdict = world.bcast(verdict, root=0)
    if failure is not None:
        raise failure
    if verdict[0] == "failed":
        raise _unpickled_error(verdict[2], int(verdict[1]))
    return value, verdict[1], verdict[2]


def _pickled_error(error: BaseException) -> bytes | None:
    if not isinstance(error, MpirlError):
        return None
    try:
        return pickle.dumps(error)
    except Exception:  # noqa: BLE001 - the exit code alone then reaches the other ranks
        return None


def _unpickled_error(data: bytes | None, exit_code: int) -> MpirlError:
    try:
        error = pickle.loads(data) if data is not None else None
    except Exception:  # noqa: BLE001 - a class whose arguments do not round-trip
        error = None
    if isinstance(error, MpirlError):
        return error
    error = MpirlError(f"rank 0 could not prepare the run (exit code {exit_code}); it printed "
                       f"why")
    error.exit_code = exit_code
    return error


def _serve_only(driver: Driver) -> int:
    raise AssertionError("only rank 0 runs main")


def _run_local(main: Callable[[Driver], int | None], placement: Placement,
               settings: RuntimeSettings) -> int:
    host = node_name()
    contexts = {
        role: RankContext(0, role, 0, 1, placement, None, MPI.COMM_SELF, None, host,
                          pick_device(role, 0, settings.learner_device),
                          settings.task_timeout_s, sim_link=_external_link(placement))
        for role in (DRIVER, *placement.local_roles)
    }
    driver = Driver(placement, contexts[DRIVER], settings, None, contexts)
    # Whatever print_layout says: the run differs from its config.
    driver.layout_report = _print_note(placement)
    if settings.print_layout:
        rss_mb = round(rss_bytes() / MIB)
        driver.layout_report += _print_layout(
            placement, [(0, role, 0, host, os.getpid(), ctx.device, rss_mb)
                        for role, ctx in contexts.items()])
    code = _call_main(main, driver)
    driver._end_env_groups(code)  # a solver program's groups, driven from this process
    if driver.groups_stuck:
        _abort_past_stuck_groups(MPI.COMM_WORLD, code)
    return code


def _abort_past_stuck_groups(comm: MPI.Comm, code: int) -> None:
    """End the job with ``code`` when an env group is stuck (the line naming it is printed):
    its ranks, env ranks or a solver program's, take no stop and never reach MPI_Finalize, in
    which every other process of the job would then wait for them. Only MPI_Abort ends them;
    it ends every process of the MPMD job, on whichever communicator it is called."""
    sys.stdout.flush()
    sys.stderr.flush()
    # The launcher forwards a rank's output on its own time, but prints the abort's note at
    # once: a moment lets the line that names the group come first.
    time.sleep(0.2)
    comm.Abort(code)


def _print_note(placement: Placement) -> str:
    """Print the placement's note (what ran, where it is likely not what was meant) on stderr,
    before anything else; return what was printed."""
    note = placement.note()
    if note is None:
        return ""
    print(f"mpirl: {note}", file=sys.stderr, flush=True)
    return f"mpirl: {note}\n"


def _print_layout(placement: Placement, rows: list[tuple]) -> str:
    """Print the start-up report: where each rank runs, and its resident memory once started;
    return what was printed."""
    text = f"mpirl layout: {placement.summary()}\n{format_table(LAYOUT_TABLE_COLUMNS, rows)}\n"
    if placement.env_groups:
        hosts = {row[0]: row[3] for row in rows}
        groups = placement.env_group_rows(hosts, apps.solver_table())
        text += f"env groups\n{format_table(ENV_GROUP_TABLE_COLUMNS, groups)}\n"
    if placement.solver_ranks:
        rows = solver_rows(placement, apps.solver_table())
        text += f"solver ranks\n{format_table(SOLVER_TABLE_COLUMNS, rows)}\n"
    print(text, end="", flush=True)
    return text


def _external_link(placement: Placement) -> MPI.Intercomm | None:
    """The MPMD intercommunicator to a solver program's env groups, or None. It belongs to
    ``mpirl.runtime.apps`` (made once per process, used by every run of it): a run never frees
    it."""
    if placement.env_groups and placement.env_groups[0].external:
        return apps.solver_link()
    return None


def _run_distributed(main: Callable[[Driver], int | None], placement: Placement,
                     settings: RuntimeSettings, world: MPI.Comm) -> int:
    rank = world.Get_rank()
    role = placement.roles[rank]
    hosts: list[dict] = []  # rank 0: every rank's, by rank
    known: dict[int, dict] = {}  # what this rank can say of a rank in its messages
    reduce_timer_slack()

    def describe(r: int) -> str:
        where = f" on {known[r]['host']} (pid {known[r]['pid']})" if r in known else ""
        return f"rank {r} ({placement.roles[r]} {placement.role_index(r)}){where}"

    def describe_task(r: int, task: int) -> str:
        if task == SETUP:
            return "start-up"
        name = losses.dispatcher.call_name(task, r) if losses and losses.dispatcher else None
        return f"its call {name or task}"

    # Nothing collective before every rank is here: the driver then knows who is missing.
    _all_arrive(world, "start-up", settings.startup_timeout_s, describe)
    peers = range(1, world.Get_size()) if rank == 0 else (0,)
    losses = _RankLosses(placement, settings, describe) if rank == 0 else None
    heartbeat = Heartbeat(world, peers, settings.heartbeat_interval_s,
                          settings.heartbeat_timeout_s, describe,
                          losses.on_heartbeat_loss if losses else None,
                          settings.stuck_task_timeout_s if rank == 0 else None, describe_task)
    if losses:
        losses.heartbeat = heartbeat
    heartbeat.start()
    # Collective set-up with no waiting in between: a rank that dies or is stuck in here is
    # caught by the heartbeat.
    channel = Channel(world)
    data_channel = Channel(world)
    role_comm = world.Split(color=(DRIVER, *WORKER_ROLES).index(role), key=rank)
    weights_comm = _split_weights_comm(world, placement)
    node_comm = role_comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    group_comm = sim_link = None
    external_link = _external_link(placement)
    if placement.env_groups and not placement.env_groups[0].external:
        # Env ranks in the world: one message each way per env step with the rollout rank, on
        # a communicator of their own (no other traffic matches their tags).
        sim_link = world.Dup()
        if role == ENV:
            group_comm = role_comm.Split(placement.group_of(rank).index, key=rank)
    context = RankContext(
        rank=rank, role=role, role_index=placement.role_index(rank),
        role_size=role_comm.Get_size(), placement=placement, data_channel=data_channel,
        role_comm=role_comm, weights_comm=weights_comm, host=node_name(),
        device=pick_device(role, node_comm.Get_rank(), settings.learner_device),
        collective_timeout_s=settings.task_timeout_s,
        collective_backoff=(settings.poll_max_sleep_s, settings.poll_sleep_share),
        group_comm=group_comm, sim_link=sim_link or external_link,
    )
    node_comm.Free()
    startup.mark("ranks_connected")
    info = {"host": context.host, "pid": os.getpid(), "device": context.device,
            "rss_mb": round(rss_bytes() / MIB), "startup": startup.marks()}
    # pick_device may import torch and start CUDA, which can take long on one rank.
    _all_arrive(world, "the exchange of host names", settings.startup_timeout_s, describe)
    # Rank 0 needs every rank's; a worker rank only rank 0's (the one peer it reports on) and
    # its own. An allgather would put N entries on each of N ranks.
    gathered = world.gather(info, root=0)
    rank0_info = world.bcast(info if rank == 0 else None, root=0)
    if rank == 0:
        hosts.extend(gathered)
    known.update(enumerate(hosts) if rank == 0 else {0: rank0_info, rank: info})
    backoff = Backoff(max_sleep_s=settings.poll_max_sleep_s,
                      sleep_share=settings.poll_sleep_share)
    if rank != 0:
        try:
            exit_code = WorkerHost(channel, context, backoff, heartbeat).serve()
            channel.flush(timeout=settings.shutdown_timeout_s)
        except BaseException as error:  # noqa: BLE001 - whatever escapes the loop ends the job
            import traceback

            if is_process_failure(error):
                heartbeat.end_job_for_process_failure()

            print(f"mpirl: {describe(rank)} failed outside a task; ending the job.\n"
                  f"{traceback.format_exc()}", file=sys.stderr, flush=True)
            world.Abort(EXIT_FAILURE)
        heartbeat.stop()
        _free_nested(heartbeat, channel, data_channel, role_comm, weights_comm, group_comm,
                     sim_link)
        return exit_code

    layout_report = ""
    if settings.print_layout:
        layout_report = _print_note(placement) + _print_layout(
            placement, [(r, placement.roles[r], placement.role_index(r), h["host"], h["pid"],
                         h["device"], h["rss_mb"]) for r, h in enumerate(hosts)])
    dispatcher = Dispatcher(channel, placement.roles, settings.max_calls_in_flight,
                            settings.task_timeout_s, losses.on_rank_failure,
                            poll_backoff=(settings.poll_max_sleep_s, settings.poll_sleep_share))
    losses.dispatcher = dispatcher
    driver = Driver(placement, context, settings, dispatcher, hosts=hosts, heartbeat=heartbeat)
    driver.layout_report = layout_report
    exit_code = _call_main(main, driver, losses.end_job_for_process_failure)
    if driver.groups_stuck:
        _abort_past_stuck_groups(world, exit_code)
    if not driver._shutdown(exit_code, heartbeat):
        print(f"mpirl: workers did not acknowledge shutdown within {settings.shutdown_timeout_s:g}"
              f" s; aborting the job.", file=sys.stderr, flush=True)
        world.Abort(exit_code or EXIT_FAILURE)
    heartbeat.stop()
    _free_nested(heartbeat, channel, data_channel, role_comm, weights_comm, sim_link)
    return exit_code


def _free_nested(heartbeat: Heartbeat, channel: Channel, data_channel: Channel,
                 role_comm: MPI.Comm, *comms: MPI.Comm | None) -> None:
    """At the end of a nested run, free the communicators it made: a trial slot runs many runs
    in sequence, and communicators (their context ids) are a bounded resource. A run on
    COMM_WORLD leaves them to ``MPI_Finalize``, as it always has; so does a run that lost a
    rank under ULFM (freeing a communicator with a failed member is not defined to be safe).
    ``Free`` is local in effect: sends still pending complete first."""
    if not nested() or failed_world_ranks():
        return
    heartbeat.free()
    for comm in (channel.comm, channel.bulk, data_channel.comm, data_channel.bulk, role_comm,
                 *comms):
        if comm is not None and comm != MPI.COMM_NULL:
            with contextlib.suppress(MPI.Exception):
                comm.Free()


class _RankLosses:
    """The driver's decision when a worker rank is lost: go on without a rollout rank where
    MPI has ULFM and ``survive_rollout_loss`` is set; end the job for any other loss."""

    def __init__(self, placement: Placement, settings: RuntimeSettings,
                 describe: Callable[[int], str]) -> None:
        self.placement = placement
        self.describe = describe
        self.survive = settings.survive_rollout_loss and fault_tolerant()
        self.heartbeat: Heartbeat | None = None
        self.dispatcher: Dispatcher | None = None

    def survivable(self, rank: int) -> bool:
        return self.survive and self.placement.roles[rank] == ROLLOUT

    def on_heartbeat_loss(self, rank: int, evidence: str) -> None:
        """Heartbeat thread: hand a survivable loss to the main thread, else end the job.

        A rank that is silent but that MPI does not report failed (frozen, or cut off) cannot be
        shrunk away: ``Shrink`` would wait for it. Its silence ends the job as before.
        """
        if (self.dispatcher is not None and self.survivable(rank)
                and rank in failed_world_ranks(self.heartbeat.comm)):
            self.dispatcher.report_lost(rank, evidence)
        else:
            self.heartbeat.end_job([rank], evidence)

    def on_rank_failure(self, rank: int, evidence: str) -> None:
        """Main thread, from the dispatcher: return to survive the loss of ``rank`` (printing one
        line), or end the job."""
        if not self.survivable(rank):
            self.heartbeat.end_job([rank], evidence)
        live = [r for r in self.placement.ranks(ROLLOUT)
                if r != rank and r not in self.dispatcher.lost]
        if not live:
            self.heartbeat.end_job([rank], f"{evidence}; it was the last rollout worker")
        self.heartbeat.forget(rank)
        workers = "rollout worker" if len(live) == 1 else "rollout workers"
        print(f"mpirl: lost {self.describe(rank)}: {evidence}; continuing with {len(live)} "
              f"{workers} (survive_rollout_loss)", file=sys.stderr, flush=True)

    def end_job_for_process_failure(self) -> None:
        """An MPI process failure escaped the driver's program: end the job, naming the failed
        ranks that were not already survived."""
        failed = failed_world_ranks()
        unhandled = [r for r in failed if r not in self.dispatcher.lost]
        self.heartbeat.end_job(unhandled or failed, "MPI reported a process failure")


#: Tag of the start-up arrival messages on the world communicator (used by nothing else).
_ARRIVED = 29


def _all_arrive(world: MPI.Comm, step: str, timeout_s: float,
                describe: Callable[[int], str]) -> None:
    """A barrier with a deadline, where the driver can name who is missing: every worker tells
    the driver it has reached ``step``; once all have, the driver tells them to go on.

    Past ``timeout_s`` the driver prints the ranks that never arrived and ends the job with
    ``EXIT_RANK_LOST``. A worker gives the driver twice as long (so that the driver is the one
    to name the missing), then ends itself. Waits poll with back-off: no core spins.
    """
    rank, size = world.Get_rank(), world.Get_size()
    start = time.monotonic()
    backoff = Backoff()
    empty = [bytearray(0), MPI.BYTE]
    if rank == 0:
        missing, status = set(range(1, size)), MPI.Status()
        while missing:
            message = world.Improbe(MPI.ANY_SOURCE, _ARRIVED, status)
            if message is not None:
                message.Recv(empty)
                missing.discard(status.Get_source())
                backoff.reset()
                continue
            if time.monotonic() - start > timeout_s:
                names = ", ".join(describe(r) for r in sorted(missing))
                _end_start_up(f"{names} did not reach {step} within {timeout_s:g} s "
                              f"(startup_timeout_s); ending the job. A rank that never arrives "
                              f"is stuck before it started mpirl (imports on a hung file system, "
                              f"say), or was never started")
            backoff.sleep()
        MPI.Request.Waitall([world.Isend(empty, r, _ARRIVED) for r in range(1, size)])
        return
    arrived = world.Isend(empty, 0, _ARRIVED)
    while not world.Iprobe(0, _ARRIVED):
        if time.monotonic() - start > 2 * timeout_s:
            _end_start_up(f"{describe(rank)} waited {2 * timeout_s:g} s (twice "
                          f"startup_timeout_s) at {step} for {describe(0)}; ending this rank")
        backoff.sleep()
    world.Recv(empty, 0, _ARRIVED)
    arrived.Wait()


def _end_start_up(message: str) -> None:
    print(f"mpirl: {message} (exit code {EXIT_RANK_LOST}).", file=sys.stderr, flush=True)
    abort_this_rank(EXIT_RANK_LOST)


def weight_source_rank(placement: Placement) -> int:
    """The rank whose weights the rollout workers use: learner 0, or the driver holding the
    learner when there are no learner ranks."""
    learners = placement.ranks(LEARNER)
    return learners[0] if learners and not placement.local else 0


def _split_weights_comm(world: MPI.Comm, placement: Placement) -> MPI.Comm | None:
    source = weight_source_rank(placement)
    rank = world.Get_rank()
    member = rank == source or placement.roles[rank] == ROLLOUT
    # key 0 for the source makes it rank 0 of the new communicator, the Bcast root.
    comm = world.Split(0 if member else MPI.UNDEFINED, key=0 if rank == source else rank + 1)
    return None if comm == MPI.COMM_NULL else comm


def _call_main(main: Callable[[Driver], int | None], driver: Driver,
               on_process_failure: Callable[[], None] | None = None) -> int:
    try:
        code = main(driver)
    except MpirlError as error:
        print(f"mpirl: {error}", file=sys.stderr, flush=True)
        driver.groups_stuck = isinstance(error, SimulationStuck)
        return error.exit_code
    except Exception as error:  # noqa: BLE001 - reported, then every rank ends with a failure code
        import traceback

        if on_process_failure is not None and is_process_failure(error):
            on_process_failure()

        print(f"mpirl: the driver failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        return EXIT_FAILURE
    return EXIT_OK if code is None else int(code)


def node_name() -> str:
    """This rank's node as the layout table and lost-rank messages name it: Slurm's node name in
    a task srun started (what squeue and scontrol show), else the host name."""
    if "SLURM_STEP_ID" in os.environ and os.environ.get("SLURMD_NODENAME"):
        return os.environ["SLURMD_NODENAME"]
    return socket.gethostname()


def pick_device(role: str, node_local_index: int, learner_device: str = "auto") -> str:
    """The torch device for a rank: a GPU for learners when CUDA is there (and
    ``learner_device`` is auto), else the CPU.

    Learners take GPUs round-robin by their index among the learners on the same node (a
    ``COMM_TYPE_SHARED`` split of the learner communicator), so a node with 4 GPUs and 4 learner
    ranks gives each learner its own. That index, not ``SLURM_LOCALID`` or Open MPI's local rank,
    which also count the rollout ranks on the node. Where each task sees one GPU
    (``--gpus-per-task``) every learner gets ``cuda:0``. Only learners import torch here.
    """
    if role != LEARNER or learner_device == "cpu" or os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return "cpu"
    try:
        import torch
    except ImportError:
        return "cpu"
    if not torch.cuda.is_available():
        return "cpu"
    return f"cuda:{node_local_index % torch.cuda.device_count()}"
