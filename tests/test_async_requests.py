"""The driver's work per answer in the asynchronous plans (IMPALA, A3C) is O(1) in the rollout
ranks: an answer tops up only its own worker, and the look at the calls after ``wait`` does not
poll once per unanswered call. Fake workers and a fake dispatcher count what the driver does."""

from __future__ import annotations

from typing import Any

from mpirl.execution.async_ops import AsyncRequests
from mpirl.runtime.dispatch import Future


class FakeDispatcher:
    """Answers the calls listed in ``arrivals`` when the driver waits; counts its polls."""

    def __init__(self) -> None:
        self.polls = 0
        self.arrivals: list[Future] = []

    def progress(self) -> bool:
        self.polls += 1
        return False

    def wait_for(self, condition, timeout, waiting_on, raise_on_timeout=True) -> bool:
        self.polls += 1
        for future in self.arrivals:
            future._resolve(True, {"env_steps": 1})
        self.arrivals = []
        assert condition()
        return True


class FakeWorker:
    lost = False
    in_process = False

    def __init__(self, index: int, dispatcher: FakeDispatcher) -> None:
        self.index, self.rank, self.dispatcher = index, index + 1, dispatcher
        self.calls: list[Future] = []

    def call_async(self, method: str, *args: Any) -> Future:
        future = Future(self.dispatcher, len(self.calls), self.rank, "rollout", method)
        self.calls.append(future)
        return future


class FakeGroup(list):
    def discard_lost(self) -> bool:
        return False


def make(workers: int, in_flight: int = 1) -> tuple[AsyncRequests, list[FakeWorker],
                                                    FakeDispatcher]:
    dispatcher = FakeDispatcher()
    rollouts = FakeGroup(FakeWorker(i, dispatcher) for i in range(workers))
    return AsyncRequests(rollouts, "sample", in_flight, lambda w: ()), rollouts, dispatcher


def test_an_answer_tops_up_its_own_worker_and_polls_once():
    requests, workers, dispatcher = make(64, in_flight=2)
    requests.top_up()
    assert [len(w.calls) for w in workers] == [2] * 64
    dispatcher.arrivals = [workers[5].calls[0]]
    done = requests.ready()
    assert [item.worker.index for item in done] == [5]
    # One poll (the wait), not one per unanswered call.
    assert dispatcher.polls == 1
    requests.top_up()
    assert [len(w.calls) for w in workers] == [2] * 5 + [3] + [2] * 58
    # A second top up without an answer sends nothing.
    requests.top_up()
    assert sum(len(w.calls) for w in workers) == 129


def test_after_a_drain_every_worker_is_topped_up_again():
    requests, workers, dispatcher = make(4, in_flight=1)
    requests.top_up()
    for worker in workers:
        worker.calls[-1]._resolve(True, {"env_steps": 1})
    assert len(requests.drain()) == 4
    requests.top_up()
    assert [len(w.calls) for w in workers] == [2, 2, 2, 2]


def test_a_lost_worker_is_not_topped_up():
    requests, workers, dispatcher = make(3, in_flight=1)
    requests.top_up()
    workers[1].lost = True
    dispatcher.arrivals = [workers[1].calls[0], workers[2].calls[0]]
    requests.ready()
    requests.top_up()
    assert [len(w.calls) for w in workers] == [1, 1, 2]
