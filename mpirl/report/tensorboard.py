"""TensorBoard event files, written by tensorboardX: every numeric value of a progress row as a
scalar, and, every ``tensorboard_histograms_every`` iterations, histograms of learner 0's
weights and of the gradient norms of its SGD steps. Rank 0 only.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

import numpy as np

_writers = itertools.count()
_NOT_IN_TAG = re.compile(r"[^-/\w.]")
"""Characters TensorBoard's tags may not hold; each becomes ``_``, as tensorboardX does."""


def _histogram_edges() -> list[float]:
    # TensorFlow's default buckets (what tensorboardX's bins="tensorflow" means): edges growing
    # by 10% from 1e-12 to 1e20 on each side of zero.
    edges, edge = [], 1e-12
    while edge < 1e20:
        edges.append(edge)
        edge *= 1.1
    return [-e for e in reversed(edges)] + [0.0] + edges


class EventWriter:
    """Writes scalars and histograms to one TensorBoard event file of its own in ``logdir``.

    The file name ends in ``.<pid>.<n>``, so that two writers in one directory in one second
    (a run resumed at once, say) never share a file: TensorBoard reads every ``*tfevents*``.
    """

    def __init__(self, logdir: str | Path) -> None:
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        suffix = f".{os.getpid()}.{next(_writers)}"
        # Imported here: tensorboardX imports torch (1 s, 200 MB), and `mpirl --help` or the
        # `mpirl launch` supervisor import this module without writing any event.
        from tensorboardX import summary as summaries
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary

        # NaN is a value rows legitimately hold (no episode ended yet, a rank not heard from):
        # tensorboardX would warn on each one.
        logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)
        self._summary, self._summaries, self._event = Summary, summaries, Event
        self._edges: list[float] | None = None
        # Written in the caller's thread, not by tensorboardX's FileWriter thread: on a full
        # disk that thread died with a traceback of its own and the next writes then blocked
        # forever on its full queue (benchmarks/chaos.py hung IMPALA so). Here the OSError
        # reaches the run, which ends with one line. The run's recorder flushes every few
        # seconds and before each checkpoint (RunRecorder.sync).
        self._writer = EventsWriter(str(self.logdir / "events"), suffix)
        self.path = next(self.logdir.glob(f"events.out.tfevents.*{suffix}"))
        self._closed = False

    def add_scalar(self, tag: str, value: float, step: int,
                   wall_time: float | None = None) -> None:
        """Append one scalar (stored as float32); it reaches the disk at the next ``flush``."""
        self.add_scalars({tag: value}, step, wall_time)

    def add_scalars(self, values: dict[str, float], step: int,
                    wall_time: float | None = None) -> None:
        """Append one scalar per ``tag: value`` (float32), all in one event: a progress row
        of 30 values costs one record, not 30 (3.4 ms of rank 0's CPU per row with
        tensorboardX's ``add_scalar``, about 0.1 ms so)."""
        if self._closed:
            raise ValueError(f"EventWriter for {self.path} is closed")
        value = self._summary.Value
        summary = self._summary(value=[value(tag=_NOT_IN_TAG.sub("_", tag).lstrip("/"),
                                             simple_value=float(number))
                                       for tag, number in values.items()])
        self._write(summary, step, wall_time)

    def add_histogram(self, tag: str, values: Any, step: int) -> None:
        """Append a histogram of ``values`` (any array; NaNs dropped)."""
        if self._closed:
            raise ValueError(f"EventWriter for {self.path} is closed")
        values = np.asarray(values, np.float64).reshape(-1)
        values = values[np.isfinite(values)]
        if values.size:
            if self._edges is None:
                self._edges = _histogram_edges()
            self._write(self._summaries.histogram(tag, values, self._edges), step)

    def _write(self, summary: Any, step: int, wall_time: float | None = None) -> None:
        event = self._event(summary=summary, step=int(step),
                            wall_time=time.time() if wall_time is None else wall_time)
        self._writer.write_event(event)

    def flush(self) -> None:
        if not self._closed:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the file; closing twice is harmless."""
        if not self._closed:
            self._closed = True
            self._writer.close()

    def __enter__(self) -> EventWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
