"""Rank 0's view of a training run: a live display on the user's terminal, plain lines elsewhere.

Under ``mpiexec`` a rank's stdout is no guide: Open MPI gives every rank a pseudo-terminal even when
mpiexec's own output goes to a file (``make run > log``, a batch job), so ``isatty()`` is True and
a live display would write escape codes into the log. ``auto`` therefore asks the launcher: it
looks up the rank's ancestors for the MPI launcher process and shows live output only when that
process's stdout is a terminal. Nothing here crosses ranks; only rank 0 displays.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from mpirl.errors import ConfigError
from mpirl.report.output_log import Tee

#: ``--progress`` values: auto (live only on the user's own terminal), live (a redrawn bar, even
#: into a file), plain (one line per iteration), off (no per-iteration output).
PROGRESS_MODES = ("auto", "live", "plain", "off")
#: The environment variable that sets the default of ``--progress``.
PROGRESS_ENV = "MPIRL_PROGRESS"
#: Process names of MPI launchers and their node daemons (Open MPI, MPICH's Hydra, Slurm's step
#: daemon): the first such ancestor of a rank holds the output the user sees.
LAUNCHERS = frozenset({"mpiexec", "mpirun", "prterun", "prted", "orterun", "orted",
                       "mpiexec.hydra", "hydra_pmi_proxy", "srun", "slurmstepd"})
#: Set by MPI launchers in every rank's environment (Open MPI, PMIx, PMI-1/2).
LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE")


def progress_mode(flag: str | None) -> str:
    """The ``--progress`` mode: the flag, else ``$MPIRL_PROGRESS``, else auto; ConfigError (the
    same on every rank) for a value that is none of PROGRESS_MODES."""
    value = flag if flag is not None else os.environ.get(PROGRESS_ENV, "auto")
    if value not in PROGRESS_MODES:
        source = "--progress" if flag is not None else f"${PROGRESS_ENV}"
        raise ConfigError(f"{source} must be one of {', '.join(PROGRESS_MODES)}, got {value!r}")
    return value


def launcher_process(proc: Path = Path("/proc")) -> tuple[str, int] | None:
    """The process name and pid of the nearest MPI launcher (LAUNCHERS) among this process's
    ancestors on this host; None when there is none or /proc cannot tell."""
    pid = os.getppid()
    for _ in range(16):
        try:
            name = (proc / str(pid) / "comm").read_text().strip()
            if name in LAUNCHERS:
                return name, pid
            stat = (proc / str(pid) / "stat").read_text()
            pid = int(stat.rsplit(")", 1)[1].split()[1])  # the name may hold spaces
        except (OSError, ValueError, IndexError):
            return None
        if pid <= 1:
            return None
    return None


def launcher_stdout_is_terminal(proc: Path = Path("/proc")) -> bool | None:
    """Whether the MPI launcher that started this process writes to a terminal; None when no
    launcher started it. Under a launcher whose process cannot be found (no /proc, another
    host), False: plain lines are the safe guess for output that may go to a file."""
    launcher = launcher_process(proc)
    if launcher is not None:
        try:
            target = os.readlink(proc / str(launcher[1]) / "fd" / "1")
        except OSError:
            return False
        return target.startswith(("/dev/pts/", "/dev/tty")) or target == "/dev/console"
    return False if any(v in os.environ for v in LAUNCHER_VARIABLES) else None


def terminal_columns(proc: Path = Path("/proc")) -> int | None:
    """Columns of the terminal the user sees: ``$COLUMNS`` when set, else those of the terminal
    the MPI launcher writes to (as resized since the start); None when neither says (rich then
    asks the process's own terminal: under mpiexec a pseudo-terminal of Open MPI's)."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    launcher = launcher_process(proc)
    if launcher is None:
        return None
    try:
        fd = os.open(proc / str(launcher[1]) / "fd" / "1", os.O_RDONLY | os.O_NOCTTY)
    except OSError:
        return None
    try:
        return os.get_terminal_size(fd).columns or None
    except OSError:  # not a terminal
        return None
    finally:
        os.close(fd)


def live_by_default(stream: TextIO) -> bool:
    """auto's choice: live on a terminal that the user sees, never in CI."""
    if os.environ.get("CI") or not getattr(stream, "isatty", lambda: False)():
        return False
    return launcher_stdout_is_terminal() is not False


def _is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _count(value: Any) -> str:
    return "-" if _is_missing(value) else f"{int(value):,}"


def _decimal(value: Any) -> str:
    return "-" if _is_missing(value) else f"{float(value):,.1f}"


def _rate(value: Any) -> str:
    """A rate or other small value in at most three digits: ``0.95``, ``1``, ``0``."""
    return "-" if _is_missing(value) else f"{float(value):.3g}"


def _target(value: float) -> str:
    """A stop criterion's value: ``20,000`` for a whole number (``--stop`` gives floats)."""
    value = float(value)
    return f"{int(value):,}" if value.is_integer() else f"{value:,}"


#: Stop criteria the line shows in a place of their own; any other is shown after the return.
_SHOWN = ("training_iteration", "timesteps_total", "episode_return_mean", "time_total_s",
          "eval_return_mean")
