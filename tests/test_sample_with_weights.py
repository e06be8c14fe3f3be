"""``sample_with_new_weights``: the weight broadcast and the sampling in one call to each rollout
worker, and what it does when a rank's death breaks the broadcast. The MPI side (a real kill -9
under ULFM) is in test_ulfm; here fake workers make each path happen every time."""

from __future__ import annotations

from typing import Any

import pytest

from mpirl.errors import EnvFailureError, ProcessFailure, RankLost, RemoteError
from mpirl.execution import operators
from mpirl.execution.operators import sample_with_new_weights as sample_in_calls
from mpirl.runtime.gathered import encode_answer
from mpirl.workers.delivery import BROADCAST, Gathered, ToLearnerOf, ToRank


def sample_with_new_weights(*args, **kwargs):
    """The point-to-point path (each answer on its own), which runs under ULFM."""
    return sample_in_calls(*args, gather=False, **kwargs)

PROCESS_FAILURE = f"{ProcessFailure.__module__}.{ProcessFailure.__qualname__}"
ENV_FAILURE = f"{EnvFailureError.__module__}.{EnvFailureError.__qualname__}"


class FakeFuture:
    def __init__(self, value: Any = None, error: Exception | None = None) -> None:
        self.value, self.error = value, error

    def result(self, timeout: float | None = None) -> Any:
        if self.error is not None:
            raise self.error
        return self.value

    def done(self) -> bool:
        return True

    def settle(self, value: Any) -> None:
        self.value = value


class FakeWorker:
    """A rollout (or learner) handle whose calls answer from a script: ``answers[i]`` is what
    its i-th call gives (a value, or an exception to raise)."""

    in_process = False
    _dispatcher = dispatcher = None

    def __init__(self, rank: int, answers: list[Any], index: int | None = None) -> None:
        self.rank, self.answers, self.calls, self.lost = rank, list(answers), [], False
        # Its place in its group (rank - 1: rollout ranks follow rank 0), and an object id of
        # its own, so that a call to several fakes reaches each through its call_async.
        self.index = rank - 1 if index is None else index
        self.object_id = rank

    def call_async(self, method: str, *args: Any, **kwargs: Any) -> FakeFuture:
        self.calls.append((method, args, kwargs))
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            return FakeFuture(error=answer)
        return FakeFuture(answer)


def metrics(steps: int, episode_return: float) -> dict[str, Any]:
    return {"env_steps": steps, "env_failures": 0, "episode_returns": [episode_return],
            "episode_lengths": [steps], "filter_delta": None}


def broken(rank: int) -> RemoteError:
    return RemoteError(rank, "rollout", "sample", PROCESS_FAILURE, "peer died in Bcast", "")


@pytest.fixture
def repairs(monkeypatch):
    """Records the comm repairs and plain broadcasts the operator asks for."""
    log: list[str] = []
    monkeypatch.setattr(operators, "discard_lost_rollouts", lambda learners, rollouts: False)
    monkeypatch.setattr(operators, "_repair_weights_comm", lambda *groups: log.append("repair"))
    monkeypatch.setattr(operators, "broadcast_weights", lambda *groups: log.append("broadcast"))
    return log


def test_one_call_per_worker_takes_the_weights_then_samples(repairs):
    learner = FakeWorker(0, [None])
    rollouts = [FakeWorker(r, [metrics(10 * r, float(r))]) for r in (1, 2, 3)]
    result = sample_with_new_weights(rollouts, [learner], 5)
    assert learner.calls == [("broadcast_weights", (), {})]
    for worker in rollouts:
        assert worker.calls == [("sample", (5, None, ToRank(0)), {"weights": BROADCAST})]
    assert result.env_steps == 60 and result.episode_returns == [1.0, 2.0, 3.0]
    assert result.sources == {0: [1, 2, 3]} and repairs == []


def test_a_broken_broadcast_is_repaired_and_only_the_unsampled_workers_sample_again(repairs):
    learner = FakeWorker(0, [broken(0)])
    rollouts = [FakeWorker(1, [metrics(10, 1.0)]),
                FakeWorker(2, [broken(2), metrics(20, 2.0)]),
                FakeWorker(3, [metrics(30, 3.0)])]
    result = sample_with_new_weights(rollouts, [learner], 5)
    assert repairs == ["repair", "broadcast"]
    assert [len(w.calls) for w in rollouts] == [1, 2, 1]
    assert rollouts[1].calls[1] == ("sample", (5, None, ToRank(0)), {})  # the weights came
    assert result.env_steps == 60 and sorted(result.episode_returns) == [1.0, 2.0, 3.0]
    assert sorted(result.sources[0]) == [1, 2, 3]


