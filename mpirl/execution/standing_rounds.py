"""Standing rounds: synchronous rounds (PPO's and A2C's sampling, an ES generation) with no
call per rollout rank per iteration.

In a gathered round (``mpirl.runtime.gathered``) rank 0 sends each rollout rank a call, then
learner 0 (or the driver's copy of the weights, for ES) starts the round's collectives and the
answers come back as one. Under ``mpirl train`` the calls stand instead: each rollout rank runs
one call (``sample_rounds``, ``generation_rounds``) in which it waits for learner 0's
broadcast of a round header (what to do this round) and the weights, takes part in the round,
and waits for the next (``gathered.serve_rounds``). Rank 0 then starts a round with one call to
learner 0, its own object when the learner shares its process, and sends the rollout ranks
nothing per iteration.

The calls hold their ranks (``Dispatcher.hold``): any other call to one of them, a checkpoint
(``Trainer.settle``) or the end of the run first ends the rounds with an empty header and
takes the calls' answers. A round that failed on a rank ends the rounds at once, and that rank's
error is raised. A collective over weights_comm started some other way must call the rollout
ranks first (as ``weights_comm_collective`` does), which ends the rounds. Under ULFM each round
keeps a call per rank, which tells the lost ranks apart.
"""

from __future__ import annotations

from typing import Any, NoReturn

from mpirl.errors import RemoteError
from mpirl.runtime.dispatch import WorkerHandle, call_all

__all__ = ["StandingRounds", "rounds_may_stand"]


def rounds_may_stand(workers: list[WorkerHandle]) -> bool:
    """Whether ``workers`` (rollout workers on ranks of their own) may keep standing rounds:
    the run allows standing calls (``Dispatcher.standing_calls``)."""
    dispatcher = workers[0].dispatcher
    return (dispatcher is not None and dispatcher.standing_calls
            and all(not w.in_process and not w.shares_rank for w in workers))


class StandingRounds:
    """``method(*args)`` standing on each of ``workers``, its rounds started by ``learner``."""

    def __init__(self, workers: list[WorkerHandle], learner: WorkerHandle, method: str,
                 args: tuple) -> None:
        self.learner = learner
        self.key = (method, args)
        self.ranks = [worker.rank for worker in workers]
        #: rank -> its worker's index in ``workers``
        self.index_of = {rank: i for i, rank in enumerate(self.ranks)}
        self._dispatcher = workers[0].dispatcher
        self._futures = call_all(workers, method, *args)
        self._dispatcher.hold(self)

    @classmethod
    def of(cls, workers: list[WorkerHandle], learner: WorkerHandle, method: str,
           *args: Any) -> StandingRounds:
        """The rounds of ``method(*args)`` standing on ``workers``; started if there are none.
        Other calls standing on those ranks end first."""
        held = workers[0].dispatcher.holder(workers[0].rank)
        if (isinstance(held, StandingRounds) and held.learner is learner
                and held.key == (method, args) and held.ranks == [w.rank for w in workers]):
            return held
        return cls(workers, learner, method, args)

    def start(self, learner_method: str, header: Any, **kwargs: Any) -> Any:
        """Run one round: learner's ``learner_method(round_header=header, **kwargs)``, which
        broadcasts ``header`` to the standing calls; its result."""
        return self.learner.call_async(learner_method, round_header=header, **kwargs).result()

    def failed(self, missing: list[int]) -> NoReturn:
        """The round brought no answer from the ranks ``missing``: end the rounds, which raises
        the error of a rank whose round failed."""
        self._dispatcher.release(self.ranks[0])
        raise AssertionError(f"ranks {missing} answered no round and raised nothing")

    def end(self) -> None:
        """End the rounds (an empty header from the learner) and take every call's answer; the
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
