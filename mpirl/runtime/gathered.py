"""Answers through a gather: the calls of one synchronous round (PPO's sampling, an ES
generation) each answer rank 0 in a ``Gatherv`` over weights_comm, rooted at learner 0, instead
of a message each. Rank 0 then takes one message per round (learner 0's answer, or nothing when
learner 0 is in its process), not one per rollout rank.

A worker method answers with ``answer_through_gather``; learner 0, called in the same round,
collects with ``gather_answers``; the driver settles each call's future from what learner 0
returns (``Future.settle``). The host sends no answer for a method that returned ``ANSWERED``.
A call that raises still joins the gather, with no result, and then answers its error as usual.
Under ULFM the rounds keep an answer per call, which tells the lost ranks apart.

A round whose calls should all answer the same (an ES update, applied alike on every rank) can
skip even the gather: ``answer_unless_agreed`` compares the answers in one allreduce of their
hashes, and only where they differ, or a call raised, do they go on to the gather.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from mpirl.errors import ProcessFailure, TaskTimeout
from mpirl.runtime.signals import report_received
from mpirl.runtime.ulfm import (
    allreduce_max,
    bcast_bytes,
    bcast_round,
    fault_tolerant,
    gather_bytes,
)

__all__ = ["answer_through_gather", "answer_unless_agreed", "decode_answers", "gathers_answers",
           "NO_WEIGHTS", "RoundWaits", "agreed_or_gathered", "gather_answers", "send_answer",
           "serve_rounds", "start_round"]

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
last answer up to 16 ms late, 1.6% of a 1 s round. Only the last 20% of a round's expected
time is polled so (``gather_answers``)."""


GATHER_BATCH_BYTES = 4 << 20
"""The largest sample batch that rides in a gathered answer (``fits_in_gather``)."""


