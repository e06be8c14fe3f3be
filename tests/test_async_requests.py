"""The driver's work per answer in the asynchronous plans (IMPALA, A3C) is O(1) in the rollout
ranks: an answer tops up only its own worker, and the look at the calls after ``wait`` does not
poll once per unanswered call. Fake workers and a fake dispatcher count what the driver does."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from mpirl.errors import RankLost
from mpirl.execution import async_ops
from mpirl.execution.async_ops import AsyncRequests
from mpirl.runtime.dispatch import Completions, Future


class FakeDispatcher:
    """Answers the calls listed in ``arrivals`` when the driver waits, after ``empty_turns``
    polls that find nothing; counts its polls."""

    def __init__(self) -> None:
        self.polls = 0
        self.empty_turns = 0
        self.arrivals: list[Future] = []

    def progress(self) -> bool:
        self.polls += 1
        return False

    def wait_for(self, condition, timeout, waiting_on, raise_on_timeout=True) -> bool:
        self.polls += 1
        for _ in range(self.empty_turns):
            assert not condition()
        for future in self.arrivals:
            future._resolve(True, {"env_steps": 1})
        self.arrivals = []
        assert condition()
        return True


class CountingFuture(Future):
    """Counts every look at whether it is done: the driver's work per poll."""

    looks = 0

    @property
    def _done(self) -> bool:
        CountingFuture.looks += 1
        return self._finished

    @_done.setter
    def _done(self, value: bool) -> None:
        self._finished = value


class FakeWorker:
    lost = False
    in_process = False

    def __init__(self, index: int, dispatcher: FakeDispatcher) -> None:
        self.index, self.rank, self.dispatcher = index, index + 1, dispatcher
        self.calls: list[Future] = []

    def call_async(self, method: str, *args: Any, **kwargs: Any) -> Future:
        future = CountingFuture(self.dispatcher, len(self.calls), self.rank, "rollout", method)
        future.kwargs = kwargs
        self.calls.append(future)
        return future


class FakeGroup(list):
    def discard_lost(self) -> bool:
        return False


def make(workers: int, in_flight: int = 1, weights_in_calls: bool = False, args_key=None
         ) -> tuple[AsyncRequests, list[FakeWorker], FakeDispatcher]:
    dispatcher = FakeDispatcher()
    rollouts = FakeGroup(FakeWorker(i, dispatcher) for i in range(workers))
    return (AsyncRequests(rollouts, "sample", in_flight, lambda w: (), weights_in_calls,
                          args_key),
            rollouts, dispatcher)


@pytest.fixture
def group_calls(monkeypatch) -> list[tuple[list[int], dict]]:
    """The group calls AsyncRequests sends: (worker indices, keyword arguments) each."""
    sent = []

    def call_all(group, method, *args, **kwargs):
        sent.append(([w.index for w in group], kwargs))
        return [w.call_async(method, *args, **kwargs) for w in group]

    monkeypatch.setattr(async_ops, "call_all", call_all)
    return sent


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


def test_waiting_for_the_next_answer_does_not_look_at_every_call():
    requests, workers, dispatcher = make(64, in_flight=2)
    requests.top_up()
    dispatcher.empty_turns = 100
    dispatcher.arrivals = [workers[7].calls[1]]
    CountingFuture.looks = 0
    done = requests.ready()
    assert [item.worker.index for item in done] == [7]
    # 100 polls that found nothing, over 128 calls in flight: a condition that looked at each
    # call would look 12,800 times.
    assert CountingFuture.looks < 20


def test_completions_come_in_the_order_the_calls_finished():
    dispatcher = FakeDispatcher()
    completions = Completions()
    futures = [Future(dispatcher, i, 1, "rollout", "sample") for i in range(4)]
    done_already = Future(dispatcher, 9, 1, "rollout", "sample")
    done_already._resolve(True, None)
    completions.watch(done_already, "first")
    for i, future in enumerate(futures):
        completions.watch(future, i)
    with pytest.raises(ValueError, match="watched already"):
        completions.watch(futures[0], "again")
    assert completions.take() == ["first"] and completions.pending == 4
    futures[2]._resolve(True, None)
    futures[0]._fail(RankLost("lost", 1))  # a lost rank finishes its calls too
    assert completions.take_finished() == [2, 0]
    dispatcher.arrivals = [futures[3]]
    assert completions.take() == [3] and completions.pending == 1
    assert completions.take_finished() == []
    futures[1]._resolve(True, None)
    assert completions.take() == [1] and completions.pending == 0
    with pytest.raises(ValueError, match="no watched call"):
        completions.take()


