"""Object messages between ranks: pickle protocol 5 with NumPy buffers sent raw, out of band.

A message is one control frame plus zero or more bulk frames:

* the control frame, on ``Channel.comm``: ``<u32 n> <u64 size_1> ... <u64 size_n> <pickle bytes>``;
* each out-of-band buffer, on the twin communicator ``Channel.bulk``, split into frames of at most
  ``CHUNK_BYTES`` so that no MPI count exceeds 2**31 - 1 and payloads over 2 GiB work.

A small object with no large arrays is therefore exactly one MPI message. MPI keeps messages
between one pair of ranks on one communicator and tag in order, which is what ties bulk frames to
their control frame. Receivers only take messages they have matched with a probe
(``improbe`` + ``Message.Recv``); nothing is received into a fixed-size guess of a buffer.
"""

from __future__ import annotations

import os
import pickle
import struct
import time
from collections import deque
from typing import Any

import numpy as np
from mpi4py import MPI

from mpirl.errors import TaskTimeout
from mpirl.ulfm import is_process_failure

#: Largest single MPI message for out-of-band buffers (1 GiB, well below the 2 GiB int limit).
CHUNK_BYTES = 1 << 30

_COUNT = struct.Struct("<I")


def encode(obj: Any) -> tuple[bytes, list[memoryview]]:
    """Pickle ``obj``; return the control frame and the raw buffers to send out of band."""
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    header = struct.pack(f"<I{len(raws)}Q", len(raws), *(r.nbytes for r in raws))
    return header + data, raws


