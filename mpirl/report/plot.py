"""Learning curves of one or more runs, from their progress.csv files."""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path

from mpirl.errors import ConfigError

PROGRESS = "progress.csv"
RETURN = "episode_return_mean"
WALL_TIME = "time_total_s"


def _number(text: str, path: Path, line: int, column: str) -> float:
    if text == "":
        return math.nan  # no value yet, e.g. the return before the first episode ends
    try:
        return float(text)
    except ValueError:
        raise ConfigError(
            f"{path}, line {line}: column {column!r} holds {text!r}, which is not a number"
        ) from None


def find_runs(paths: list[str | Path]) -> list[Path]:
    """The run directories ``paths`` name: each path that holds a progress.csv, and for a folder
    without one (``runs/``, a tune directory) every run directory below it, in name order.
    ConfigError naming the path when it does not exist, is a file, or holds no run."""
    runs = []
    for path in map(Path, paths):
        if not path.exists():
            raise ConfigError(f"run directory {path} does not exist")
        if not path.is_dir():
            raise ConfigError(f"{path} is a file, not a run directory; give run directories, or "
                              f"a folder that holds them (mpirl plot runs)")
        if (path / PROGRESS).is_file():
            runs.append(path)
            continue
        below = sorted(csv_path.parent for csv_path in path.rglob(PROGRESS) if csv_path.is_file())
        if not below:
            raise ConfigError(f"run directory {path} has no {PROGRESS}, nor any run directory "
                              f"below it")
        runs.extend(below)
    return list(dict.fromkeys(runs))  # runs/ and runs/a given together: runs/a once


def default_output(paths: list[str | Path]) -> Path:
    """Where ``mpirl plot`` writes without ``-o``: ``curve.png`` in the one folder given, or in
    the folder that holds every one given."""
    try:
        folder = os.path.commonpath([os.path.normpath(p) for p in paths])
    except ValueError:  # relative and absolute paths mixed
        folder = os.path.commonpath([os.path.abspath(p) for p in paths])
    return Path(folder) / "curve.png"


def _read_run(run_dir: Path, columns: list[str]) -> dict[str, list[float]]:
    path = run_dir / PROGRESS
    if not path.is_file():
        raise ConfigError(f"run directory {run_dir} has no {PROGRESS}")
    with open(path, encoding="utf-8", newline="") as file:
        reader = csv.DictReader(file)
        header = reader.fieldnames or []
        missing = [column for column in columns if column not in header]
        if not header:
            raise ConfigError(f"{path} is empty")
        if missing:
            raise ConfigError(f"{path} lacks the column(s) {', '.join(missing)} needed to plot "
                              f"(its columns: {', '.join(header)})")
        series: dict[str, list[float]] = {column: [] for column in columns}
        for line, row in enumerate(reader, start=2):
            for column in columns:
                series[column].append(_number(row[column] or "", path, line, column))
    if not series[columns[0]]:
        raise ConfigError(f"{path} has a header but no rows")
    return series


def _labels(run_dirs: list[Path]) -> list[str]:
    names = [run_dir.resolve().name for run_dir in run_dirs]
    # Runs of the same name in different places (seed_0 of two sweeps) need their parent too.
    return [
        f"{run_dir.resolve().parent.name}/{name}" if names.count(name) > 1 else name
        for run_dir, name in zip(run_dirs, names, strict=True)
    ]


def plot_runs(run_dirs: list[str | Path], out_png: str | Path | None = None,
              x: str = "timesteps_total") -> Path:
    """Mean return vs env steps, and vs wall time (time_total_s), as a PNG with two panels,
    several runs overlaid, one line per run, labelled by run dir name. Reads each run's
    progress.csv; a folder without one stands for every run directory below it (``find_runs``).
    ``out_png`` None: ``default_output(run_dirs)``.

    Raises ConfigError naming the path if a run dir or its progress.csv is missing or empty or
    lacks the needed columns. Returns the PNG's path.
    """
    if not run_dirs:
        raise ConfigError("plot_runs needs at least one run directory")
    dirs = find_runs(run_dirs)
    columns = list(dict.fromkeys([x, WALL_TIME, RETURN]))
    runs = [_read_run(run_dir, columns) for run_dir in dirs]

    # The object API with the Agg canvas: no pyplot global state, no GUI backend selection.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    by_x, by_time = figure.subplots(1, 2, sharey=True)
    for label, series in zip(_labels(dirs), runs, strict=True):
        by_x.plot(series[x], series[RETURN], label=label)
        by_time.plot(series[WALL_TIME], series[RETURN], label=label)
    by_x.set_xlabel("env steps" if x == "timesteps_total" else x)
    by_time.set_xlabel("wall time (s)")
    by_x.set_ylabel("mean episode return")
    for axes in (by_x, by_time):
        axes.grid(True, alpha=0.3)
    by_x.legend(loc="best", fontsize="small")

    out = Path(out_png) if out_png is not None else default_output(run_dirs)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, format="png", dpi=100)
    return out
