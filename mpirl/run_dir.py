"""A run directory: what a training run leaves on disk.

* ``params.json``: the run's parameters, written once;
* ``progress.csv``: one row per iteration, flushed and fsynced as it is written, so the rows of a
  killed run survive;
* ``result.json``: the latest row, replaced atomically each iteration, so a reader never sees a
  half-written file;
* ``events.out.tfevents.*``: every numeric value as a TensorBoard scalar.
"""

from __future__ import annotations

import csv
import json
import math
import numbers
import os
import time
from pathlib import Path
from typing import Any

from mpirl.tensorboard import EventWriter

PARAMS_FILE = "params.json"
PROGRESS_FILE = "progress.csv"
RESULT_FILE = "result.json"


def _plain(value: Any) -> Any:
    """Turn NumPy scalars into Python ones: ``repr(np.float32(1.5))`` is not ``"1.5"``."""
    if isinstance(value, bool | str) or value is None:
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def default_run_dir(algo: str, env: str) -> str:
    """The run directory ``mpirl train`` uses when --run-dir is left out (``mpirl launch``
    names it the same way)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return f"runs/{algo.upper()}-{env.replace(':', '_')}-{stamp}"


def json_default(value: Any) -> Any:
    if hasattr(value, "item"):  # NumPy scalars and 0-d arrays
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def _strict_json(value: Any) -> Any:
    # NaN and inf are not JSON; writing null keeps result.json readable by any JSON parser.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as file:
        file.write(text)
    # No fsync: this guards against a killed process, not a lost machine, and result.json can
    # be rebuilt from the fsynced progress.csv.
    os.replace(tmp, path)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value)  # shortest text that reads back as the same float
    return str(value)


class RunRecorder:
    """Writes a run directory: params.json once, progress.csv one row per iteration, result.json
    (the last row, rewritten atomically each iteration), TensorBoard event files.

    The CSV's columns are fixed by its first row (or, on resume, by the existing header): a key
    that first appears later goes to result.json and TensorBoard but not to the CSV, and a
    missing key is an empty cell. ``resume=True`` keeps an existing params.json and appends to an
    existing progress.csv, after dropping its rows past iteration ``keep_iterations`` (the
    resumed run does those iterations again); ``resume=False`` writes both afresh.
    """

    def __init__(self, run_dir: str | Path, params: dict, resume: bool = False,
                 keep_iterations: int | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        params_path = self.run_dir / PARAMS_FILE
        if not (resume and params_path.exists()):
            write_atomically(params_path, json.dumps(params, indent=2, sort_keys=True,
                                                      default=json_default) + "\n")
        progress_path = self.run_dir / PROGRESS_FILE
        self._columns: list[str] | None = None
        if resume and progress_path.exists():
            self._columns = _read_header_and_trim(progress_path, keep_iterations)
        self._csv_file = open(progress_path, "a" if resume else "w", encoding="utf-8",
                              newline="")
        self._csv = csv.writer(self._csv_file, lineterminator="\n")
        self._events = EventWriter(self.run_dir)
        self._rows = 0

    @property
    def columns(self) -> list[str] | None:
        """The CSV's columns, or None before the first row of a new file."""
        return None if self._columns is None else list(self._columns)

    def record(self, row: dict[str, float | int | str | None]) -> None:
        """Append ``row`` to progress.csv, replace result.json with it, and log it to TensorBoard.

        The TensorBoard step is ``row["timesteps_total"]`` if present, else ``row["iteration"]``.
        """
        if self._csv_file.closed:
            raise ValueError(f"RunRecorder for {self.run_dir} is closed")
        row = {key: _plain(value) for key, value in row.items()}
        if self._columns is None:
            self._columns = list(row)
            self._csv.writerow(self._columns)
        self._csv.writerow([_cell(row.get(column)) for column in self._columns])
        self._csv_file.flush()
        os.fsync(self._csv_file.fileno())

        write_atomically(
            self.run_dir / RESULT_FILE,
            json.dumps({key: _strict_json(value) for key, value in row.items()}, indent=2,
                       default=json_default) + "\n",
        )

        self._rows += 1
        step = next((int(row[key]) for key in ("timesteps_total", "iteration")
                     if _is_number(row.get(key)) and math.isfinite(row[key])), self._rows)
        for key, value in row.items():
            if _is_number(value):
                self._events.add_scalar(key, value, step)
        self._events.flush()

    def close(self) -> None:
        """Close progress.csv and the event file; closing twice is harmless."""
        if not self._csv_file.closed:
            self._csv_file.close()
        self._events.close()

    def __enter__(self) -> RunRecorder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _read_header_and_trim(path: Path, keep_iterations: int | None = None) -> list[str] | None:
    """The header of an existing progress.csv, or None if it has none.

    A run killed in the middle of writing a row leaves a partial last line; it is cut off so
    that the rows appended next start on a line of their own. With ``keep_iterations``, rows
    whose ``iteration`` is larger are cut off too.
    """
    with open(path, "rb+") as file:
        data = file.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            file.truncate(end)
            data = data[:end]
        if not data.strip():
            return None
        lines = data.decode("utf-8").splitlines(keepends=True)
        header = next(csv.reader([lines[0]]))
        if keep_iterations is not None and "iteration" in header:
            column = header.index("iteration")
            kept = 1
            for line in lines[1:]:
                cells = next(csv.reader([line]), [])
                if len(cells) > column and cells[column] and int(cells[column]) > keep_iterations:
                    break
                kept += 1
            if kept < len(lines):
                file.seek(sum(len(line.encode("utf-8")) for line in lines[:kept]))
                file.truncate()
    return header