class Channel:
    """Send and receive Python objects over a private duplicate of a communicator.

    Every rank of ``comm`` must create the channel at the same point (``Dup`` is collective).
    """

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm = comm.Dup()
        self.bulk = comm.Dup()
        self._status = MPI.Status()
        # (requests, buffers kept alive until sent, destination rank)
        self._pending: deque[tuple[list[MPI.Request], object, int]] = deque()

    def isend(self, obj: Any, dest: int, tag: int) -> None:
        """Start sending ``obj`` to ``dest``; the channel keeps the buffers alive until sent.

        Raises whatever pickling raises, before anything is sent.
        """
        head, raws = encode(obj)
        requests = [self.comm.Isend(head, dest, tag)]
        for raw in raws:
            for start in range(0, raw.nbytes, CHUNK_BYTES) or (0,):
                requests.append(self.bulk.Isend(raw[start:start + CHUNK_BYTES], dest, tag))
        if not MPI.Request.Testall(requests):
            self._pending.append((requests, (head, raws), dest))

    def poll(self, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG) -> tuple[Any, int] | None:
        """Receive one message if one has arrived: ``(obj, source)``, else None. Never blocks
        except to take the bulk frames of a message whose control frame has arrived."""
        status = self._status
        message = self.comm.Improbe(source, tag, status)
        if message is None:
            return None
        head = bytearray(status.Get_count(MPI.BYTE))
        message.Recv([head, MPI.BYTE])
        source, tag = status.Get_source(), status.Get_tag()
        (count,) = _COUNT.unpack_from(head)
        sizes = struct.unpack_from(f"<{count}Q", head, _COUNT.size)
        buffers = [self._receive_buffer(size, source, tag) for size in sizes]
        data = memoryview(head)[_COUNT.size + 8 * count:]
        return pickle.loads(data, buffers=buffers), source

    def recv(self, source: int, tag: int, timeout: float = 3600.0) -> Any:
        """Wait for one message from ``source``; raise TaskTimeout after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        backoff = Backoff()
        while (item := self.poll(source, tag)) is None:
            if time.monotonic() > deadline:
                raise TaskTimeout(f"no message (tag {tag}) from rank {source} within {timeout:g} s")
            backoff.sleep()
        return item[0]

    def recv_each(self, sources: list[int], tag: int, timeout: float = 3600.0) -> list[Any]:
        """One message from each of ``sources``, in order, leaving out the sources that MPI
        reports failed before their message came whole (ULFM only; else like ``recv``)."""
        received = []
        for source in sources:
            try:
                received.append(self.recv(source, tag, timeout))
            except MPI.Exception as error:
                if not is_process_failure(error):
                    raise
        return received

    def forget(self, dest: int) -> None:
        """Drop the unfinished sends to ``dest``, a rank that died: they can never complete."""
        self._pending = deque(entry for entry in self._pending if entry[2] != dest)

    def _receive_buffer(self, size: int, source: int, tag: int) -> np.ndarray:
        # np.empty, not bytearray: a multi-GiB buffer need not be zero-filled first.
        buffer = np.empty(size, dtype=np.uint8)
        view = memoryview(buffer)
        for start in range(0, size, CHUNK_BYTES) or (0,):
            self.bulk.Recv([view[start:start + CHUNK_BYTES], MPI.BYTE], source, tag)
        return buffer

    def flush(self, timeout: float | None = None) -> bool:
        """Drop the sends that have completed; with a timeout, wait up to it for all of them.

        Returns True when no send is left pending.
        """
        pending = self._pending
        while pending and MPI.Request.Testall(pending[0][0]):
            pending.popleft()
        if timeout is None or not pending:
            return not pending
        deadline = time.monotonic() + timeout
        backoff = Backoff()
        while pending and time.monotonic() < deadline:
            if MPI.Request.Testall(pending[0][0]):
                pending.popleft()
                backoff.reset()
            else:
                backoff.sleep()
        return not pending


def wait_for_all(comm: MPI.Comm, timeout_s: float, what: str) -> None:
    """Return once every member of ``comm`` has called this; raise ``TaskTimeout`` naming
    ``what`` if they have not within ``timeout_s``. Collective over ``comm``.

    An ``Ibarrier`` waited on with back-off, so no core spins. Called just before a blocking
    collective it gives that collective a deadline: once all members are there, none waits on a
    member that is busy elsewhere (MPI has no way to cancel a blocking collective, nor a
    non-blocking one, so the wait is bounded before it starts).
    """
    request = comm.Ibarrier()
    if request.Test():
        return
    deadline = time.monotonic() + timeout_s
    backoff = Backoff()
    while not request.Test():
        if time.monotonic() > deadline:
            raise TaskTimeout(f"{what}: not all {comm.Get_size()} members arrived within "
                              f"{timeout_s:g} s")
        backoff.sleep()


class Backoff:
    """Waiting between polls without spinning a core.

    Right after activity it polls for ``spin_s``, yielding the core between polls, then sleeps,
    doubling from ``min_sleep_s`` up to ``max_sleep_s``. An idle rank thus wakes at most
    ``1 / max_sleep_s`` times a second.

    ``spin_s`` must exceed the peer's longest sleep. Otherwise two ranks in a conversation fall
    into a stable slow state: a reply that arrives after the peer's spin window finds it asleep,
    its late answer finds this rank asleep, and so on. That was measured here at 2-3 ms per round
    trip with a 0.2 ms window, against 10 us when both stay within the window.
    """

    __slots__ = ("spin_s", "min_sleep_s", "max_sleep_s", "_since", "_sleep")

    def __init__(
        self, spin_s: float = 2e-3, min_sleep_s: float = 5e-5, max_sleep_s: float = 1e-3
    ) -> None:
        self.spin_s = spin_s
        self.min_sleep_s = min_sleep_s
        self.max_sleep_s = max_sleep_s
        self.reset()

    def reset(self) -> None:
        """Call after activity: the next polls spin again."""
        self._since = time.perf_counter()
        self._sleep = 0.0

    def sleep(self) -> None:
        """Call after a poll that found nothing."""
        if self._sleep == 0.0:
            if time.perf_counter() - self._since < self.spin_s:
                # Yield, don't just spin: with more ranks than cores the rank we wait for may
                # share this core, and a bare spin would hold it for a whole scheduler slice.
                os.sched_yield()
                return
            self._sleep = self.min_sleep_s
        time.sleep(self._sleep)
        self._sleep = min(self.max_sleep_s, self._sleep * 2)


def reduce_timer_slack() -> None:
    """Ask Linux for 1 us timer slack on this process (default 50 us), so short sleeps between
    polls last about what they ask for. Elsewhere, or if the call fails, nothing changes."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, in nanoseconds
    except (OSError, AttributeError):
        pass
