"""A run directory: what a training run leaves on disk.

* ``params.json``: the run's parameters, written once;
* ``progress.csv``: one row per iteration, flushed as it is written, so the rows of a killed
  process survive; fsynced before each checkpoint and at the end (``RunRecorder.sync``), so the
  rows a resume keeps survive a lost node too (the rows after the checkpoint are run again);
* ``result.json``: the latest row, replaced atomically (a reader never sees a half-written
  file) at most every ``RESULT_WRITE_S`` seconds, and at each ``sync`` and at the end;
* ``events.out.tfevents.*``: every numeric value as a TensorBoard scalar, flushed every
  ``EVENTS_FLUSH_S`` seconds or so and at each ``sync``;
* ``run.lock``: the job that writes the directory now (see ``RunLock``).
"""

from __future__ import annotations

import csv
import json
import math
import numbers
import os
import queue
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from mpirl.errors import EXIT_USAGE, MpirlError
from mpirl.report.tensorboard import EventWriter

PARAMS_FILE = "params.json"
#: What marks a tune directory (``mpirl tune``): the population's saved state.
TUNE_STATE_FILE = "tune_state.json"
PROGRESS_FILE = "progress.csv"
RESULT_FILE = "result.json"


_PLAIN_TYPES = frozenset((float, int, bool, str, type(None)))


def _plain(value: Any) -> Any:
    """Turn NumPy scalars into Python ones: ``repr(np.float32(1.5))`` is not ``"1.5"``."""
    if type(value) in _PLAIN_TYPES:  # most of a row; skips the slow ABC checks below
        return value
    if isinstance(value, bool | str) or value is None:
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def flat_name(text: str) -> str:
    """``text`` (an env id, an algorithm's module path) as one path component: namespaced ids
    such as ``ALE/Breakout-v5`` become ``ALE-Breakout-v5``, ``module:Class`` ``module_Class``."""
    return text.replace(":", "_").replace("/", "-").replace("\\", "-")


def default_run_dir(algo: str, env: str, prefix: str = "") -> str:
    """The run directory ``mpirl train`` uses when --run-dir is left out (``mpirl launch``
    names it the same way; ``mpirl tune``'s is the same with ``prefix`` "tune-"): one folder
    under ``runs/``, whatever the env id holds. ``algo`` is spelled as the caller has it:
    ``mpirl train`` and ``mpirl tune`` pass ``contract.algorithm_name``'s spelling, ``mpirl
    launch`` (which imports no algorithm, to stay clear of MPI) the one typed after --algo."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return f"runs/{prefix}{flat_name(algo)}-{flat_name(env)}-{stamp}"


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


def _json_lines(row: dict[str, Any]) -> str:
    """``row`` as JSON, a key per line. Not ``indent=2``: that takes json's pure-Python encoder,
    about 0.8 ms of rank 0's CPU per row of 30 keys; these separators keep the C one."""
    if not row:
        return "{}\n"
    text = json.dumps(row, separators=(",\n  ", ": "), default=json_default)
    return "{\n  " + text[1:-1] + "\n}\n"


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


EVENTS_FLUSH_S = 5.0
"""The longest between two flushes of the TensorBoard file (each an fsync, in tensorboardX).
Flushing it at every row cost about 0.1 ms of rank 0's CPU per iteration here, fsyncing
progress.csv as much again; on a parallel file system an fsync can take milliseconds."""


RESULT_WRITE_S = 5.0
"""The longest result.json lags behind progress.csv. Replacing it is a file creation and a
rename: about 0.45 ms of rank 0's CPU per iteration at 64 ranks here, the largest fixed cost of
an iteration, and two metadata operations on a parallel file system's server."""