def test_a_lost_rank_is_left_out_without_a_repair(repairs):
    learner = FakeWorker(0, [None])
    rollouts = [FakeWorker(1, [metrics(10, 1.0)]), FakeWorker(2, [RankLost("lost", 2)])]
    result = sample_with_new_weights(rollouts, [learner], 5)
    assert result.env_steps == 10 and result.sources == {0: [1]} and repairs == []


def test_an_environment_failure_is_reported_as_itself(repairs):
    learner = FakeWorker(0, [None])
    failure = RemoteError(1, "rollout", "sample", ENV_FAILURE, "env raised 3 times", "")
    with pytest.raises(EnvFailureError, match="env raised 3 times"):
        sample_with_new_weights([FakeWorker(1, [failure])], [learner], 5)


def test_batches_go_to_learner_i_mod_l(repairs):
    learners = [FakeWorker(5, [None]), FakeWorker(6, [])]
    rollouts = [FakeWorker(r, [metrics(1, 0.0)]) for r in (1, 2, 3)]
    result = sample_with_new_weights(rollouts, learners, 5)
    assert [w.calls[0][1][2] for w in rollouts] == [ToRank(5), ToRank(6), ToRank(5)]
    assert result.sources == {0: [1, 3], 1: [2]}


# The gathered path: learner 0 hands the driver every rollout rank's answer at once.


def gathered(*answers: tuple[int, Any]) -> list[bytes]:
    return [encode_answer(rank, result) for rank, result in answers]


def test_gathered_answers_settle_every_call_in_worker_order(repairs):
    rollouts = [FakeWorker(r, [None]) for r in (1, 2, 3)]
    # The gather's order is weights_comm's, not the workers'.
    learner = FakeWorker(0, [gathered((3, metrics(30, 3.0)), (1, metrics(10, 1.0)),
                                      (2, metrics(20, 2.0)))])
    result = sample_in_calls(rollouts, [learner], 5, gather=True)
    assert learner.calls == [("broadcast_weights", (), {"gather_answers": True})]
    # One call for all (rank 0 pickles it once): each worker picks its learner by its index.
    for worker in rollouts:
        assert worker.calls == [("sample", (5, None, Gathered(ToLearnerOf((0,)), rides=True)),
                                 {"weights": BROADCAST})]
    assert result.env_steps == 60 and result.episode_returns == [1.0, 2.0, 3.0]
    assert result.sources == {0: [1, 2, 3]} and repairs == []


def test_workers_out_of_index_order_get_their_learner_in_their_own_call(repairs):
    # Handles whose index is not their place (a group after a loss): each call names its
    # learner, chosen by place, as the driver's bookkeeping expects.
    rollouts = [FakeWorker(1, [None], index=0), FakeWorker(3, [None], index=2)]
    learners = [FakeWorker(0, [gathered((1, metrics(10, 1.0)), (3, metrics(30, 3.0)))]),
                FakeWorker(2, [], index=1)]
    result = sample_in_calls(rollouts, learners, 5, gather=True)
    assert [w.calls for w in rollouts] == [
        [("sample", (5, None, Gathered(ToRank(rank), rides=False)), {"weights": BROADCAST})]
        for rank in (0, 2)]
    assert result.sources == {0: [1], 1: [3]} and result.env_steps == 40


def test_batches_for_the_drivers_own_learner_come_in_the_gather(repairs):
    rollouts = [FakeWorker(r, [None]) for r in (1, 2, 3)]
    learner = FakeWorker(0, [gathered((1, metrics(10, 1.0) | {"batch": "b1"}),
                                      (2, metrics(20, 2.0)),  # too large: sent to the learner
                                      (3, metrics(30, 3.0) | {"batch": "b3"}))])
    learner.in_process = True
    result = sample_in_calls(rollouts, [learner], 5, gather=True)
    assert all(w.calls[0][1][2].rides for w in rollouts)
    assert result.batches == {0: ["b1", "b3"]} and result.sources == {0: [2]}


def test_a_call_that_raised_is_read_from_its_own_answer(repairs):
    failure = RemoteError(2, "rollout", "sample", ENV_FAILURE, "env raised 3 times", "")
    rollouts = [FakeWorker(1, [None]), FakeWorker(2, [failure])]
    learner = FakeWorker(0, [gathered((1, metrics(10, 1.0)), (2, None))])
    with pytest.raises(EnvFailureError, match="env raised 3 times"):
        sample_in_calls(rollouts, [learner], 5, gather=True)


def test_a_failed_gather_is_raised(repairs):
    timeout = RemoteError(0, "learner", "broadcast_weights", "mpirl.errors.TaskTimeout",
                          "the gather of the sample answers: not all 3 members arrived", "")
    learner = FakeWorker(0, [timeout])
    with pytest.raises(RemoteError, match="not all 3 members"):
        sample_in_calls([FakeWorker(1, [None]), FakeWorker(2, [None])], [learner], 5,
                        gather=True)
