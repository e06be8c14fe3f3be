"""Heartbeats: how a job notices that a rank died, and ends instead of hanging.

MPI gives no portable way to learn that a peer died: a blocking receive from a dead rank can hang
for ever (this was seen with Open MPI's ULFM mode, and Slurm does not kill a step on a task's death
unless KillOnBadExit is set). So each rank runs one daemon thread that sends a zero-byte message
every ``interval_s`` and watches for its peers' messages:

* the driver (rank 0) watches every worker rank;
* each worker watches the driver.

A peer silent for ``timeout_s``, or one that MPI reports failed (under ULFM), is declared lost: the
watching rank prints one line naming the lost rank (its role, host and pid) and calls
``MPI_Abort``, which ends every rank of the job with ``EXIT_RANK_LOST``. The driver may instead
survive the loss of a rollout rank (``on_lost``; see ``runtime``). The thread uses its own
duplicate communicator, so it never matches the main thread's messages, and it keeps running while
the main thread computes (NumPy, torch and MPI calls release the GIL). That takes
``MPI_THREAD_MULTIPLE``; ``require_thread_multiple`` refuses to start below it.

A heartbeat also shows progress: each worker's carries the call its main thread is running and that
thread's CPU time, and its rank's resident memory (``peer_rss_bytes``: the driver reports it per
role every iteration, so a leak shows on a plot long before the OOM killer sees it). A main thread
that is blocked (a deadlock, a hung file system or device, a call that never returns) keeps its
heartbeat going but uses no CPU at all; the driver reports a worker whose task has used no CPU for
``stuck_timeout_s`` as stuck, naming the task, and ends the job as for a lost rank. Any CPU use
counts as progress, so a long computation (an SGD pass, a long ``sample``, a wait that polls) is
never taken for stuck; a rank whose main thread holds the GIL while it blocks silences its
heartbeat too and is lost by silence.

If the thread itself fails, it ends its rank with a message (exit code 1) rather than leave the
rank unwatched.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable

import numpy as np
from mpi4py import MPI

from mpirl.errors import EXIT_FAILURE, EXIT_RANK_LOST, ThreadLevelError
from mpirl.runtime.memory import rss_bytes
from mpirl.runtime.ulfm import (
    acknowledge_failures,
    failed_world_ranks,
    fault_tolerant,
    is_process_failure,
)
from mpirl.runtime.world import run_comm

__all__ = ["IDLE", "SETUP", "Heartbeat", "failed_world_ranks", "is_process_failure",
           "require_thread_multiple"]

_TAG = 7
#: ``Heartbeat.current_task`` between tasks, and during start-up; any other value is a call id.
IDLE = 0
SETUP = -1
#: Sent as CPU time where the platform has no per-thread CPU clock: never counts as stuck.
_NO_CLOCK = -1


class Heartbeat:
    """Send heartbeats to ``peers`` and end the job when one of them falls silent, or (with
    ``stuck_timeout_s``) when one's task makes no progress.

    ``describe(rank)`` names a rank in the message (role, host, pid). ``on_lost(rank, evidence)``
    replaces the default action for a lost rank (print and ``MPI_Abort``).
    ``describe_task(rank, task)`` names the task a stuck rank is in. The thread that creates the
    heartbeat is the one whose progress it reports; it sets ``current_task`` to the call id it
    runs, ``IDLE`` between calls (``SETUP`` until then).
    """

    def __init__(
        self,
        comm: MPI.Comm,
        peers: Iterable[int],
        interval_s: float = 1.0,
        timeout_s: float = 20.0,
        describe: Callable[[int], str] | None = None,
        on_lost: Callable[[int, str], None] | None = None,
        stuck_timeout_s: float | None = None,
        describe_task: Callable[[int, int], str] | None = None,
    ) -> None:
        if not timeout_s > interval_s > 0:
            raise ValueError(
                f"need heartbeat_timeout_s > heartbeat_interval_s > 0, got timeout_s={timeout_s}, "
                f"interval_s={interval_s}"
            )
        if stuck_timeout_s is not None and not stuck_timeout_s > interval_s:
            raise ValueError(f"need stuck_task_timeout_s > heartbeat_interval_s, got "
                             f"{stuck_timeout_s} and {interval_s}")
        self.comm = comm.Dup()
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.describe = describe or (lambda rank: f"rank {rank}")
        self.on_lost = on_lost or self._abort
        self.stuck_timeout_s = stuck_timeout_s
        self.describe_task = describe_task or (lambda rank, task: f"call {task}")
        #: Written by the watched thread only; read by the heartbeat thread.
        self.current_task = SETUP
        self._cpu_clock = _thread_cpu_clock(threading.get_ident())
        #: peer -> (its task, its CPU time in ns, when either last changed)
        self._progress: dict[int, tuple[int, int, float]] = {}
        #: peer -> its resident memory in bytes, from its latest heartbeat
        self._rss: dict[int, int] = {}
        # Under ULFM, MPI may know of a death long before the silence runs out: ask it each poll.
        self._ask_mpi = fault_tolerant()
        now = time.monotonic()
        self._last_seen = {peer: now for peer in peers}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mpirl-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def forget(self, rank: int) -> None:
        """Stop watching ``rank`` (it has shut down cleanly)."""
        with self._lock:
            self._last_seen.pop(rank, None)
            self._progress.pop(rank, None)
            self._rss.pop(rank, None)

    def peer_rss_bytes(self) -> dict[int, int]:
        """Each watched peer's resident memory, as its latest heartbeat said (peers not heard
        from yet are left out)."""
        with self._lock:
            return dict(self._rss)

    def stop(self) -> None:
        """Stop sending and watching; returns once the thread has ended."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5 * self.interval_s + 1.0)

    def free(self) -> None:
        """After ``stop``: free the heartbeat's communicator, unless the thread has not ended
        (stuck in an MPI call, it keeps it)."""
        if not self._thread.is_alive() and self.comm != MPI.COMM_NULL:
            with contextlib.suppress(MPI.Exception):
                self.comm.Free()

    def _loop(self) -> None:
        try:
            self._watch()
        except BaseException:  # noqa: BLE001 - an unwatched rank could wait for ever: end it
            self._thread_failed()

    def _thread_failed(self) -> None:
        me = self.describe(self.comm.Get_rank())
        print(f"mpirl: the heartbeat thread of {me} failed; without it the rank could wait for "
              f"ever on a lost peer, so it ends now (exit code {EXIT_FAILURE}).\n"
              f"{traceback.format_exc()}", file=sys.stderr, flush=True)
        abort_this_rank(EXIT_FAILURE)

    def _watch(self) -> None:
        sends: list[tuple[MPI.Request, np.ndarray]] = []
        next_send = 0.0
        poll_s = min(0.1, self.interval_s / 4)
        while not self._stop.is_set():
            now = time.monotonic()
            self._guarded(self._receive, now)
            if self._ask_mpi:
                self._guarded(self._check_failed)
            if now >= next_send:
                sends = [s for s in sends if not _completed(s[0])]
                self._guarded(self._send, sends)
                next_send = now + self.interval_s
            with self._lock:
                silent = [
                    (r, now - t) for r, t in self._last_seen.items() if now - t > self.timeout_s
                ]
            for rank, silence in silent:
                self._lose(rank, f"no heartbeat for {silence:.1f} s "
                                 f"(heartbeat_timeout_s={self.timeout_s:g})")
            if self.stuck_timeout_s is not None:
                self._check_stuck(now)
            self._stop.wait(poll_s)
        for request, _ in sends:
            if not request.Test():
                request.Free()

    def _check_stuck(self, now: float) -> None:
        with self._lock:
            stuck = [(r, task, now - since) for r, (task, cpu, since) in self._progress.items()
                     if task != IDLE and cpu != _NO_CLOCK and now - since > self.stuck_timeout_s]
        for rank, task, idle_s in stuck:
            evidence = (f"its main thread has used no CPU for {idle_s:.1f} s in "
                        f"{self.describe_task(rank, task)} (stuck_task_timeout_s="
                        f"{self.stuck_timeout_s:g})")
            self.forget(rank)
            self.end_job([rank], evidence, stuck=True)

    def _receive(self, now: float) -> None:
        status = MPI.Status()
        beat = np.zeros(3, np.int64)
        while (message := self.comm.Improbe(MPI.ANY_SOURCE, _TAG, status)) is not None:
            message.Recv(beat)
            source, task, cpu = status.Get_source(), int(beat[0]), int(beat[1])
            with self._lock:
                if source in self._last_seen:
                    self._last_seen[source] = now
                    self._rss[source] = int(beat[2])
                    last = self._progress.get(source)
                    if last is None or last[:2] != (task, cpu):
                        self._progress[source] = (task, cpu, now)

    def _send(self, sends: list[tuple[MPI.Request, np.ndarray]]) -> None:
        """One heartbeat to every peer: (the task the watched thread runs, its CPU time in ns,
        this rank's resident memory in bytes)."""
        cpu = _NO_CLOCK if self._cpu_clock is None else time.clock_gettime_ns(self._cpu_clock)
        beat = np.array([self.current_task, cpu, rss_bytes()], np.int64)
        with self._lock:
            peers = list(self._last_seen)
        for peer in peers:
            sends.append((self.comm.Isend(beat, peer, _TAG), beat))

    def _check_failed(self) -> None:
        with self._lock:
            lost = [r for r in failed_world_ranks(self.comm) if r in self._last_seen]
        if lost:
            acknowledge_failures(self.comm)
        for rank in lost:
            self._lose(rank, "MPI reported a process failure")

    def _guarded(self, step, *args) -> None:
        """Run one step; under ULFM a dead peer makes MPI calls raise: report the dead ranks
        MPI names, acknowledge them so the next calls work, and go on."""
        try:
            step(*args)
        except MPI.Exception as error:
            if not is_process_failure(error):
                raise
            if error.Get_error_class() == getattr(MPI, "ERR_REVOKED", None):
                # Another rank is ending the job and has said so already; end this rank too.
                abort_this_rank()
            failed = failed_world_ranks(self.comm)
            acknowledge_failures(self.comm)
            with self._lock:
                watched = [r for r in failed if r in self._last_seen]
            for rank in watched:
                self._lose(rank, "MPI reported a process failure")

    def _lose(self, rank: int, evidence: str) -> None:
        self.forget(rank)
        self.on_lost(rank, evidence)

    def _abort(self, rank: int, evidence: str) -> None:
        self.end_job([rank], evidence)

    def end_job(self, lost: list[int], evidence: str, stuck: bool = False) -> None:
        """Print one line naming the ``lost`` world ranks (or with ``stuck``, the ranks whose
        task makes no progress), then end every rank of the job with ``EXIT_RANK_LOST``. Never
        returns.

        Under ULFM (``mpiexec --with-ft ulfm``) ``MPI_Abort`` ends only the calling rank; the
        others end when MPI reports that rank's failure to their heartbeat threads. Revoking the
        heartbeat communicator first tells them sooner and does not depend on that report: every
        heartbeat thread sees the revoke within one poll and ends its rank. Measured here after a
        kill -9 of a worker: every rank gone 2.1-3.0 s after the kill, against 3.1 s without it.
        """
        names = ", ".join(self.describe(r) for r in lost) or "a rank"
        me = self.describe(self.comm.Get_rank())
        if stuck:
            what = (f"{names} is stuck: {evidence}, seen from {me}. Its main thread is blocked "
                    f"(a deadlock, a hung file system or device, a call that never returns)")
        else:
            what = (f"lost {names}: {evidence}, seen from {me}. It was probably killed, ran out "
                    f"of memory, or its node failed")
        print(
            f"mpirl: {what}. Ending the job (exit code {EXIT_RANK_LOST}); resume it from its "
            f"last checkpoint.",
            file=sys.stderr,
            flush=True,
        )
        with contextlib.suppress(MPI.Exception, NotImplementedError, AttributeError):
            self.comm.Revoke()
        abort_this_rank()

    def end_job_for_process_failure(self) -> None:
        """End the job after an MPI call raised a ULFM process-failure error, naming the ranks
        MPI reports as failed. Never returns."""
        self.end_job(failed_world_ranks(), "MPI reported a process failure")


