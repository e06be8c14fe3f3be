"""The worker rank's serve loop: probe, receive, run the method on the worker object, answer.

A worker rank hosts any number of worker objects, created by the driver's ``spawn`` and addressed
by object id. Tasks are run one at a time, in the order the driver sent them. An exception in a
method is sent back as the answer and the loop goes on; only an exception escaping the loop itself
(``SystemExit`` from a method, say) ends the rank, and then the job (see ``runtime``).
"""

from __future__ import annotations

from typing import Any

from mpirl.runtime import signals as stop_signals
from mpirl.runtime.core import RankContext, shrink_weights_comm
from mpirl.runtime.dispatch import HOST, RESULT, SIGNAL, TASK, describe_exception
from mpirl.runtime.gathered import ANSWERED
from mpirl.runtime.heartbeat import IDLE, Heartbeat
from mpirl.runtime.transport import Channel
from mpirl.runtime.waiting import Backoff

__all__ = ["DRIVER_RANK", "latest_stopped_round"]

#: The driver's rank.
DRIVER_RANK = 0
#: Tag of the driver's word, on the data channel, that ends the streaming calls of a round and
#: earlier ones (IMPALA's ``sample_fragments``; Ape-X's sampling, a shard's ``serve``, the
#: learner's ``train_from_shards``): one message per rank, however many calls it has queued.
STOP_STREAM_TAG = 24


def latest_stopped_round(channel: Channel, known: int, tag: int = STOP_STREAM_TAG) -> int:
    """The latest stream round the driver has told this rank to stop: ``known`` or a later one,
    from the stop words that came with ``tag`` (all are taken; a multi-agent policy's workers
    have a tag of their own)."""
    while (item := channel.poll(DRIVER_RANK, tag)) is not None:
        known = max(known, item[0])
    return known


class WorkerHost:
    """Serves the tasks that rank 0 sends to this rank. ``serve()`` returns the job's exit code.

    With a ``heartbeat``, each call's id is on it while the call runs, so that the driver can
    name the task of a rank that is stuck.
    """

    def __init__(self, channel: Channel, context: RankContext, backoff: Backoff,
                 heartbeat: Heartbeat | None = None) -> None:
        self.channel = channel
        self.context = context
        self.backoff = backoff
        self.heartbeat = heartbeat
        self.objects: dict[int, Any] = {}
        self._exit_code: int | None = None

    def serve(self) -> int:
        """Run tasks until the driver sends ``stop``; return the exit code it sent."""
        channel, backoff, heartbeat = self.channel, self.backoff, self.heartbeat
        stop_signals.report_with(lambda signum: channel.isend(signum, DRIVER_RANK, SIGNAL))
        if heartbeat is not None:
            heartbeat.current_task = IDLE
        while self._exit_code is None:
            stop_signals.report_received()
            item = channel.poll(DRIVER_RANK, TASK)
            if item is None:
                channel.flush()
                backoff.sleep()
                continue
            (call_id, object_id, method, args, kwargs), _ = item
            if heartbeat is not None:
                heartbeat.current_task = call_id
            try:
                if object_id == HOST:
                    value = getattr(self, "_host_" + method)(*args, **kwargs)
                else:
                    value = getattr(self.objects[object_id], method)(*args, **kwargs)
                answer = (call_id, True, value)
            except Exception as error:  # noqa: BLE001 - the driver gets it as RemoteError
                answer = (call_id, False, describe_exception(error))
            if heartbeat is not None:
                heartbeat.current_task = IDLE
            if answer[2] is not ANSWERED:  # else it went to the driver in a collective
                self._answer(answer)
            backoff.reset()
        stop_signals.report_with(None)
        return self._exit_code

    def _answer(self, answer: tuple) -> None:
        try:
            self.channel.isend(answer, DRIVER_RANK, RESULT)
        except Exception as error:  # noqa: BLE001 - e.g. an unpicklable return value
            call_id, _, value = answer
            cause_type, message, tb = describe_exception(error)
            self.channel.isend(
                (call_id, False, (cause_type, f"the result {type(value).__name__} could not be "
                                  f"sent back: {message}", tb)),
                DRIVER_RANK, RESULT,
            )

    # Messages the host itself answers (object id 0).

    def _host_spawn(self, object_id: int, cls: type, args: tuple, kwargs: dict,
                    beside: int | None = None) -> str:
        """Create a worker object; with ``beside``, the object of that id on this rank is given
        to its constructor (``beside=``): several workers sharing one sampling core."""
        if beside is not None:
            kwargs = {**kwargs, "beside": self.objects[beside]}
        self.objects[object_id] = cls(self.context, *args, **kwargs)
        return self.context.host

    def _host_drop(self, object_id: int) -> None:
        self.objects.pop(object_id, None)

    def _host_count_objects(self) -> int:
        return len(self.objects)

    def _host_shrink_weights_comm(self) -> int:
        """Take part in shrinking weights_comm to its live members (after a rollout rank was lost,
        under ULFM); returns the new size. Collective over every live member."""
        self.context = shrink_weights_comm(self.context, self.objects.values())
        return self.context.weights_comm.Get_size()

    def _host_stop(self, exit_code: int) -> int:
        """End ``serve`` after this answer; returns this rank (in the run's communicator)."""
        self._exit_code = exit_code
        return self.context.rank
