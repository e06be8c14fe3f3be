"""Waiting without spinning a core, and with a deadline.

Idle ranks poll with ``Backoff`` (a blocking MPI wait burns a whole core, and a job may have
fewer cores than ranks). ``wait_for_all`` bounds the wait for the other members of a
collective: MPI cannot cancel a collective once begun, so it gets its deadline from a barrier
with a deadline just before it.
"""

from __future__ import annotations

import os
import time

from mpi4py import MPI

from mpirl.errors import TaskTimeout

__all__ = ["Backoff", "wait_for_all"]

COARSE_UNTIL_SHARE = 0.8
"""``wait_for_all`` with ``expected_s``: sleeps are coarse until this share of it has passed."""
COARSE_SLEEP_SHARE = 0.02
"""... and each coarse sleep is at most this share of it: a wait that ends early is seen at most
2% of the expected time late."""


def wait_for_all(comm: MPI.Comm, timeout_s: float, what: str,
                 backoff: tuple[float, float] | None = None, expected_s: float = 0.0) -> None:
    """Return once every member of ``comm`` has called this; raise ``TaskTimeout`` naming
    ``what`` if they have not within ``timeout_s``. Collective over ``comm``.

    An ``Ibarrier`` waited on with back-off, so no core spins. Called just before a blocking
    collective it gives that collective a deadline: once all members are there, none waits on a
    member that is busy elsewhere (MPI cannot cancel a collective once begun, so the wait is
    bounded before it starts). ``backoff`` is ``(max_sleep_s, sleep_share)`` (``Backoff``); on
    rank 0 its sleeps count as the driver's idle time (``DRIVER_CPU``).

    ``expected_s``, how long such a wait has lately taken, lets the waiter poll rarely where the
    end cannot be (``COARSE_UNTIL_SHARE``, ``COARSE_SLEEP_SHARE``): the root of a 1 s round then
    wakes about 90 times, not about 360, and each wake costs 7-15 us of CPU here, mostly for its
    cold caches (``benchmarks/poll_cost.py``).
    """
    request = comm.Ibarrier()
    if request.Test():
        return
    now = time.monotonic()
    deadline = now + timeout_s
    coarse_until = now + COARSE_UNTIL_SHARE * expected_s
    coarse_sleep = COARSE_SLEEP_SHARE * expected_s
    waiting = Backoff() if backoff is None else Backoff(max_sleep_s=backoff[0],
                                                        sleep_share=backoff[1])
    while True:
        began = time.thread_time()
        if request.Test():
            return
        now = time.monotonic()
        if now > deadline:
            raise TaskTimeout(f"{what}: not all {comm.Get_size()} members arrived within "
                              f"{timeout_s:g} s")
        if now < coarse_until:
            time.sleep(min(coarse_sleep, coarse_until - now))
        else:
            waiting.sleep()
        DRIVER_CPU.idle_s += time.thread_time() - began


class CpuLedger:
    """CPU seconds of the thread that drives (rank 0's), by what they went to: ``idle_s`` in polls
    that found nothing (the waits of ``Dispatcher.wait_for``, sleeps included) and ``hosted_s``
    in the methods of worker objects that live in its process (a learner on rank 0). The rest of
    that thread's CPU is the driver's own work: dispatching, taking answers, merging metrics.
    Process-local; read by ``Driver.perf_report``."""

    __slots__ = ("idle_s", "hosted_s")

    def __init__(self) -> None:
        self.idle_s = 0.0
        self.hosted_s = 0.0


DRIVER_CPU = CpuLedger()


LONGEST_SLEEP_S = 0.016
"""The longest sleep a long wait grows to (``Backoff.sleep_share``)."""


class Backoff:
    """Waiting between polls without spinning a core.

    Right after activity it polls for ``spin_s``, yielding the core between polls, then sleeps,
    doubling from ``min_sleep_s`` up to ``max_sleep_s``. An idle rank thus wakes at most
    ``1 / max_sleep_s`` times a second. With ``sleep_share`` a long wait sleeps longer: up to
    that share of the time waited so far (at most ``LONGEST_SLEEP_S``), so that a wait of t
    seconds ends at most ``t * sleep_share`` late. Each wake-up costs 10-20 us of CPU here (the
    sleep's system call and context switches): at 1/64 a wait of 1 s wakes about 240 times, not
    1,000.

    ``spin_s`` must exceed the peer's longest sleep. Otherwise two ranks in a conversation fall
    into a stable slow state: a reply that arrives after the peer's spin window finds it asleep,
    its late answer finds this rank asleep, and so on. That was measured here at 2-3 ms per round
    trip with a 0.2 ms window, against 10 us when both stay within the window. The growth with
    ``sleep_share`` starts only after a wait of ``max_sleep_s / sleep_share`` (64 ms at 1 ms and
    1/64), longer than any round trip of a conversation.
    """

    __slots__ = ("spin_s", "min_sleep_s", "max_sleep_s", "sleep_share", "_since", "_sleep")

    def __init__(
        self, spin_s: float = 2e-3, min_sleep_s: float = 5e-5, max_sleep_s: float = 1e-3,
        sleep_share: float = 0.0,
    ) -> None:
        self.spin_s = spin_s
        self.min_sleep_s = min_sleep_s
        self.max_sleep_s = max_sleep_s
        self.sleep_share = sleep_share
        self.reset()

    def reset(self) -> None:
        """Call after activity: the next polls spin again."""
        self._since = time.perf_counter()
        self._sleep = 0.0

    def sleep(self) -> None:
        """Call after a poll that found nothing."""
        if self._sleep == 0.0:
            if time.perf_counter() - self._since < self.spin_s:
                # Yield, don't just spin: with more ranks than cores the rank we wait for may
                # share this core, and a bare spin would hold it for a whole scheduler slice.
                os.sched_yield()
                return
            self._sleep = self.min_sleep_s
        time.sleep(self._sleep)
        longest = self.max_sleep_s
        if self.sleep_share:
            waited = time.perf_counter() - self._since
            longest = max(longest, min(LONGEST_SLEEP_S, waited * self.sleep_share))
        self._sleep = min(longest, self._sleep * 2)


def reduce_timer_slack() -> None:
    """Ask Linux for 1 us timer slack on this process (default 50 us), so short sleeps between
    polls last about what they ask for. Elsewhere, or if the call fails, nothing changes."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, in nanoseconds
    except (OSError, AttributeError):
        pass
