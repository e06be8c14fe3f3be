"""Answers through a gather: the calls of one synchronous round (PPO's sampling, an ES
generation) each answer rank 0 in a ``Gatherv`` over weights_comm, rooted at learner 0, instead
of a message each. Rank 0 then takes one message per round (learner 0's answer, or nothing when
learner 0 is in its process), not one per rollout rank.

A worker method answers with ``answer_through_gather``; learner 0, called in the same round,
collects with ``gather_answers``; the driver settles each call's future from what learner 0
returns (``Future.settle``). The host sends no answer for a method that returned ``ANSWERED``.
A call that raises still joins the gather, with no result, and then answers its error as usual.
Under ULFM the rounds keep an answer per call, which tells the lost ranks apart.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from mpirl.runtime.ulfm import fault_tolerant, gather_bytes

if TYPE_CHECKING:
    from mpirl.runtime.core import RankContext


class _Answered:
    def __repr__(self) -> str:
        return "ANSWERED"


ANSWERED = _Answered()
"""What a worker method returns when its answer went to rank 0 through the gather."""

_WHAT = "the gather of the answers"
ROOT_BACKOFF = (4e-3, 0.0)
"""How learner 0 polls while it waits for the round's last answer: sleeps of at most 4 ms. It
waits the whole round, and sleeps that grow with the wait (``poll_sleep_share``) could see the
last answer up to 16 ms late, 1.6% of a 1 s round. Over a 1 s round this wakes about as often
(some 250 times)."""


def gathers_answers(workers: Iterable[Any]) -> bool:
    """Whether a round of calls to ``workers`` (handles) answers through the gather: they have
    ranks of their own, and MPI does not report process failures (under ULFM each answer must
    come on its own, to tell a lost rank apart)."""
    return not fault_tolerant() and not all(worker.in_process for worker in workers)


def answer_through_gather(context: RankContext, run: Callable[[], Any]) -> Any:
    """Run ``run()`` and hand its result to learner 0's ``gather_answers`` (on weights_comm);
    return ``ANSWERED``. If ``run`` raises, join the gather with no result, then raise."""
    try:
        result = run()
    except Exception:
        _send(context, None)
        raise
    _send(context, result)
    return ANSWERED


def _send(context: RankContext, result: Any) -> None:
    gather_bytes(context.weights_comm, pickle.dumps((context.rank, result), protocol=5),
                 context.collective_timeout_s, _WHAT, context.collective_backoff)


def gather_answers(context: RankContext) -> list[bytes]:
    """On learner 0 (weights_comm's rank 0): every other member's pickled ``(rank, result)``,
    result None for a call that raised; pass them to ``decode_answers`` on the driver."""
    parts = gather_bytes(context.weights_comm, b"", context.collective_timeout_s, _WHAT,
                         ROOT_BACKOFF)
    return parts[1:]


def decode_answers(parts: list[bytes]) -> dict[int, Any]:
    """{rank: result} of what ``gather_answers`` returned; None for a call that raised."""
    return dict(pickle.loads(part) for part in parts)
