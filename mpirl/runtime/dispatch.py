"""Driver-side task dispatch: asynchronous calls on workers, futures, and waiting.

Rank 0 sends a task ``(call_id, object_id, method, args, kwargs)`` to a worker rank and gets a
``Future`` at once. The worker answers ``(call_id, ok, value)``. The driver matches answers to
futures by ``call_id`` whenever it polls, which it does inside ``wait``, ``Future.result`` and
``Future.done``. Each worker rank has at most ``max_calls_in_flight`` unanswered calls; a call
beyond that waits for a slot.

In local mode the same handles run the method in-process and return a finished future.

Under ULFM the driver may survive the loss of a worker rank (see ``runtime``): the dispatcher then
marks the rank lost, fails its pending futures with ``RankLost`` and sends it nothing more, and
``WorkerGroup.discard_lost`` takes its workers out of their groups.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

from mpi4py import MPI

from mpirl.errors import RankLost, RemoteError, TaskTimeout
from mpirl.runtime.transport import Channel
from mpirl.runtime.ulfm import (
    acknowledge_failures,
    failed_world_ranks,
    fault_tolerant,
    is_process_failure,
)
from mpirl.runtime.waiting import DRIVER_CPU, Backoff

__all__ = ["Completions", "call_all"]

#: Tags on the control channel.
TASK = 1
RESULT = 2
#: A worker rank received a stop signal (see ``mpirl.runtime.signals``); the payload is its number.
SIGNAL = 3
#: A population of runs (``mpirl tune``, ``mpirl.tune.population_link``) has a control channel of
#: its own between its controller and the drivers of its trials: TASK and RESULT carry a trial
#: segment and its outcome there too, and these two go beside them: a trial's checkpoint from
#: one trial's driver to another's (PBT's exploit), and the controller's request that a running
#: trial stop at its next iteration.
CHECKPOINT = 4
STOP_TRIAL = 5
#: Object id 0 is the host itself; it answers these messages.
HOST = 0
HOST_MESSAGES = ("spawn", "drop", "stop", "count_objects", "shrink_weights_comm")


class Future:
    """The pending result of one call on one worker.

    ``result(timeout)`` returns the value or raises the remote error as ``RemoteError``, or
    ``RankLost`` when the worker's rank was lost before it answered.
    """

    __slots__ = ("_dispatcher", "call_id", "rank", "role", "method", "_done", "_ok", "_value",
                 "_on_done")

    def __init__(self, dispatcher: Dispatcher | None, call_id: int, rank: int, role: str,
                 method: str) -> None:
        self._dispatcher = dispatcher
        self.call_id = call_id
        self.rank = rank
        self.role = role
        self.method = method
        self._done = False
        self._ok = False
        self._value: Any = None
        self._on_done: Callable[[], None] | None = None  # set by Completions.watch

    def _resolve(self, ok: bool, value: Any) -> None:
        self._done = True
        self._ok = ok
        self._value = value
        if self._on_done is not None:
            on_done, self._on_done = self._on_done, None
            on_done()

    def _fail(self, error: Exception) -> None:
        self._resolve(False, error)

    def settle(self, value: Any) -> None:
        """Resolve the call with ``value``, its result that came through a collective (the
        method returned ``mpirl.runtime.gathered.ANSWERED``), and free its slot on the worker's
        rank."""
        if not self._done:
            self._dispatcher.settle(self, value)

    def done(self, poll: bool = True) -> bool:
        """True once the worker has answered. Polls for answers first unless ``poll`` is off:
        a loop over many futures right after ``wait`` looks without polling, or it would poll
        once per unanswered call (and see the calls finish at different moments)."""
        if poll and not self._done:
            self._dispatcher.progress()
        return self._done

    def result(self, timeout: float | None = None) -> Any:
        """The call's return value. Waits up to ``timeout`` seconds (None: the task timeout).

        Raises ``RemoteError`` if the method raised on the worker and ``TaskTimeout`` if the
        answer did not come in time.
        """
        if not self._done:
            self._dispatcher.wait_for(lambda: self._done, timeout, (self,))
        if self._ok:
            return self._value
        if isinstance(self._value, Exception):
            raise self._value
        cause_type, message, remote_traceback = self._value
        raise RemoteError(self.rank, self.role, self.method, cause_type, message, remote_traceback)

    def __repr__(self) -> str:
        state = ("ok" if self._ok else "error") if self._done else "pending"
        return f"<Future {self.role}@rank{self.rank}.{self.method} #{self.call_id} {state}>"


def wait(
    futures: Iterable[Future], num_returns: int = 1, timeout: float | None = None
) -> tuple[list[Future], list[Future]]:
    """Wait until ``num_returns`` of ``futures`` are done, or ``timeout`` seconds pass.

    Returns ``(ready, not_ready)``, each in the order given; ``ready`` holds at most
    ``num_returns`` futures. With ``timeout=None`` the wait is bounded by the task timeout, and
    running past it raises ``TaskTimeout`` (a dead worker must never hang the driver).
    """
    futures = list(futures)
    if not 0 <= num_returns <= len(futures):
        raise ValueError(f"num_returns must be between 0 and {len(futures)}, got {num_returns}")
    pending = [f for f in futures if not f._done]
    if len(futures) - len(pending) < num_returns:
        dispatcher = pending[0]._dispatcher
        needed = num_returns - (len(futures) - len(pending))

        def enough() -> bool:
            return sum(f._done for f in pending) >= needed

        dispatcher.wait_for(enough, timeout, pending, raise_on_timeout=timeout is None)
    ready: list[Future] = []
    not_ready: list[Future] = []
    for future in futures:
        (ready if future._done and len(ready) < num_returns else not_ready).append(future)
    return ready, not_ready


class Completions:
    """The watched calls that have finished, in the order they did: a loop that keeps many
    calls running (IMPALA's, Ape-X's) waits for the next answers and takes them at O(1) per
    answer, where ``wait`` over its calls looks at each of them on every poll.

    ``watch(future, item)``: once ``future`` finishes (answered, failed or its rank lost),
    ``take`` returns ``item``. A future has at most one watcher."""

    def __init__(self) -> None:
        self._finished: list[Any] = []
        self._watched = 0  # watched futures not yet finished
        self._dispatcher: Dispatcher | None = None

    def watch(self, future: Future, item: Any) -> None:
        if future._done:
            self._finished.append(item)
            return
        if future._on_done is not None:
            raise ValueError(f"{future!r} is watched already")
        self._dispatcher = future._dispatcher
        self._watched += 1

        def finished() -> None:
            self._watched -= 1
            self._finished.append(item)
        future._on_done = finished

    @property
    def pending(self) -> int:
        """Watched calls not finished yet."""
        return self._watched

    @property
    def any_finished(self) -> bool:
        """Whether a watched call finished since the last take (without polling)."""
        return bool(self._finished)

    def take_finished(self) -> list[Any]:
        """The items of the calls that finished since the last take, without waiting."""
        finished, self._finished = self._finished, []
        return finished

    def take(self, timeout: float | None = None, waiting_on: Iterable[Future] = ()) -> list[Any]:
        """The items of the calls that finished since the last ``take``, in the order they
        finished; if there are none, waits for one first. With ``timeout=None`` a wait past the
        task timeout raises ``TaskTimeout`` naming ``waiting_on``; past a given ``timeout`` the
        list is empty."""
        if not self._finished:
            if not self._watched:
                raise ValueError("Completions.take: no watched call is running")
            self._dispatcher.wait_for(lambda: self._finished, timeout, waiting_on,
                                      raise_on_timeout=timeout is None)
        finished, self._finished = self._finished, []
        return finished


class StandingCalls(Protocol):
    """Calls that keep ``ranks`` busy between iterations until ``end`` ends them and takes
    their answers (``Dispatcher.hold``)."""

    ranks: Sequence[int]

    def end(self) -> None: ...


class Dispatcher:
    """Rank 0's end of the control channel: sends tasks, matches answers to futures.

    ``on_rank_failure(rank, evidence)`` decides what a worker rank's death means. It is called on
    the driver's main thread for each rank that MPI reports failed (ULFM) or that ``report_lost``
    named, and either ends the job (it does not return) or returns, and the rank is then lost:
    its pending futures raise ``RankLost`` and it gets no more tasks. Without it, MPI's
    process-failure errors propagate to the caller.
    """

    def __init__(self, channel: Channel, roles: Sequence[str], max_calls_in_flight: int,
                 task_timeout_s: float,
                 on_rank_failure: Callable[[int, str], None] | None = None,
                 poll_backoff: tuple[float, float] = (1e-3, 0.0)) -> None:
        if max_calls_in_flight < 1:
            raise ValueError(f"max_calls_in_flight must be >= 1, got {max_calls_in_flight}")
        self.channel = channel
        self.roles = roles
        self.max_calls_in_flight = max_calls_in_flight
        self.task_timeout_s = task_timeout_s
        #: (max_sleep_s, sleep_share) of the waits for answers (``Backoff``)
        self.poll_backoff = poll_backoff
        #: (call id, rank) -> its future: the calls of one ``submit_many`` share an id
        self._futures: dict[tuple[int, int], Future] = {}
        self._in_flight = [0] * len(roles)
        self._next_call_id = 1
        self.on_rank_failure = on_rank_failure
        #: lost rank -> what showed it was lost
        self.lost: dict[int, str] = {}
        self._reported: list[tuple[int, str]] = []
        self._reported_lock = threading.Lock()
        # Under ULFM a send may fail part way through a fan-out; one submit per call handles it.
        self._one_send_per_call = fault_tolerant()
        #: Whether a synchronous round may leave its calls standing between iterations
        #: (``mpirl.execution.standing_rounds``): the CLI's loop, which trains back to back, sets
        #: it; a Python API user may pause between iterations for longer than a collective waits.
        self.standing_calls = False
        #: rank -> the standing calls that hold it (``hold``)
        self._held: dict[int, StandingCalls] = {}

    def report_lost(self, rank: int, evidence: str) -> None:
        """Ask the main thread to treat ``rank`` as failed at its next poll. Thread-safe (the
        heartbeat thread calls it)."""
        with self._reported_lock:
            self._reported.append((rank, evidence))

    def submit(self, rank: int, object_id: int, method: str, args: tuple, kwargs: dict) -> Future:
        """Send one task; wait first for a free slot if ``rank`` is at its in-flight bound.

        Messages to the host itself (spawn, stop) skip the bound, so shutdown never queues.
        """
        if self._held and rank in self._held:
            self.release(rank)
        if object_id != HOST:
            self._wait_for_slot(rank)
        call_id = self._next_call_id
        self._next_call_id += 1
        future = Future(self, call_id, rank, self.roles[rank], method)
        if rank not in self.lost:
            try:
                self.channel.isend((call_id, object_id, method, args, kwargs), rank, TASK)
            except MPI.Exception as error:
                self._handle_mpi_error(error)
        if rank in self.lost:
            future._fail(self._lost_error(rank, method))
            return future
        self._futures[call_id, rank] = future
        self._in_flight[rank] += 1
        return future

    def submit_many(self, ranks: Sequence[int], object_id: int, method: str, args: tuple,
                    kwargs: dict) -> list[Future]:
        """The same task to each of ``ranks`` (one object id on all of them): pickled once and
        sent on in one loop, one call id for all; the futures in the order of ``ranks``. Rank 0
        then pays a few µs per rank, not the 10-15 µs of a ``submit`` each. Each rank sees an
        ordinary task, in order with the others sent to it. Under ULFM (``fault_tolerant``),
        or with a lost rank among ``ranks``, it is one ``submit`` per rank, each of which
        handles a rank lost on the way."""
        if self._one_send_per_call or len(ranks) < 2 or (
                self.lost and any(rank in self.lost for rank in ranks)):
            return [self.submit(rank, object_id, method, args, kwargs) for rank in ranks]
        if self._held:
            for rank in ranks:
                if rank in self._held:
                    self.release(rank)
        for rank in ranks:
            self._wait_for_slot(rank)
        call_id = self._next_call_id
        self._next_call_id += 1
        self.channel.isend_many((call_id, object_id, method, args, kwargs), ranks, TASK)
        roles, futures, in_flight = self.roles, self._futures, self._in_flight
        out = []
        for rank in ranks:
            future = Future(self, call_id, rank, roles[rank], method)
            futures[call_id, rank] = future
            in_flight[rank] += 1
            out.append(future)
        return out

    def hold(self, calls: StandingCalls) -> None:
        """Note that ``calls`` keep their ranks busy between iterations: any later call to one
        of them first ends them (``release``)."""
        for rank in calls.ranks:
            self._held[rank] = calls

    def holder(self, rank: int) -> StandingCalls | None:
        """The standing calls that hold ``rank``, if any."""
        return self._held.get(rank)

    def release(self, rank: int) -> None:
        """End the standing calls that hold ``rank``, and wait for their answers."""
        calls = self._held.get(rank)
        if calls is None:
            return
        for held in calls.ranks:
            self._held.pop(held, None)
        calls.end()

    def release_all(self) -> None:
        """End every standing call (before a checkpoint, a restore, the end of the run)."""
        while self._held:
            self.release(next(iter(self._held)))

    def _wait_for_slot(self, rank: int) -> None:
        """Return once ``rank`` has fewer than ``max_calls_in_flight`` calls unanswered."""
        if self._in_flight[rank] >= self.max_calls_in_flight:
            self.wait_for(lambda: self._in_flight[rank] < self.max_calls_in_flight, None,
                          [f for f in self._futures.values() if f.rank == rank])

    def settle(self, future: Future, value: Any) -> None:
        """Resolve ``future`` with ``value``, which reached the driver some other way than the
        call's answer (``mpirl.runtime.gathered``); frees its slot."""
        if self._futures.pop((future.call_id, future.rank), None) is not None:
            self._in_flight[future.rank] -= 1
            future._resolve(True, value)

    def call_name(self, call_id: int, rank: int) -> str | None:
        """``method()`` of the unanswered call ``call_id`` on ``rank``, or None; safe from
        another thread (the heartbeat's, naming a stuck task)."""
        future = self._futures.get((call_id, rank))
        return None if future is None else f"{future.method}()"

    def in_flight(self, rank: int) -> int:
        """Calls sent to ``rank`` and not yet answered."""
        return self._in_flight[rank]

    def take_reported_losses(self) -> None:
        """Treat the ranks that ``report_lost`` named since the last look as lost."""
        if self._reported:
            with self._reported_lock:
                reported, self._reported = self._reported, []
            for rank, evidence in reported:
                self._lose(rank, evidence)

    def progress(self) -> bool:
        """Take every answer that has arrived; True if there was at least one."""
        self.take_reported_losses()
        poll = self.channel.poll
        arrived = False
        try:
            while (item := poll(MPI.ANY_SOURCE, RESULT)) is not None:
                (call_id, ok, value), source = item
                arrived = True
                future = self._futures.pop((call_id, source), None)
                if future is None:  # a late answer from a rank already declared lost
                    continue
                self._in_flight[source] -= 1
                future._resolve(ok, value)
            if arrived:
                self.channel.flush()
        except MPI.Exception as error:
            self._handle_mpi_error(error)
            return True
        return arrived

    def poll_any(self, tag: int) -> tuple[Any, int] | None:
        """One message of ``tag`` from any worker rank on the control channel, or None.

        Under ULFM a probe from any source raises once a rank has failed, until the failure is
        acknowledged; that failure is handled here as in ``progress`` (the rank is lost and
        survived, or the job ends), and None is returned: the caller polls again later."""
        try:
            return self.channel.poll(MPI.ANY_SOURCE, tag)
        except MPI.Exception as error:
            self._handle_mpi_error(error)
            return None

    def _handle_mpi_error(self, error: MPI.Exception) -> None:
        """Turn an MPI error caused by dead worker ranks into lost ranks; re-raise any other."""
        new = [r for r in failed_world_ranks(self.channel.comm) if r not in self.lost]
        if self.on_rank_failure is None or not (new or is_process_failure(error)):
            raise error
        # Until the failures are acknowledged, every probe from any source raises.
        acknowledge_failures(self.channel.comm)
        for rank in new:
            self._lose(rank, "MPI reported a process failure")

    def _lose(self, rank: int, evidence: str) -> None:
        if rank in self.lost or self.on_rank_failure is None:
            return
        self.on_rank_failure(rank, evidence)
        self.lost[rank] = evidence
        for key, future in list(self._futures.items()):
            if future.rank == rank:
                del self._futures[key]
                future._fail(self._lost_error(rank, future.method))
        self._in_flight[rank] = 0
        self.channel.forget(rank)
        acknowledge_failures(self.channel.comm)

    def _lost_error(self, rank: int, method: str) -> RankLost:
        return RankLost(f"{self.roles[rank]} rank {rank} was lost ({self.lost[rank]}); its call "
                        f"{method}() will never be answered", rank)

    def wait_for(self, condition, timeout: float | None, waiting_on: Iterable[Future],
                 raise_on_timeout: bool = True) -> bool:
        """Poll until ``condition()`` holds. Past the timeout, raise ``TaskTimeout`` naming the
        calls in ``waiting_on`` (or return False when ``raise_on_timeout`` is off)."""
        limit = self.task_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        max_sleep_s, sleep_share = self.poll_backoff
        backoff = Backoff(spin_s=DRIVER_SPIN_S, max_sleep_s=max_sleep_s, sleep_share=sleep_share)
        while True:
            turn_began = time.thread_time()
            if condition():
                return True
            if self.progress():
                backoff.reset()
                continue
            if time.monotonic() >= deadline:
                if not raise_on_timeout:
                    return False
                names = ", ".join(
                    f"{f.method}() on {f.role} rank {f.rank}" for f in list(waiting_on)[:8]
                )
                raise TaskTimeout(
                    f"no answer within {limit:g} s from: {names}. The worker may be stuck in "
                    f"its method; raise task_timeout_s if the work really takes this long."
                )
            backoff.sleep()
            DRIVER_CPU.idle_s += time.thread_time() - turn_began


