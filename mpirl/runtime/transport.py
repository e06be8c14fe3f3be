"""Object messages between ranks: pickle protocol 5 with NumPy buffers over 16 kB sent raw,
out of band.

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
from mpirl.runtime.ulfm import is_process_failure
from mpirl.runtime.waiting import Backoff

#: Largest single MPI message for out-of-band buffers (1 GiB, well below the 2 GiB int limit).
CHUNK_BYTES = 1 << 30

_COUNT = struct.Struct("<I")


FAN_OUT_MIN = 8 if os.environ.get("MPIRL_PERSISTENT_SENDS", "1") != "0" else 1 << 62
"""``isend_many`` to this many destinations or more, of one small message (no bulk frames),
starts persistent sends (``MPI_Startall``) kept for the next such message of the same length to
the same ranks, in place of one ``Isend`` call from Python per destination: PPO's round call to
63 rollout ranks took rank 0 about 160 µs the one way and 90 µs the other here.
``MPIRL_PERSISTENT_SENDS=0`` turns them off: Open MPI's pml monitoring does not count persistent
sends (none of 300 here), so ``benchmarks/scale.py --mpi-traffic`` counts bytes without them."""

FAN_OUTS_KEPT = 4
"""Sets of persistent sends a channel keeps (the least recently used goes first, once its last
sends have completed)."""

FAN_OUT_MAX_BYTES = 16 << 10
"""The largest message sent through persistent sends. A small send completes as soon as MPI
has copied it (eagerly), so a set of them is free again at once; a large one waits for its
receiver, and its buffer with it."""


class _FanOut:
    """Persistent sends of one buffer to a list of ranks."""

    __slots__ = ("buffer", "requests")

    def __init__(self, comm: MPI.Comm, size: int, dests: tuple[int, ...], tag: int) -> None:
        self.buffer = bytearray(size)
        self.requests = [comm.Send_init(self.buffer, dest, tag) for dest in dests]

    def start(self, head: bytes) -> None:
        self.buffer[:] = head
        MPI.Prequest.Startall(self.requests)

    def done(self) -> bool:
        """Whether every send of the last start has completed (one MPI progress)."""
        return MPI.Request.Testall(self.requests)

    def free(self) -> None:
        """Free the requests; only once ``done``."""
        for request in self.requests:
            request.Free()


PENDING_TEST_AT = 32
"""A channel tests its unfinished sends together (``Channel.isend``) when this many are pending,
or twice as many as its last test left."""

INBAND_BYTES = 16 << 10
"""Buffers up to this size travel inside the control frame: a separate bulk frame costs each
side an MPI call and its Python around it (a few µs), more than copying 16 kB; an answer of
counts and a few small statistics arrays is then one message."""


def _out_of_band(buffers: list[pickle.PickleBuffer]) -> Any:
    def keep(buffer: pickle.PickleBuffer) -> bool:
        if buffer.raw().nbytes <= INBAND_BYTES:
            return True  # pickle copies it in-band
        buffers.append(buffer)
        return False
    return keep


def encode(obj: Any) -> tuple[bytes, list[memoryview]]:
    """Pickle ``obj``; return the control frame and the raw buffers (those over
    ``INBAND_BYTES``) to send out of band."""
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(obj, protocol=5, buffer_callback=_out_of_band(buffers))
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
        self._test_at = PENDING_TEST_AT
        #: (message length, destinations, tag) -> its persistent sends, most recent use last
        self._fan_outs: dict[tuple[int, tuple[int, ...], int], _FanOut] = {}
        self._fan_outs_seen: dict[tuple[int, tuple[int, ...], int], None] = {}
        # What went through this rank: messages and bytes (control frame plus bulk frames).
        self.messages_sent = self.bytes_sent = 0
        self.messages_received = self.bytes_received = 0

    def isend(self, obj: Any, dest: int, tag: int) -> None:
        """Start sending ``obj`` to ``dest``; the channel keeps the buffers alive until sent.

        Raises whatever pickling raises, before anything is sent.
        """
        self.isend_many(obj, [dest], tag)

    def isend_many(self, obj: Any, dests: list[int], tag: int) -> None:
        """Start sending ``obj`` to each of ``dests``: pickled once, then one send (plus its
        bulk frames) per destination. Each receiver sees an ordinary message, in order with the
        others this channel sent it on ``tag``."""
        head, raws = encode(obj)
        self.messages_sent += len(dests)
        self.bytes_sent += len(dests) * (len(head) + sum(raw.nbytes for raw in raws))
        if (not raws and len(dests) >= FAN_OUT_MIN and len(head) <= FAN_OUT_MAX_BYTES
                and self._start_fan_out(head, dests, tag)):
            return
        frames = [(self.bulk, raw[start:start + CHUNK_BYTES])
                  for raw in raws for start in range(0, raw.nbytes, CHUNK_BYTES) or (0,)]
        isend = self.comm.Isend
        pending = self._pending
        kept = (head, raws)
        for dest in dests:
            requests = [isend(head, dest, tag)]
            for comm, frame in frames:
                requests.append(comm.Isend(frame, dest, tag))
            pending.append((requests, kept, dest))
        # Not tested here: a test of a send not yet complete runs an MPI progress over every
        # peer (10-15 us at 64 ranks), once per message. The sends are tested together, in one
        # call, every PENDING_TEST_AT sends or so, and on ``flush``.
        if len(pending) >= self._test_at:
            self._drop_completed()
            self._test_at = max(PENDING_TEST_AT, 2 * len(self._pending))

    def _start_fan_out(self, head: bytes, dests: list[int], tag: int) -> bool:
        """Send ``head`` to ``dests`` through kept persistent sends; False (nothing sent) the
        first time such a message goes to those ranks, while the last start of those sends is
        still under way (its buffer cannot be reused yet), and while the set that would make
        room for new ones is."""
        key = (len(head), tuple(dests), tag)
        fan_out = self._fan_outs.pop(key, None)
        if fan_out is not None and not fan_out.done():
            self._fan_outs[key] = fan_out
            return False
        if fan_out is None:
            # Persistent sends pay for their setup only when used again: the first message of a
            # (length, ranks) goes out as plain sends, the second sets them up.
            if key not in self._fan_outs_seen:
                self._fan_outs_seen[key] = None
                if len(self._fan_outs_seen) > 4 * FAN_OUTS_KEPT:
                    del self._fan_outs_seen[next(iter(self._fan_outs_seen))]
                return False
            if len(self._fan_outs) >= FAN_OUTS_KEPT:
                oldest = next(iter(self._fan_outs))
                if not self._fan_outs[oldest].done():
                    return False  # never wait for a receiver here
                self._fan_outs.pop(oldest).free()
            fan_out = _FanOut(self.comm, len(head), key[1], tag)
        self._fan_outs[key] = fan_out  # the most recently used, last
        fan_out.start(head)
        return True

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
        self.messages_received += 1
        self.bytes_received += len(head) + sum(sizes)
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

    @property
    def pending_sends(self) -> int:
        """Sends started and not yet known to be complete (as of the last ``flush``)."""
        return len(self._pending)

    def flush(self, timeout: float | None = None) -> bool:
        """Drop the sends that have completed; with a timeout, wait up to it for all of them.

        Returns True when no send is left pending. Every pending send is tested, not only the
        oldest: one message its receiver never takes must not keep the buffers of every later
        send alive.
        """
        self._drop_completed()
        if timeout is None:
            return not self._pending
        deadline = time.monotonic() + timeout
        backoff = Backoff()
        while not self._all_sent() and time.monotonic() < deadline:
            if self._drop_completed():
                backoff.reset()
            else:
                backoff.sleep()
        return self._all_sent()

    def _all_sent(self) -> bool:
        """No send pending, persistent ones (``isend_many``) included."""
        return not self._pending and all(f.done() for f in self._fan_outs.values())

    def _drop_completed(self) -> bool:
        """Forget the sends that have completed; True if there were any. One ``Testsome``
        over all of them: one MPI progress, not one per send."""
        before = len(self._pending)
        if before:
            # Testsome sets each completed request to MPI_REQUEST_NULL (false) in place.
            MPI.Request.Testsome([request for entry in self._pending for request in entry[0]])
            self._pending = deque(entry for entry in self._pending if any(entry[0]))
        return len(self._pending) < before