def abort_this_rank(code: int = EXIT_RANK_LOST) -> None:
    """End this rank with ``code``; only the driver (rank 0 of the run's communicator) calls
    ``MPI_Abort``, and only without ULFM.

    Under ULFM, Open MPI 5's launcher was seen to hang (all ranks gone, prterun in a futex wait,
    about 1 run in 5) when several ranks called ``MPI_Abort`` at once, as workers do when they
    all lose the driver. A worker's plain exit ends the job just as surely: the launcher kills
    the job on it, or ULFM or the driver's heartbeat reports it and the driver aborts. Under
    ULFM ``MPI_Abort`` ends only its caller and the launcher drops its error code
    (``mpiexec --with-ft ulfm -n 1`` of a program calling ``Abort(70)`` exits 0), so there the
    driver exits plainly too; the workers end on the revoked heartbeat communicator.
    """
    world = run_comm()
    if world.Get_rank() == 0 and not fault_tolerant():
        # In a nested run (a sub-communicator of COMM_WORLD) this is the run's driver: Open MPI
        # kills every process of the MPI job on an Abort on any communicator (seen with 5.0),
        # so a lost rank in one trial of ``mpirl tune`` ends the whole job, not only its run.
        world.Abort(code)
    sys.stderr.flush()
    os._exit(code)  # also for MPIs whose Abort returns