class RunRecorder:
    """Writes a run directory: params.json, progress.csv one row per iteration, result.json
    (the last row, rewritten atomically every ``RESULT_WRITE_S`` seconds or so), TensorBoard
    event files.

    The CSV's columns are its first row's keys (or, on resume, the existing header's), and a
    missing key is an empty cell. A key that first appears later (a custom metric reported from
    some iteration on) adds a column at the end: the file is rewritten with it, empty in the
    earlier rows (``_widen``), which costs a copy of the file each time.

    params.json is written every time: on resume it holds the values the run goes on with
    (config keys changed on the resuming command line included), so that the next --resume
    keeps them. ``resume=True`` appends to an existing progress.csv, after
    dropping its rows past iteration ``keep_iterations`` (the resumed run does those iterations
    again); ``resume=False`` writes it afresh.

    ``in_background``: a thread of the recorder's own writes the rows, so that the driving
    thread only hands each over. Writing a row (the CSV line, TensorBoard's protobuf, the other
    loggers) took 0.5-0.8 ms of rank 0's main thread per iteration here, while every rollout
    rank of a synchronous algorithm waited for its next call; the thread writes it while they
    sample. ``sync`` and ``close`` wait until every row handed over is written.
    """

    def __init__(self, run_dir: str | Path, params: dict, resume: bool = False,
                 keep_iterations: int | None = None, loggers: list[Any] = (),
                 in_background: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        params_path = self.run_dir / PARAMS_FILE
        # Not sorted: the order of the config's keys means something (a multi-agent run's
        # policies are set up, given learner ranks and run in the order given).
        write_atomically(params_path, json.dumps(params, indent=2, default=json_default) + "\n")
        progress_path = self.run_dir / PROGRESS_FILE
        self._columns: list[str] | None = None
        if resume and progress_path.exists():
            self._columns = _read_header_and_trim(progress_path, keep_iterations)
        self._column_set = set(self._columns or ())
        self._closed = False
        self._csv_file = open(progress_path, "a" if resume else "w", encoding="utf-8",
                              newline="")
        self._csv = csv.writer(self._csv_file, lineterminator="\n")
        self._events = EventWriter(self.run_dir)
        #: Loggers besides TensorBoard (mpirl.report.loggers): each gets every row.
        self._loggers = list(loggers)
        self._rows = 0
        self._events_flushed = time.monotonic()
        self._result_row: dict[str, Any] | None = None  # the row result.json is to hold
        self._result_written = -math.inf
        # With in_background, rows are written by a thread of their own (``_write_rows``), and
        # what it raised is raised by the next record, sync or close.
        self._rows_to_write: queue.SimpleQueue | None = None
        self._writer: threading.Thread | None = None
        self._write_failure: BaseException | None = None
        if in_background:
            self._rows_to_write = queue.SimpleQueue()
            self._writer = threading.Thread(target=self._write_rows, daemon=True,
                                            name="mpirl-run-recorder")
            self._writer.start()

    @property
    def columns(self) -> list[str] | None:
        """The CSV's columns, or None before the first row of a new file."""
        return None if self._columns is None else list(self._columns)

    def record(self, row: dict[str, float | int | str | None],
               histograms: dict[str, Any] | None = None) -> None:
        """Append ``row`` to progress.csv, replace result.json with it, and log it to TensorBoard
        (with ``histograms``: tag -> array) and the other loggers.

        The TensorBoard step is ``row["timesteps_total"]`` if present, else ``row["iteration"]``.

        With ``in_background`` the caller only hands the row over: the recorder's thread writes
        it (``sync`` waits until it has).
        """
        # A flag, not the file's state: the writer thread swaps the file when it widens it.
        if self._closed:
            raise ValueError(f"RunRecorder for {self.run_dir} is closed")
        self._raise_write_failure()
        if self._rows_to_write is not None:
            self._rows_to_write.put((dict(row), histograms))
        else:
            self._write_row(row, histograms)

    def _write_rows(self) -> None:
        """The writer thread: write each row handed over, until ``None``; an ``Event`` is set
        once every row before it is written."""
        while (item := self._rows_to_write.get()) is not None:
            if isinstance(item, threading.Event):
                item.set()
            elif self._write_failure is None:
                try:
                    self._write_row(*item)
                except BaseException as error:  # noqa: BLE001 - raised on the caller's thread
                    self._write_failure = error

    def _wait_for_writer(self) -> None:
        """Return once every row recorded so far is written (at once without a writer)."""
        if self._rows_to_write is not None and self._writer.is_alive():
            written = threading.Event()
            self._rows_to_write.put(written)
            written.wait()
        self._raise_write_failure()

    def _raise_write_failure(self) -> None:
        if self._write_failure is not None:
            failure, self._write_failure = self._write_failure, None
            raise failure

    def _write_row(self, row: dict[str, Any], histograms: dict[str, Any] | None) -> None:
        row = {key: _plain(value) for key, value in row.items()}
        if self._columns is None:
            self._columns = list(row)
            self._column_set = set(row)
            self._csv.writerow(self._columns)
        elif not self._column_set.issuperset(row):
            self._widen([key for key in row if key not in self._column_set])
        self._csv.writerow([_cell(row.get(column)) for column in self._columns])
        self._csv_file.flush()

        self._result_row = row
        if time.monotonic() - self._result_written >= RESULT_WRITE_S:
            self._write_result()

        self._rows += 1
        step = next((int(row[key]) for key in ("timesteps_total", "iteration")
                     if _is_number(row.get(key)) and math.isfinite(row[key])), self._rows)
        self._events.add_scalars({key: value for key, value in row.items() if _is_number(value)},
                                 step)
        for tag, values in (histograms or {}).items():
            self._events.add_histogram(tag, values, step)
        if time.monotonic() - self._events_flushed >= EVENTS_FLUSH_S:
            self._flush_events()
        for logger in self._loggers:
            logger.log(row, step)

    def _widen(self, new: list[str]) -> None:
        """Give progress.csv the columns ``new`` at the end, empty in the rows written so far.

        The widened copy is written to a temporary file, fsynced and renamed over progress.csv,
        so that a kill at any moment leaves one whole file, the old or the new, for --resume
        (which reads its header); a temporary file a kill left behind is overwritten next time.
        """
        path = self.run_dir / PROGRESS_FILE
        tmp = path.with_name(f".{path.name}.tmp")
        columns = [*self._columns, *new]
        self._csv_file.flush()
        with (open(path, encoding="utf-8", newline="") as old,
              open(tmp, "w", encoding="utf-8", newline="") as file):
            rows = csv.reader(old)
            next(rows, None)  # the old header
            writer = csv.writer(file, lineterminator="\n")
            writer.writerow(columns)
            for cells in rows:
                writer.writerow(cells + [""] * (len(columns) - len(cells)))
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
        fsync_directory(self.run_dir)  # the rename itself, before rows go to the new file
        # The new file is open before the old one closes: record() may look at it meanwhile.
        widened = open(path, "a", encoding="utf-8", newline="")
        self._csv_file, old_file = widened, self._csv_file
        old_file.close()
        self._csv = csv.writer(self._csv_file, lineterminator="\n")
        self._columns = columns
        self._column_set.update(new)

    def sync(self) -> None:
        """Put every row recorded so far on disk: progress.csv fsynced, the TensorBoard file
        flushed, result.json the latest row. Called before each checkpoint, so that a resume
        finds the rows it keeps."""
        self._wait_for_writer()
        self._sync_csv()
        self._flush_events()
        self._write_result()

    def _write_result(self) -> None:
        if self._result_row is not None:
            write_atomically(self.run_dir / RESULT_FILE, _json_lines(
                {key: _strict_json(value) for key, value in self._result_row.items()}))
            self._result_row = None
            self._result_written = time.monotonic()

    def _sync_csv(self) -> None:
        if not self._csv_file.closed:
            self._csv_file.flush()
            os.fsync(self._csv_file.fileno())

    def _flush_events(self) -> None:
        self._events.flush()
        self._events_flushed = time.monotonic()

    def close(self) -> None:
        """Sync progress.csv and close it, then the event file (closing flushes it); closing
        twice is harmless."""
        self._closed = True
        if self._writer is not None and self._writer.is_alive():
            self._rows_to_write.put(None)
            self._writer.join()
        failure, self._write_failure = self._write_failure, None
        if not self._csv_file.closed:
            self._sync_csv()
            self._csv_file.close()
        self._write_result()
        self._events.close()
        for logger in self._loggers:
            logger.close()
        self._loggers = []
        if failure is not None:
            raise failure

    def __enter__(self) -> RunRecorder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def fsync_directory(path: Path) -> None:
    """Make the renames and creations inside ``path`` durable (a file's fsync does not)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


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


LOCK_FILE = "run.lock"
#: The holder touches its lock this often, from a thread, so a long iteration never looks dead.
LOCK_REFRESH_S = 30.0
#: A lock on another host, of another Slurm job, untouched this long is a dead holder's.
LOCK_STALE_S = 300.0


class RunDirLocked(MpirlError):
    """Another live job holds the run directory."""

    exit_code = EXIT_USAGE


def _process_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (Linux), or None."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as file:
            text = file.read()
    except OSError:
        return None
    return text.rpartition(")")[2].split()


def _process_start(pid: int) -> str | None:
    """The start time of ``pid`` in clock ticks since boot (Linux), telling a reused pid apart."""
    fields = _process_stat(pid)
    return None if fields is None else fields[19]


def _pid_alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    fields = _process_stat(pid)
    if fields is None:
        return True  # no /proc to ask (not Linux): the signal said it exists
    # A zombie has exited but not been reaped. In containers whose init never reaps, a killed
    # job's rank 0 stays one for good; it holds nothing.
    if fields[0] in ("Z", "X"):
        return False
    return start is None or fields[19] == start


def _holder_text(holder: dict[str, Any]) -> str:
    """``host H, pid P``, and ``, Slurm job J`` for a holder that ran in a Slurm job."""
    text = f"host {holder.get('host')}, pid {holder.get('pid')}"
    return text + (f", Slurm job {holder['job_id']}" if holder.get("job_id") else "")


class RunLock:
    """``run.lock`` in a run directory: one job at a time writes the directory.

    Taken by rank 0 only, before anything is written; nothing crosses ranks. The file is created
    with a hard link of a complete file (atomic on local disks, Lustre and NFS, which may lack
    flock) and holds the holder's host, pid, Slurm job id and start time. A holder that is dead
    is taken over: on this host, a pid that no longer runs; on another host, a lock of this same
    Slurm job before it was requeued (same ``SLURM_JOB_ID``, smaller ``SLURM_RESTART_COUNT``: the
    old allocation is gone), or one whose mtime, which the holder refreshes every
    ``LOCK_REFRESH_S`` from a thread, is older than ``LOCK_STALE_S``. A live
    holder makes ``acquire`` raise ``RunDirLocked`` (exit code 2) naming it.
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.held: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None

    def acquire(self) -> list[str]:
        """Take the lock, or raise RunDirLocked; return notes on a dead holder taken over."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        mine = {"host": socket.gethostname(), "pid": os.getpid(),
                "job_id": os.environ.get("SLURM_JOB_ID"),
                "restart": int(os.environ.get("SLURM_RESTART_COUNT") or 0),
                "pid_start": _process_start(os.getpid()),
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "token": uuid.uuid4().hex}
        tmp = self.run_dir / f".{LOCK_FILE}.{mine['token']}"
        tmp.write_text(json.dumps(mine) + "\n", encoding="utf-8")
        notes = []
        try:
            for _ in range(3):
                try:
                    os.link(tmp, self.path)
                    break
                except FileExistsError:
                    pass
                holder = self._read()
                if holder is None:  # released between our link and our read: try again
                    continue
                if self._alive(holder, mine):
                    raise RunDirLocked(
                        f"run directory {self.run_dir} is in use by another job: "
                        f"{_holder_text(holder)} (since {holder.get('started')}); "
                        f"stop that job first, or remove {self.path} if it is gone")
                if self._take_over(holder):
                    notes.append(f"took over {self.path} from a job that is gone "
                                 f"({_holder_text(holder)})")
            else:
                raise RunDirLocked(f"could not take {self.path}: other jobs keep taking it")
        finally:
            tmp.unlink(missing_ok=True)
        self.held = mine
        self._refresher = threading.Thread(target=self._refresh, name="mpirl-run-lock",
                                           daemon=True)
        self._refresher.start()
        return notes

    def release(self) -> None:
        """Remove the lock if it is still ours; releasing twice is harmless."""
        if self.held is None:
            return
        self._stop.set()
        if self._refresher is not None:
            self._refresher.join()
        holder = self._read()
        if holder is not None and holder.get("token") == self.held["token"]:
            self.path.unlink(missing_ok=True)
        self.held = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def _read(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, UnicodeDecodeError):
            return {}  # not ours to judge by content: its mtime says whether it is stale

    def _alive(self, holder: dict[str, Any], mine: dict[str, Any]) -> bool:
        if holder.get("host") == mine["host"] and isinstance(holder.get("pid"), int):
            return _pid_alive(holder["pid"], holder.get("pid_start"))
        if (mine["job_id"] and holder.get("job_id") == mine["job_id"]
                and isinstance(holder.get("restart"), int) and holder["restart"] < mine["restart"]):
            return False  # this job was requeued: its earlier run's allocation is gone
        try:
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return False
        return age < LOCK_STALE_S

    def _take_over(self, holder: dict[str, Any]) -> bool:
        """Move the dead holder's lock aside; False (and it stays) if it changed meanwhile."""
        aside = self.path.with_name(f".{LOCK_FILE}.dead-{uuid.uuid4().hex}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        try:
            moved = json.loads(aside.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            moved = {}
        if moved.get("token") != holder.get("token"):
            # Another job took it over and locked it between our read and our rename: put its
            # lock back (a link fails if yet another one exists, which then is the holder).
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
        aside.unlink(missing_ok=True)
        return moved.get("token") == holder.get("token")

    def _refresh(self) -> None:
        while not self._stop.wait(LOCK_REFRESH_S):
            try:
                os.utime(self.path)
            except OSError:  # removed by hand: nothing to refresh; the run goes on
                pass