#: Fields a live line too wide for its terminal drops, first to last (by how a field starts or
#: ends); the plan's own values (``live_values``) go after env failures. The iteration, steps,
#: returns, stop criteria and time stay; what is still too wide is cut at the terminal's edge.
#: The log always gets the whole line.
_DROPPED_FIRST = ("mem driver", "env failures", "len ", "steps/s")


def fit(parts: list[str], width: int | None, separator: str = "  ",
        dropped: tuple[str, ...] = _DROPPED_FIRST) -> str:
    """``parts`` joined, without the fields of ``dropped`` (in that order) that make the line
    wider than ``width``; no more than ``width`` characters (None: no limit)."""
    parts = list(parts)
    for field in dropped:
        if width is None or len(separator.join(parts)) <= width:
            break
        parts = [p for p in parts if not (p.startswith(field) or p.endswith(field))]
    line = separator.join(parts)
    if width is not None and len(line) > width:
        line = line[:max(width - 1, 0)] + "\u2026"
    return line


def returns_reached(row: dict, reason: str | None = None) -> str:
    """The returns of a run's last row for its closing line: ``episode_return_mean 451.9``, each
    policy's in a multi-agent run, and the evaluation's, leaving out ``reason`` (the stop
    criterion the line has named with its value already) and those not measured (NaN)."""
    policies = [key for key in row if key.startswith("episode_return_mean/")]
    keys = [*(policies or ["episode_return_mean"]), "eval_return_mean"]
    return ", ".join(f"{key} {float(row[key]):.1f}" for key in keys
                     if key != reason and not _is_missing(row.get(key)))