def _thread_cpu_clock(thread_id: int) -> int | None:
    """The CPU-time clock of thread ``thread_id`` (Linux and most Unixes), else None."""
    try:
        return time.pthread_getcpuclockid(thread_id)
    except (AttributeError, OSError):
        return None


_LEVELS = {MPI.THREAD_SINGLE: "SINGLE", MPI.THREAD_FUNNELED: "FUNNELED",
           MPI.THREAD_SERIALIZED: "SERIALIZED", MPI.THREAD_MULTIPLE: "MULTIPLE"}


def thread_level_name() -> str:
    """The thread support MPI gives this process: ``"MULTIPLE"``, ``"SERIALIZED"``, ..."""
    return _LEVELS.get(MPI.Query_thread(), str(MPI.Query_thread()))


def require_thread_multiple() -> None:
    """Raise ``ThreadLevelError`` (exit code 2) unless MPI gives ``MPI_THREAD_MULTIPLE``, with
    what to change. Every rank checks its own level, so every rank raises; nothing is sent.

    The heartbeat thread calls MPI while the main thread is inside MPI calls of its own; below
    MULTIPLE that is undefined behaviour (lost messages, crashes, hangs), not merely slower.
    """
    if MPI.Query_thread() >= MPI.THREAD_MULTIPLE:
        return
    import mpi4py

    asked = mpi4py.rc.thread_level
    if asked != "multiple":
        how = (f"mpi4py asked MPI for {asked!r} (set by MPI4PY_RC_THREAD_LEVEL or "
               f"mpi4py.rc.thread_level): unset it, or set it to 'multiple'")
    else:
        library = MPI.Get_library_version()
        if "CRAY" in library.upper() or "MPICH" in library.upper():
            how = ("set MPICH_MAX_THREAD_SAFETY=multiple in the job's environment (Cray MPICH "
                   "gives SERIALIZED unless told)")
        else:
            how = ("use a build of the MPI library with thread support (Open MPI builds have it "
                   "by default since 3.0)")
    raise ThreadLevelError(
        f"MPI gives thread level {thread_level_name()}, but mpirl needs MULTIPLE (its heartbeat "
        f"thread calls MPI while the main thread does). To get it, {how}. `mpirl doctor` shows "
        f"the level each rank gets."
    )


def _completed(request: MPI.Request) -> bool:
    """Test a heartbeat send; one to a rank that died counts as done (there is nothing to wait
    for, and under ULFM the test raises)."""
    try:
        return request.Test()
    except MPI.Exception:
        return True
