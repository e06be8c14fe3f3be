"""Back-off between polls: a long wait sleeps longer, in proportion to how long it has waited,
so it wakes its rank less often and ends at most that share late."""

from __future__ import annotations

import time

import pytest

from mpirl.runtime import waiting
from mpirl.runtime.waiting import LONGEST_SLEEP_S, Backoff


def _sleeps(backoff: Backoff, seconds: float, monkeypatch) -> list[tuple[float, float]]:
    """(time waited, sleep asked) of every sleep of ``backoff`` polling for ``seconds`` of a
    fake clock that the sleeps advance."""
    clock = [1000.0]
    asked: list[tuple[float, float]] = []
    monkeypatch.setattr(waiting.time, "perf_counter", lambda: clock[0])

    def fake_sleep(duration: float) -> None:
        asked.append((clock[0] - 1000.0, duration))
        clock[0] += duration

    monkeypatch.setattr(waiting.time, "sleep", fake_sleep)
    monkeypatch.setattr(waiting.os, "sched_yield", lambda: clock.__setitem__(0, clock[0] + 1e-5))
    backoff.reset()
    while clock[0] - 1000.0 < seconds:
        backoff.sleep()
    return asked


def test_a_one_second_wait_wakes_about_240_times_instead_of_1000(monkeypatch):
    fixed = _sleeps(Backoff(), 1.0, monkeypatch)
    growing = _sleeps(Backoff(sleep_share=1 / 64), 1.0, monkeypatch)
    assert 950 < len(fixed) < 1010
    assert 150 < len(growing) < 300
    # Never later than the share of the time waited (or the usual 1 ms), never over the cap.
    for waited, duration in growing:
        assert duration <= max(1e-3, waited / 64) + 1e-9, (waited, duration)
        assert duration <= LONGEST_SLEEP_S
    assert max(d for _, d in growing) == pytest.approx(1 / 64, rel=0.05)


def test_a_conversation_never_sleeps_past_the_usual_cap(monkeypatch):
    # The first 64 ms of a wait behave as without the share: round trips stay fast.
    short = _sleeps(Backoff(sleep_share=1 / 64), 0.06, monkeypatch)
    assert max(d for _, d in short) <= 1e-3


def test_a_very_long_wait_is_capped(monkeypatch):
    long = _sleeps(Backoff(sleep_share=1 / 64), 5.0, monkeypatch)
    assert max(d for _, d in long) == LONGEST_SLEEP_S


def test_the_real_sleep_is_used_by_default():
    backoff = Backoff(spin_s=0.0, min_sleep_s=1e-3, max_sleep_s=1e-3, sleep_share=1 / 64)
    began = time.perf_counter()
    backoff.sleep()
    assert time.perf_counter() - began >= 9e-4


class _FakeBarrier:
    """A communicator whose ``Ibarrier`` completes once the fake clock passes ``done_at``; it
    counts the polls (each one an MPI progress over every peer, on a real communicator)."""

    def __init__(self, clock: list[float], done_at: float) -> None:
        self.clock, self.done_at, self.polls = clock, done_at, 0

    def Ibarrier(self):  # noqa: N802 (MPI's name)
        return self

    def Test(self) -> bool:  # noqa: N802
        self.polls += 1
        return self.clock[0] >= self.done_at

    def Get_size(self) -> int:  # noqa: N802
        return 64


def _wait(monkeypatch, round_s: float, expected_s: float) -> tuple[int, float]:
    """Polls and lateness of ``wait_for_all`` for a round that ends after ``round_s`` of a fake
    clock, expecting ``expected_s``, with a gather root's sleeps of at most 4 ms."""
    clock = [1000.0]
    for name in ("monotonic", "perf_counter"):
        monkeypatch.setattr(waiting.time, name, lambda: clock[0])
    monkeypatch.setattr(waiting.time, "sleep",
                        lambda duration: clock.__setitem__(0, clock[0] + duration))
    monkeypatch.setattr(waiting.os, "sched_yield", lambda: clock.__setitem__(0, clock[0] + 2e-5))
    comm = _FakeBarrier(clock, 1000.0 + round_s)
    waiting.wait_for_all(comm, 60.0, "a round", (4e-3, 0.0), expected_s)
    return comm.polls, clock[0] - 1000.0 - round_s


def test_a_root_that_expects_the_round_polls_rarely_until_it_may_end(monkeypatch):
    polls, late = _wait(monkeypatch, 1.0, 0.0)
    assert polls > 300 and late <= 4e-3
    # Expecting the round it gets: coarse sleeps over the first 80%, then the usual ones.
    polls, late = _wait(monkeypatch, 1.0, 1.0)
    assert polls < 110 and late <= 4e-3
    # A round much shorter than expected is seen at most 2% of the expected time late.
    polls, late = _wait(monkeypatch, 0.3, 1.0)
    assert polls < 25 and late <= 0.02 + 1e-9