@pytest.mark.parametrize("weights_in_calls", [False, True])
def test_new_weights_reach_a_worker_before_its_next_call(weights_in_calls):
    requests, workers, dispatcher = make(3, in_flight=2, weights_in_calls=weights_in_calls)
    requests.top_up()
    dispatcher.arrivals = [workers[1].calls[0]]
    (done,) = requests.ready()
    requests.version += 1
    requests.set_weights([done.worker], "w1")
    requests.top_up()
    methods = [call.method for call in workers[1].calls]
    if weights_in_calls:  # in the next call: one message, no answer to wait for
        assert methods == ["sample"] * 3
        assert [call.kwargs for call in workers[1].calls] == [{}, {}, {"weights": "w1"}]
    else:  # a call of its own, queued behind the call still running
        assert methods == ["sample", "sample", "set_weights", "sample"]
    assert all(call.kwargs == {} for w in (workers[0], workers[2]) for call in w.calls)
    # The next call's results are counted at the new version (policy lag 0).
    dispatcher.arrivals = [workers[1].calls[-1]]
    (done,) = requests.ready()
    assert done.version == 1


def test_the_workers_one_update_used_get_its_weights_in_one_group_call(group_calls):
    # IMPALA's workers that feed one learner take equal calls: those whose fragments one
    # update used go out as one call pickled once, not one per worker.
    requests, workers, dispatcher = make(6, in_flight=2, weights_in_calls=True,
                                         args_key=lambda worker: worker.index % 2)
    requests.top_up()
    assert group_calls == [([0, 2, 4], {}), ([1, 3, 5], {}), ([0, 2, 4], {}), ([1, 3, 5], {})]
    group_calls.clear()
    dispatcher.arrivals = [workers[i].calls[0] for i in (1, 3, 4)]
    done = requests.ready()
    requests.version += 1
    requests.set_weights([item.worker for item in done], "w1")
    requests.top_up()
    assert group_calls == [([1, 3], {"weights": "w1"}), ([4], {"weights": "w1"})]
    assert [len(w.calls) for w in workers] == [2, 3, 2, 3, 3, 2]


def test_a_worker_whose_calls_all_finished_is_topped_up_once(group_calls):
    requests, workers, dispatcher = make(3, in_flight=2)
    requests.top_up()
    dispatcher.arrivals = [workers[1].calls[0], workers[1].calls[1]]
    assert [item.worker.index for item in requests.ready()] == [1, 1]
    requests.top_up()
    assert [len(w.calls) for w in workers] == [2, 4, 2]
    assert requests.metrics()["requests_in_flight"] == 6


def test_merged_sample_metrics_equal_one_call_over_all_the_steps():
    """A ``sample_fragments`` answer sums its fragments' metrics: counts added, episodes joined
    in order, observation statistics merged as if one call had seen every step."""
    from mpirl.models.statistics import RunningMeanStd
    from mpirl.workers.rollout import merge_sample_metrics

    rng = np.random.default_rng(0)
    seen = [rng.normal(i, 1.0 + i, size=(50, 3)) for i in range(3)]
    answers = []
    for i, obs in enumerate(seen):
        delta = RunningMeanStd((3,))
        delta.update(obs)
        answers.append({"env_steps": 50, "env_failures": i, "episode_returns": [float(i)],
                        "episode_lengths": [10 + i], "filter_delta": delta.state(),
                        "dumped": ("rollout-1.h5", [(i, 10 + i)])})
    total = answers[0]
    for more in answers[1:]:
        total = merge_sample_metrics(total, more)
    assert total["env_steps"] == 150 and total["env_failures"] == 3
    assert total["episode_returns"] == [0.0, 1.0, 2.0]
    assert total["episode_lengths"] == [10, 11, 12]
    assert total["dumped"] == ("rollout-1.h5", [(0, 10), (1, 11), (2, 12)])
    whole = RunningMeanStd((3,))
    whole.update(np.concatenate(seen))
    mean, var, count = total["filter_delta"]
    assert count == 150
    np.testing.assert_allclose(mean, whole.mean)
    np.testing.assert_allclose(var, whole.var)
