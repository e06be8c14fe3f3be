"""TensorBoard event files, written by tensorboardX: every numeric value of a progress row as a
scalar, and, every ``tensorboard_histograms_every`` iterations, histograms of learner 0's
weights and of the gradient norms of its SGD steps. Rank 0 only.
"""

from __future__ import annotations

import itertools
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

_writers = itertools.count()


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
        from tensorboardX import SummaryWriter

        # NaN is a value rows legitimately hold (no episode ended yet, a rank not heard from):
        # tensorboardX would warn on each one.
        logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)
        # flush_secs: rank 0 flushes after each row itself; the writer's own thread then has
        # nothing left to do in between.
        self._writer = SummaryWriter(logdir=str(self.logdir), filename_suffix=suffix,
                                     flush_secs=3600)
        self.path = next(self.logdir.glob(f"events.out.tfevents.*{suffix}"))
        self._closed = False

    def add_scalar(self, tag: str, value: float, step: int,
                   wall_time: float | None = None) -> None:
        """Append one scalar (stored as float32); it reaches the disk at the next ``flush``."""
        if self._closed:
            raise ValueError(f"EventWriter for {self.path} is closed")
        self._writer.add_scalar(tag, float(value), global_step=int(step), walltime=wall_time)

    def add_histogram(self, tag: str, values: Any, step: int) -> None:
        """Append a histogram of ``values`` (any array; NaNs dropped)."""
        if self._closed:
            raise ValueError(f"EventWriter for {self.path} is closed")
        values = np.asarray(values, np.float64).reshape(-1)
        values = values[np.isfinite(values)]
        if values.size:
            self._writer.add_histogram(tag, values, global_step=int(step))

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