def fits_in_gather(batch: dict[str, Any], members: int) -> bool:
    """Whether a rollout rank's ``batch`` may ride in its gathered answer to learner 0 (the
    driver's own learner), in a round over a communicator of ``members``: at most
    ``GATHER_BATCH_BYTES``, and at most 1 GiB over all members, so that the root's buffer stays
    well inside MPI's int counts. Each rank decides alone; a larger batch goes as a message."""
    nbytes = sum(np.asarray(value).nbytes for value in batch.values())
    return nbytes <= min(GATHER_BATCH_BYTES, (1 << 30) // max(members, 1))


class PackedBatch:
    """A sample batch that rides in a gathered answer, still pickled: the learner it is for
    unpacks it (``unpack``), so decoding it stays the learner's work, as receiving it would be.
    In the gathered answer its bytes follow the answer's pickle rather than sit inside it
    (``decode_answers``): the driver's decoding then neither copies them nor builds an object
    through pickle's class lookup, which cost it about 1.9 µs per answer."""

    __slots__ = ("data",)

    def __init__(self, batch: dict[str, Any]) -> None:
        self.data: bytes | memoryview = pickle.dumps(batch, protocol=5)

    @classmethod
    def of_bytes(cls, data: bytes | memoryview) -> PackedBatch:
        packed = cls.__new__(cls)
        packed.data = data
        return packed

    def unpack(self) -> dict[str, Any]:
        return pickle.loads(self.data)


def gathers_answers(workers: Iterable[Any]) -> bool:
    """Whether a round of calls to ``workers`` (handles) answers through the gather: they have
    ranks of their own, which they share with no other policy's workers (a multi-agent run's
    weights communicator is not theirs), and MPI does not report process failures (under ULFM
    each answer must come on its own, to tell a lost rank apart)."""
    workers = list(workers)
    return (not fault_tolerant() and not all(worker.in_process for worker in workers)
            and not any(worker.shares_rank for worker in workers))


def answer_through_gather(context: RankContext, run: Callable[[], Any]) -> Any:
    """Run ``run()`` and hand its result to learner 0's ``gather_answers`` (on weights_comm);
    return ``ANSWERED``. If ``run`` raises, join the gather with no result, then raise."""
    try:
        result = run()
    except Exception:
        send_answer(context, None)
        raise
    send_answer(context, result)
    return ANSWERED


NO_WEIGHTS = np.empty(0, np.float32)
"""The weights of a round that carries none (an ES generation: each rank holds its own)."""


def serve_rounds(context: RankContext, weights: np.ndarray,
                 run_round: Callable[[Any], Exception | None]) -> dict[str, int]:
    """A rollout worker's standing call (``mpirl.execution.standing_rounds``): round after
    round, take learner 0's broadcast of the round's header and ``weights`` (``bcast_round``),
    then ``run_round(header)``, which answers through the round's collectives and returns the
    error of a round that failed on this rank (None if it did not). An empty header ends the
    rounds: returns ``{"rounds": n}``, or raises the first failure then. A collective that
    failed (``TaskTimeout``, ``ProcessFailure``), raised or returned by ``run_round``, ends the
    call at once: this is the one place that tells the two kinds of failure apart."""
    failure: Exception | None = None
    rounds = 0
    while header := bcast_round(context.weights_comm, None, weights,
                                context.collective_timeout_s):
        failed = run_round(pickle.loads(header))
        if isinstance(failed, (TaskTimeout, ProcessFailure)):
            raise failed
        failure = failure or failed
        rounds += 1
        report_received()  # a stop signal reaches the driver while the rounds stand
    if failure is not None:
        raise failure
    return {"rounds": rounds}


def start_round(context: RankContext, header: Any, weights: np.ndarray) -> None:
    """Learner 0's part in starting a round of ``serve_rounds`` (``header`` pickled), or in
    ending the rounds (``header`` None)."""
    bcast_round(context.weights_comm, b"" if header is None else pickle.dumps(header, protocol=5),
                weights, context.collective_timeout_s)


_AGREEING = "the comparison of the answers"
_HASH_BYTES = 7
"""An answer's hash is 56 bits: it and its negation fit in an int64 with room for the root's
neutral vote (``_ROOT_VOTE``)."""
_ROOT_VOTE = np.array([-1, -(1 << 62), -(1 << 62)], np.int64)
"""Learner 0's part in the allreduce of ``answer_unless_agreed``: below every member's."""


def _vote(pickled: bytes, failed: bool) -> np.ndarray:
    """``[failed, h, -h]`` for an answer whose pickle hashes to ``h``: their maximum over the
    members says whether any call failed, and the largest and smallest hash."""
    digest = hashlib.blake2b(pickled, digest_size=_HASH_BYTES).digest()
    h = int.from_bytes(digest, "little")
    return np.array([int(failed), h, -h], np.int64)


def _all_agree(votes: np.ndarray) -> bool:
    return int(votes[0]) == 0 and int(votes[1]) == -int(votes[2])


def answer_unless_agreed(context: RankContext, result: Any,
                         failure: Exception | None) -> Any:
    """A rollout rank's answer to a round whose answers should all be the same (an ES update,
    applied alike on every rank): compare them in one allreduce of their hashes over
    weights_comm, learner 0 included (``agreed_or_gathered``). If none failed and all are
    equal, weights_comm's member 1 hands learner 0 its result in a broadcast, and every rank
    returns ``ANSWERED``: rank 0 settles all their calls with that one result. Otherwise every
    member answers through the gather, as ``answer_through_gather`` does, and ``failure`` is
    raised after it."""
    comm, pickled = context.weights_comm, pickle.dumps(result, protocol=5)
    votes = allreduce_max(comm, _vote(pickled, failure is not None),
                          context.collective_timeout_s, _AGREEING, context.collective_backoff)
    if _all_agree(votes):
        bcast_bytes(comm, pickled if comm.Get_rank() == 1 else None,
                    context.collective_timeout_s, _AGREEING)
        return ANSWERED
    send_answer(context, result)
    if failure is not None:
        raise failure
    return ANSWERED


def agreed_or_gathered(context: RankContext, waits: RoundWaits) -> tuple[bool, Any]:
    """On learner 0, the root's part in ``answer_unless_agreed``: ``(True, the result every
    member gave)``, or ``(False, the gathered parts)`` as ``gather_answers`` returns them when
    they differ or a call failed."""
    comm, timeout_s = context.weights_comm, context.collective_timeout_s
    began = time.monotonic()
    votes = allreduce_max(comm, _ROOT_VOTE.copy(), timeout_s, _AGREEING, ROOT_BACKOFF,
                          waits.expected_s())
    waits.add(time.monotonic() - began)
    if _all_agree(votes):
        return True, pickle.loads(bcast_bytes(comm, None, timeout_s, _AGREEING))
    return False, gather_bytes(comm, b"", timeout_s, _WHAT, ROOT_BACKOFF)[1:]


_HEAD = struct.Struct("<Q")


_RAW = 1 << 63
"""Set in a part's head: the part is a float64 array's bytes, not a pickle (``encode_answer``)."""


def encode_answer(rank: int, result: Any) -> bytes:
    """One member's part of the gather: ``<u64 n>``, the pickle (n bytes) of ``(rank, result,
    whether a batch follows)``, then the bytes of a ``PackedBatch`` under ``result["batch"]``,
    if there is one (taken out of ``result``). A result that is a 1-d float64 array (an ES
    generation's record) goes as ``<u64 _RAW | rank>`` and its bytes: rank 0 reads it without
    unpickling, which cost it about 10 µs per answer at 64 ranks here."""
    if isinstance(result, np.ndarray) and result.dtype == np.float64 and result.ndim == 1:
        return _HEAD.pack(_RAW | rank) + result.tobytes()
    batch = result.pop("batch") if isinstance(result, dict) and isinstance(
        result.get("batch"), PackedBatch) else None
    head = pickle.dumps((rank, result, batch is not None), protocol=5)
    return b"".join((_HEAD.pack(len(head)), head, batch.data if batch is not None else b""))


def send_answer(context: RankContext, result: Any, root: int = 0) -> list[bytes] | None:
    """Join the gather of a round's answers (``gather_answers``) with ``result`` (None for a
    call that failed); the call may go on and answer later, or through another collective.
    The gather is rooted at weights_comm's member ``root`` (learner 0 by default); at the root
    it returns every member's part, in member order (learner 0's is empty), else None."""
    return gather_bytes(context.weights_comm, encode_answer(context.rank, result),
                        context.collective_timeout_s, _WHAT, context.collective_backoff,
                        root=root)


class RoundWaits:
    """How long the root's last three waits for one kind of round took (PPO's sampling, an ES
    generation): such rounds take about as long each time, and the shortest of them is what
    the root expects of the next (``wait_for_all``'s ``expected_s``). Held by the root's worker
    object, so a run's rounds do not borrow another run's."""

    __slots__ = ("_recent",)

    def __init__(self) -> None:
        self._recent: deque[float] = deque(maxlen=3)

    def expected_s(self) -> float:
        return min(self._recent, default=0.0)

    def add(self, seconds: float) -> None:
        self._recent.append(seconds)


def gather_answers(context: RankContext, waits: RoundWaits, root: int = 0
                   ) -> list[bytes] | None:
    """On learner 0 (weights_comm's member 0): every other member's pickled ``(rank, result)``,
    result None for a call that raised; pass them to ``decode_answers`` on the driver. With
    another ``root`` (a rollout rank that reads the answers itself), learner 0 joins the gather
    with nothing and gets None. It polls rarely until the shortest of the last three rounds in
    ``waits`` could have ended."""
    began = time.monotonic()
    parts = gather_bytes(context.weights_comm, b"", context.collective_timeout_s, _WHAT,
                         ROOT_BACKOFF, waits.expected_s(), root=root)
    waits.add(time.monotonic() - began)
    return None if parts is None else parts[1:]


def decode_answers(parts: list[bytes]) -> dict[int, Any]:
    """{rank: result} of what ``gather_answers`` returned; None for a call that raised. A
    batch that followed an answer is back under its ``"batch"``, a ``PackedBatch`` over the
    part's own bytes; a float64 array sent raw is a read-only array over them."""
    answers = {}
    loads, unpack_from, of_bytes = pickle.loads, _HEAD.unpack_from, PackedBatch.of_bytes
    for part in parts:
        view = memoryview(part)
        (size,) = unpack_from(view)
        if size & _RAW:
            answers[size ^ _RAW] = np.frombuffer(part, np.float64, offset=8)
            continue
        rank, result, has_batch = loads(view[8:8 + size])
        if has_batch:
            result["batch"] = of_bytes(view[8 + size:])
        answers[rank] = result
    return answers
