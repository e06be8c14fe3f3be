"""Standing sample rounds: PPO's and A2C's synchronous sampling with no call per rollout rank
per iteration.

In a gathered round (``sample_with_new_weights``) rank 0 sends each rollout rank a ``sample``
call, then learner 0 broadcasts its weights and gathers the answers. Under ``mpirl train`` the
calls stand instead: each rollout rank runs one ``sample_rounds`` call, in which it waits for
learner 0's broadcast of a round header (the steps to take, the observation filter) and the
weights, samples, and answers through the gather, round after round. Rank 0 then starts a round
with one call to learner 0, its own object when the learner shares its process, and sends the
rollout ranks nothing per iteration.

The calls hold their ranks (``Dispatcher.hold``): any other call to one of them, a checkpoint
(``Algorithm.settle``) or the end of the run first ends the rounds with an empty header and
takes the calls' answers. A round whose sampling raised on a rank ends the rounds at once, and
that rank's error is raised. Under ULFM the rounds keep a call per rank each iteration, as
gathered rounds do.
"""

from __future__ import annotations

import pickle
from typing import Any

from mpirl.errors import RemoteError
from mpirl.runtime.dispatch import WorkerGroup, WorkerHandle, call_all
from mpirl.runtime.gathered import decode_answers


def rounds_may_stand(workers: list[WorkerHandle]) -> bool:
    """Whether ``workers`` (rollout workers on ranks of their own) may keep standing rounds:
    the run allows standing calls (``Dispatcher.standing_calls``)."""
    dispatcher = workers[0].dispatcher
    return (dispatcher is not None and dispatcher.standing_calls
            and all(not w.in_process for w in workers))


class SampleRounds:
    """The standing ``sample_rounds`` calls of ``workers``, whose batches go to ``learners``
    (worker i's to learner i mod L), started by learner 0."""

    def __init__(self, workers: list[WorkerHandle], learners: WorkerGroup) -> None:
        self.workers = workers
        self.learner = learners[0]
        self.learner_ranks = tuple(learner.rank for learner in learners)
        self.ranks = [worker.rank for worker in workers]
        self._index_of = {rank: i for i, rank in enumerate(self.ranks)}
        self._dispatcher = workers[0].dispatcher
        self._futures = call_all(workers, "sample_rounds", self.learner_ranks,
                                 batch_in_answer=True)
        self._dispatcher.hold(self)

    @classmethod
    def of(cls, workers: list[WorkerHandle], learners: WorkerGroup) -> SampleRounds:
        """The rounds standing on ``workers`` for ``learners``; started if there are none.
        Other calls standing on those ranks end first."""
        held = workers[0].dispatcher.holder(workers[0].rank)
        if (isinstance(held, SampleRounds) and held.learner is learners[0]
                and held.ranks == [w.rank for w in workers]
                and held.learner_ranks == tuple(learner.rank for learner in learners)):
            return held
        return cls(workers, learners)

    def next_round(self, steps_per_env: int, filter_state: tuple | None) -> dict[int, Any]:
        """Run one round: ``{worker index: what its sample() returned}``. Raises the error of
        a worker whose sampling raised, after ending the rounds."""
        header = pickle.dumps((steps_per_env, filter_state), protocol=5)
        parts = self.learner.call_async("broadcast_weights", gather_answers=True,
                                        round_header=header).result()
        answers = decode_answers(parts)
        answered = {self._index_of[rank]: value for rank, value in answers.items()
                    if value is not None}
        if len(answered) < len(self.ranks):
            self._dispatcher.release(self.ranks[0])  # raises the failed rank's error
            missing = sorted(set(self.ranks) - {self.ranks[i] for i in answered})
            raise AssertionError(f"ranks {missing} answered no round and raised nothing")
        return answered

    def end(self) -> None:
        """End the rounds (an empty header from learner 0) and take every call's answer; the
        first error among them is raised."""
        self.learner.call("end_rounds")
        error: RemoteError | None = None
        for future in self._futures:
            try:
                future.result()
            except RemoteError as failure:
                error = error or failure
        if error is not None:
            raise error
