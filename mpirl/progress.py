"""Rank 0's live view of a training run."""

from __future__ import annotations

import math
import os
import sys
from typing import Any, TextIO


def _is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _count(value: Any) -> str:
    return "-" if _is_missing(value) else f"{int(value):,}"


def _decimal(value: Any) -> str:
    return "-" if _is_missing(value) else f"{float(value):,.1f}"


class ProgressDisplay:
    """Rank 0's live view of a run: env steps, steps/s, mean return, iteration, elapsed time.

    A rich live display on a terminal; plain one-line-per-iteration text otherwise (CI, Slurm
    logs). ``live=None`` picks live mode when ``stream`` is a TTY and ``$CI`` is unset. A return
    that is None or NaN (no episode has ended yet) shows as ``-``.
    """

    def __init__(self, title: str, total_steps: int | None = None, live: bool | None = None,
                 stream: TextIO | None = None) -> None:
        self.title = title
        self.total_steps = total_steps
        self.stream = sys.stdout if stream is None else stream
        is_tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.live = (is_tty and not os.environ.get("CI")) if live is None else live
        self._progress = None
        self._task = None
        if self.live:
            self._start_live(force_terminal=not is_tty)

    def _start_live(self, force_terminal: bool) -> None:
        from rich.console import Console, Group
        from rich.live import Live
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn
        from rich.text import Text

        # force_terminal: live=True was asked for on a stream that is not a TTY.
        console = Console(file=self.stream, force_terminal=force_terminal or None)
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(bar_width=None),
            TaskProgressColumn(),
            console=console,
            expand=True,
        )
        self._task = self._progress.add_task(self.title, total=self.total_steps)
        # The stats get a line of their own: beside the bar they would not fit in 80 columns.
        self._stats_text = Text(self._stats({}))
        # Redrawn on update() only: no refresh thread running beside MPI calls.
        self._live = Live(Group(self._progress, self._stats_text), console=console,
                          auto_refresh=False)
        self._live.start(refresh=True)

    def _steps(self, row: dict) -> str:
        steps = _count(row.get("timesteps_total"))
        if self.total_steps is None:
            return f"steps {steps}"
        return f"steps {steps}/{self.total_steps:,}"

    def _stats(self, row: dict) -> str:
        sps = row.get("env_steps_per_s")
        sps_text = "-" if _is_missing(sps) else f"{float(sps):,.0f}"
        time_s = row.get("time_total_s")
        time_text = "-" if _is_missing(time_s) else f"{float(time_s):.1f}s"
        parts = [
            f"iter {_count(row.get('iteration'))}",
            self._steps(row),
            f"{sps_text} steps/s",
            f"return {_decimal(row.get('episode_return_mean'))}",
        ]
        if "episode_len_mean" in row:
            parts.append(f"len {_decimal(row['episode_len_mean'])}")
        if row.get("num_env_failures"):
            parts.append(f"env failures {_count(row['num_env_failures'])}")
        parts.append(f"time {time_text}")
        return "  ".join(parts)

    def update(self, row: dict) -> None:
        """Show the state after one iteration; ``row`` is a progress row (see RunRecorder)."""
        if self._progress is not None:
            steps = row.get("timesteps_total")
            self._progress.update(self._task, completed=0 if _is_missing(steps) else steps)
            self._stats_text.plain = self._stats(row)
            self._live.refresh()
        else:
            print(self._stats(row), file=self.stream, flush=True)

    def close(self) -> None:
        """Stop the live display, leaving its last state on screen; closing twice is harmless."""
        if self._progress is not None:
            self._live.stop()
            self._progress = None

    def __enter__(self) -> ProgressDisplay:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