class ProgressDisplay:
    """Rank 0's view of a run: env steps, steps/s, mean return, iteration, elapsed time, and each
    stop criterion against its target (``iter 7/10``; a multi-agent run's
    ``policy_return_mean_min 12.5/50``).

    ``mode`` is one of PROGRESS_MODES: a rich live display (live), one line per iteration
    (plain: CI, Slurm logs, ``> file``), nothing (off), or auto, which is live only on a terminal
    the user sees (``live_by_default``). A return that is None or NaN (no episode has ended yet)
    shows as ``-``. ``log`` gets the plain line of every iteration whatever the mode, and while
    the live display runs, what is printed (``output.log``).
    """

    def __init__(self, title: str, total_steps: float | None = None, mode: str = "auto",
                 stream: TextIO | None = None, stop: dict[str, float] | None = None,
                 log: TextIO | None = None,
                 columns: list[tuple[str, tuple[str, ...]]] | None = None,
                 values: tuple[tuple[str, str], ...] = ()) -> None:
        self.title = title
        #: The algorithm's own columns in place of return and length (``live_columns``).
        self.columns = columns
        #: The plan's own (label, key) values shown after the returns (``live_values``).
        self.values = tuple(values)
        self._dropped = (*_DROPPED_FIRST[:2], *(label for label, _ in self.values),
                         *_DROPPED_FIRST[2:])
        self.stop = dict(stop or {})
        self.total_steps = total_steps if total_steps is not None else self.stop.get(
            "timesteps_total")
        self.stream = sys.stdout if stream is None else stream
        self.log = log
        self.off = mode == "off"
        is_tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.live = live_by_default(self.stream) if mode == "auto" else mode == "live"
        self._progress = None
        self._task = None
        self._console = None
        self._unwrapped: tuple[Any, Any] | None = None
        if self.live:
            self._start_live(force_terminal=not is_tty)

    def _start_live(self, force_terminal: bool) -> None:
        from rich.console import Console, Group
        from rich.live import Live
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn
        from rich.text import Text

        # force_terminal: live=True was asked for on a stream that is not a TTY.
        console = self._console = Console(file=self.stream,
                                          force_terminal=force_terminal or None)
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(bar_width=None),
            TaskProgressColumn(),
            console=console,
            expand=True,
        )
        self._task = self._progress.add_task(self.title, total=self.total_steps)
        console.width = terminal_columns()
        # The stats get a line of their own: beside the bar they would not fit in 80 columns.
        self._last = self._stats({}, console.width)
        self._stats_text = Text(self._last, no_wrap=True)
        # Redrawn on update() only: no refresh thread running beside MPI calls.
        self._live = Live(Group(self._progress, self._stats_text), console=console,
                          auto_refresh=False)
        self._live.start(refresh=True)
        if self.log is not None:
            # Live sent sys.stdout and sys.stderr to its console (lines printed meanwhile go
            # above the bar); they go to the log too.
            self._unwrapped = (sys.stdout, sys.stderr)
            sys.stdout, sys.stderr = Tee(sys.stdout, self.log), Tee(sys.stderr, self.log)

    def _of(self, key: str, text: str, unit: str = "") -> str:
        """``text``, and ``/target`` when ``key`` is a stop criterion."""
        return text if key not in self.stop else f"{text}/{_target(self.stop[key])}{unit}"

    def _steps(self, row: dict) -> str:
        steps = _count(row.get("timesteps_total"))
        if self.total_steps is None:
            return f"steps {steps}"
        return f"steps {steps}/{_target(self.total_steps)}"

    def _return(self, row: dict) -> str:
        """``return R``, or in a multi-agent run each policy's return (``return main 0.4``): the
        env's return sums every agent's, which a zero-sum self-play game keeps at 0."""
        policies = [key.partition("/")[2] for key in row
                    if key.startswith("episode_return_mean/")]
        if not policies:
            return self._of("episode_return_mean",
                            f"return {_decimal(row.get('episode_return_mean'))}")
        return "return " + " ".join(
            self._of(f"episode_return_mean/{pid}",
                     f"{pid} {_decimal(row[f'episode_return_mean/{pid}'])}")
            for pid in policies)

    def _stats(self, row: dict, width: int | None = None) -> str:
        """The line for ``row``, fitted to ``width`` columns (``fit``; None: the whole line)."""
        sps = row.get("env_steps_per_s")
        sps_text = "-" if _is_missing(sps) else f"{float(sps):,.0f}"
        time_s = row.get("time_total_s")
        time_text = "-" if _is_missing(time_s) else f"{float(time_s):.1f}s"
        parts = [
            self._of("training_iteration", f"iter {_count(row.get('iteration'))}"),
            self._steps(row),
            f"{sps_text} steps/s",
        ]
        shown = _SHOWN
        if self.columns is None:
            parts.append(self._return(row))
        else:
            parts += [f"{label} {'/'.join(_rate(row.get(key)) for key in keys)}"
                      for label, keys in self.columns]
            shown = tuple(key for key in _SHOWN if key != "episode_return_mean")
        # What else the run stops on (a multi-agent run's policy_return_mean_min, or its summed
        # return): the return above is not what decides. A policy's own shows with its return.
        multiagent = any(key.startswith("episode_return_mean/") for key in row)
        parts += [self._of(key, f"{key} {_decimal(row.get(key))}") for key in self.stop
                  if (key not in shown or (multiagent and key == "episode_return_mean"))
                  and not (multiagent and key.startswith("episode_return_mean/"))]
        if self.columns is None and "episode_len_mean" in row:
            parts.append(f"len {_decimal(row['episode_len_mean'])}")
        if not _is_missing(row.get("eval_return_mean")) or "eval_return_mean" in self.stop:
            parts.append(self._of("eval_return_mean",
                                  f"eval {_decimal(row.get('eval_return_mean'))}"))
        parts += [f"{label} {float(row[key]):.3g}" for label, key in self.values
                  if not _is_missing(row.get(key))]
        if row.get("num_env_failures"):
            parts.append(f"env failures {_count(row['num_env_failures'])}")
        if not _is_missing(row.get("perf/driver_rss_mb")):
            # Resident memory: the driver's, then the largest worker rank's (docs: Metrics).
            memory = f"mem driver {float(row['perf/driver_rss_mb']):,.0f} MB"
            if not _is_missing(row.get("perf/max_worker_rss_mb")):
                memory += f", workers \u2264 {float(row['perf/max_worker_rss_mb']):,.0f} MB"
            parts.append(memory)
        parts.append(self._of("time_total_s", f"time {time_text}", "s"))
        return fit(parts, width, dropped=self._dropped)

    def update(self, row: dict) -> None:
        """Show the state after one iteration; ``row`` is a progress row (see RunRecorder)."""
        if self.log is not None:
            try:
                self.log.write(self._stats(row) + "\n")
            except (OSError, ValueError):  # a full disk must not end the run
                pass
        if self.off:
            return
        if self._progress is not None:
            steps = row.get("timesteps_total")
            self._progress.update(self._task, completed=0 if _is_missing(steps) else steps)
            # Asked at every update: the terminal may have been resized.
            self._console.width = terminal_columns()
            self._last = self._stats_text.plain = self._stats(row, self._console.width)
            self._live.refresh()
        else:
            print(self._stats(row), file=self.stream, flush=True)

    def end_line(self) -> None:
        """End the live display's partial last line with a newline, for a process about to die
        with the display still up (a second Ctrl-C): what is printed next starts a line, and the
        cursor the display hid shows again."""
        if self._progress is not None:
            with contextlib.suppress(OSError, ValueError):
                self._live.console.file.write("\n")
                self._live.console.show_cursor(True)
                self._live.console.file.flush()

    def note(self, text: str) -> None:
        """Say what the iteration under way does (a long evaluation): below the last
        iteration's line on the live display until the next update, else a line of its own."""
        if self.log is not None:
            try:
                self.log.write(text + "\n")
            except (OSError, ValueError):
                pass
        if self.off:
            return
        if self._progress is not None:
            self._stats_text.plain = f"{self._last}\n{text}"
            self._live.refresh()
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        """Stop the live display, leaving its last state on screen; closing twice is harmless."""
        if self._progress is not None:
            if self._unwrapped is not None:
                sys.stdout, sys.stderr = self._unwrapped
                self._unwrapped = None
            self._live.stop()
            self._progress = None

    def __enter__(self) -> ProgressDisplay:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
