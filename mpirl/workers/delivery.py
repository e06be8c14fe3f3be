"""Where a rollout worker's batch goes, and which weights it samples with: chosen by the
operator that calls it (``mpirl.execution.operators``), never by flags of the worker's own.

Weights: ``KEEP`` the ones it holds, ``BROADCAST`` take part in learner 0's weight broadcast
first, or a flat array given in the call. Delivery: ``IN_ANSWER`` (the batch rides in the
call's answer: a worker in the driver's process, or a batch the driver hands on), ``ToRank``
(a learner rank, over the data channel), ``ToLearnerOf`` (learner ``i mod L`` of the ranks
given, for rollout worker i: one call for every worker), or ``Gathered`` (the answer goes to the
driver through learner 0's gather over the weights communicator, ``mpirl.runtime.gathered``; the
batch as its inner delivery says, or riding in the gather when small and meant for the
driver's own learner).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["Delivery", "IN_ANSWER", "ToLearnerOf", "ToRank"]


class Source(Enum):
    """Which weights a worker samples with, besides a flat array given in the call. Members
    unpickle as themselves, so a worker compares what it got with ``is``."""

    KEEP = "keep"
    BROADCAST = "broadcast"


class Answer(Enum):
    IN_ANSWER = "in_answer"


KEEP = Source.KEEP
"""Sample with the weights the worker holds."""
BROADCAST = Source.BROADCAST
"""Take part in learner 0's weight broadcast first."""
IN_ANSWER = Answer.IN_ANSWER
"""The batch rides in the call's answer."""


@dataclass(frozen=True)
class ToRank:
    """The batch goes to learner rank ``rank`` over the data channel."""

    rank: int

    def rank_for(self, role_index: int) -> int:
        """Where rollout worker ``role_index`` sends its batch: ``rank``."""
        return self.rank


@dataclass(frozen=True)
class ToLearnerOf:
    """Rollout worker i's batch goes to ``ranks[i % len(ranks)]`` (one call for all)."""

    ranks: tuple[int, ...]

    def rank_for(self, role_index: int) -> int:
        """Where rollout worker ``role_index`` sends its batch: learner i mod L's rank."""
        return self.ranks[role_index % len(self.ranks)]


@dataclass(frozen=True)
class Gathered:
    """The answer goes to the driver through learner 0's gather; the batch by ``batch``, or
    with ``rides`` in the gathered answer itself when it is small and meant for rank 0."""

    batch: ToRank | ToLearnerOf
    rides: bool = False


Delivery = Answer | ToRank | ToLearnerOf | Gathered