DRIVER_SPIN_S = 2e-4
"""How long the driver polls without sleeping after an answer (``Backoff.spin_s``; workers keep
2 ms). The driver's waits are on many calls at once, and a 2 ms spin after every answer made
Ape-X's rank 0 poll some 4,500 times per 1 s iteration at 64 ranks (idle CPU 46 ms, 26 ms with
0.2 ms). A reply that misses the window is seen within the back-off's doubling sleeps: late by
at most about the time it took. Workers keep their 2 ms spin, so a driver's next call still
finds a worker that has just answered awake (``Backoff``: the spin must outlast the peer's
sleep on one side of a conversation)."""


class WorkerHandle:
    """One worker object on one rank (or in-process, in local mode)."""

    def __init__(self, dispatcher: Dispatcher | None, rank: int, role: str, index: int,
                 object_id: int, cls: type, local_object: Any = None) -> None:
        self._dispatcher = dispatcher
        self.rank = rank
        self.role = role
        self.index = index
        self.object_id = object_id
        self.cls = cls
        self._messages = frozenset(cls.MESSAGES)
        self._local_object = local_object
        #: Whether its object shares its rank's sampling core with other workers (one per
        #: policy of a multi-agent run, ``Driver.spawn(beside=...)``): its rank's collectives
        #: (the weight broadcast, gathered answers, standing rounds) are not its own.
        self.shares_rank = False

    def call_async(self, method: str, *args: Any, **kwargs: Any) -> Future:
        """Start ``method(*args, **kwargs)`` on the worker; returns its future at once."""
        if method not in self._messages:
            raise AttributeError(
                f"{self.cls.__name__} does not answer {method!r}; its MESSAGES are: "
                f"{', '.join(self.cls.MESSAGES) or '(none)'}"
            )
        if self.in_process:
            return _run_local(self._local_object, self.role, method, args, kwargs)
        return self._dispatcher.submit(self.rank, self.object_id, method, args, kwargs)

    def call(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """Run ``method`` on the worker and return its result (raises ``RemoteError``)."""
        return self.call_async(method, *args, **kwargs).result(timeout)

    @property
    def dispatcher(self) -> Dispatcher | None:
        """The driver's dispatcher that sends this worker its calls (None in-process)."""
        return self._dispatcher

    @property
    def in_process(self) -> bool:
        """True when the object lives in the driver's own process (local mode, or a role with
        no ranks of its own)."""
        return self._dispatcher is None

    def in_flight(self) -> int:
        """Calls on this worker's rank not yet answered (0 in local mode)."""
        return 0 if self.in_process else self._dispatcher.in_flight(self.rank)

    @property
    def lost(self) -> bool:
        """True once the driver has declared this worker's rank lost (and survived it)."""
        return not self.in_process and self.rank in self._dispatcher.lost

    @property
    def local_object(self) -> Any:
        """The worker object itself when it is in-process, else None."""
        return self._local_object

    def call_rank_async(self, message: str, *args: Any) -> Future:
        """Send one of ``HOST_MESSAGES`` to the worker's rank itself rather than to the object."""
        if message not in HOST_MESSAGES or self.in_process:
            raise ValueError(f"{message!r} is not a message to a worker rank, or {self!r} has "
                             f"no rank of its own")
        return self._dispatcher.submit(self.rank, HOST, message, args, {})

    def __repr__(self) -> str:
        where = "in-process" if self.in_process else f"rank {self.rank}"
        return f"<{self.cls.__name__} {self.role} {self.index} on {where}>"


class WorkerGroup(Sequence[WorkerHandle]):
    """The workers of one class spawned on every rank of one role."""

    def __init__(self, role: str, cls: type, handles: list[WorkerHandle]) -> None:
        self.role = role
        #: what its checkpoint files are named after: the role, or e.g. ``learner-runner`` for
        #: the learners of one policy of a multi-agent run
        self.name = role
        self.cls = cls
        self._handles = handles
        #: workers taken out of the group by ``discard_lost``, in the order they were lost
        self.lost: list[WorkerHandle] = []
        # The dispatchers its remote workers are reached through (one, but for tests' fakes).
        self._dispatchers = list({h._dispatcher: None for h in handles if not h.in_process})

    def discard_lost(self) -> list[WorkerHandle]:
        """Take out the workers whose rank the driver has declared lost; return them (often
        none). The group then holds only live workers, and indices shift down."""
        # The losses the heartbeat reported since the last poll. Not a poll itself: a poll
        # costs rank 0 7-15 us here when its caches are cold (benchmarks/poll_cost.py), and the
        # callers have just waited, which polled; a loss MPI reports comes at the next wait.
        for dispatcher in self._dispatchers:
            dispatcher.take_reported_losses()
        # Asked after every wait of the asynchronous loops (IMPALA's: several per iteration):
        # a look at each worker would cost rank 0 O(workers) each time, with no rank lost.
        if not any(dispatcher.lost for dispatcher in self._dispatchers):
            return []
        gone = [h for h in self._handles if h.lost]
        if gone:
            self._handles = [h for h in self._handles if not h.lost]
            self.lost.extend(gone)
        return gone

    def progress(self) -> None:
        """Take every answer that has arrived for the calls of any worker, without waiting."""
        for dispatcher in self._dispatchers:
            dispatcher.progress()

    def call_async(self, method: str, *args: Any, **kwargs: Any) -> list[Future]:
        """Start the same call on every worker; one future per worker, in worker order."""
        return call_all(self._handles, method, *args, **kwargs)

    def call(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> list:
        """Run the call on every worker and return the results in worker order."""
        futures = self.call_async(method, *args, **kwargs)
        return [f.result(timeout) for f in futures]

    @property
    def ranks(self) -> list[int]:
        return [h.rank for h in self._handles]

    def __getitem__(self, index):  # type: ignore[override]
        return self._handles[index]

    def __len__(self) -> int:
        return len(self._handles)

    def __iter__(self) -> Iterator[WorkerHandle]:
        return iter(self._handles)

    def __repr__(self) -> str:
        return f"<WorkerGroup {self.cls.__name__} x{len(self)} ({self.role})>"


def call_all(handles: Sequence[WorkerHandle], method: str, *args: Any,
             **kwargs: Any) -> list[Future]:
    """``method(*args, **kwargs)`` on each of ``handles``; one future each, in order. Workers
    on ranks of their own that share one object id get it through one
    ``Dispatcher.submit_many``: the task is pickled once for all of them."""
    remote = [h for h in handles if not h.in_process]
    if len(remote) < 2 or not _one_object_per_rank(remote):
        return [h.call_async(method, *args, **kwargs) for h in handles]
    if method not in remote[0]._messages:
        remote[0].call_async(method)  # raises, naming the messages it does answer
    sent = iter(remote[0]._dispatcher.submit_many(
        [h.rank for h in remote], remote[0].object_id, method, args, kwargs))
    return [h.call_async(method, *args, **kwargs) if h.in_process else next(sent)
            for h in handles]


def _one_object_per_rank(handles: list[WorkerHandle]) -> bool:
    """Whether ``handles`` name one object (id) through one dispatcher, each on its own rank:
    what ``submit_many`` sends to."""
    first = handles[0]
    return (all(h.object_id == first.object_id and h._dispatcher is first._dispatcher
                for h in handles)
            and len({h.rank for h in handles}) == len(handles))


_LOCAL_CALL_IDS = iter(range(1, 1 << 62))


def _run_local(obj: Any, role: str, method: str, args: tuple, kwargs: dict) -> Future:
    future = Future(None, next(_LOCAL_CALL_IDS), 0, role, method)
    began, idle = time.thread_time(), DRIVER_CPU.idle_s
    try:
        future._resolve(True, getattr(obj, method)(*args, **kwargs))
    except Exception as error:  # noqa: BLE001 - reported like a remote failure
        future._resolve(False, describe_exception(error))
    finally:
        # Its waits for the other members of a collective count as idle, not as hosted work.
        DRIVER_CPU.hosted_s += time.thread_time() - began - (DRIVER_CPU.idle_s - idle)
    return future


def describe_exception(error: BaseException) -> tuple[str, str, str]:
    """``(qualified type name, message, formatted traceback)`` of an exception being handled."""
    cls = type(error)
    name = cls.__qualname__
    if cls.__module__ != "builtins":
        name = f"{cls.__module__}.{name}"
    return name, str(error), traceback.format_exc()
