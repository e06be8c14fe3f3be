"""Trajectory dumps: every rollout rank writes the episodes it completes to its own HDF5 file.

Layout (Minari's, so ``minari.load_dataset`` reads it) of one dump directory::

    DIR/rollout-s{session}-w{worker}.hdf5   one per rollout rank and run start; episode_{k}
                                            groups with observations (T+1 rows), actions,
                                            rewards, terminations, truncations, infos/action_logp
    DIR/main_data.hdf5                      external links episode_{g} -> (file, episode_{k}),
                                            g = 0, 1, ... over the whole dump
    DIR/metadata.json                       Minari's metadata: spaces, env spec, totals

What crosses ranks: the driver sends each rollout worker a ``DumpTarget`` (directory, session,
compression) once, at spawn; each ``sample`` call returns the local ids and lengths of the
episodes it wrote. Episode data never leaves its rollout rank. Only the driver writes
``main_data.hdf5`` and ``metadata.json`` (``DumpIndex``), after each iteration;
``mpirl.data.reader`` also finds episodes that a killed run wrote but never indexed.

Each run start (fresh or ``--resume``) is a new session: its ranks write new files, so no
existing episode is ever reopened or overwritten.

A per-rank file that cannot be read (truncated, overwritten, replaced) is quarantined when a
dumping run starts or resumes in its directory: renamed ``*.hdf5.damaged``, its links dropped from
``main_data.hdf5``, and recorded under ``mpirl_quarantined`` in ``metadata.json`` with the
number of indexed episodes lost. Readers (``mpirl.data.reader``) skip such a file without
touching it.

File locks: HDF5 locks every file it opens (flock). Where the file system refuses (NFS without
a lock daemon, Lustre mounted without flock), ``open_hdf5`` opens without the lock.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpirl.data.episode_file import EpisodeFile
from mpirl.errors import NO_ROOM_ERRNOS, ConfigError, MpirlError

__all__ = ["DumpTarget"]

#: Longest time a completed episode waits on its rollout rank before going to the writer.
SEND_INTERVAL_S = 0.05


@dataclass(frozen=True)
class DumpSettings:
    """Trajectory dumps of a run. Every field is a config key."""

    dump_trajectories: str | None = None
    """Directory that every rollout rank writes its episodes to (HDF5, Minari's layout); None
    writes none. ``--dump-trajectories DIR`` sets it."""
    dump_compression_level: int = 1
    """gzip level of the dumped datasets (0 stores them uncompressed; 1 is the fastest)."""
    dump_compression_min_bytes: int = 4096
    """Datasets at least this large are chunked and compressed; smaller ones (most arrays of a
    short episode) are stored contiguous, which is smaller and faster for them. 0: all."""
    dump_writer_process: bool = True
    """Write each rank's file from a child process, off the sampling loop (False: in the
    rollout worker itself)."""

    def __post_init__(self) -> None:
        if not 0 <= self.dump_compression_level <= 9:
            raise ConfigError(f"dump_compression_level must be 0..9, got "
                              f"{self.dump_compression_level}")
        if self.dump_trajectories is not None and not isinstance(self.dump_trajectories, str):
            raise ConfigError(f"dump_trajectories must be a directory path, got "
                              f"{self.dump_trajectories!r}")


@dataclass(frozen=True)
class DumpTarget:
    """What a rollout worker needs to write its file; sent once, at spawn."""

    directory: str
    session: int
    compression_level: int = 1
    compression_min_bytes: int = 4096
    writer_process: bool = True

    def file_name(self, worker: int) -> str:
        return f"rollout-s{self.session}-w{worker}.hdf5"


class DumpWriterTimeout(MpirlError):
    """A rank's trajectory writer did not confirm the episodes sent to it in time."""


#: How long a rollout rank waits at the end of a run for its trajectory writer to confirm the
#: episodes sent to it.
WRITER_ACK_TIMEOUT_S = 60.0


class _WriterProcess:
    """A child process that writes this rank's episodes, so that HDF5's per-object cost
    (~0.25 ms of CPU an episode) is off the sampling loop. Episodes go down its stdin as pickles; it
    answers each batch with the (id, steps) it wrote and closed, read here by a thread. Killed
    rank: the writer sees EOF, writes what it has and closes the file."""

    def __init__(self, path: Path, attrs: dict[str, Any], level: int, min_bytes: int) -> None:
        import subprocess
        import threading

        spec = json.dumps({"path": str(path), "attrs": attrs, "level": level,
                           "min_bytes": min_bytes})
        # Its own session: a signal to the job's process group leaves it to finish writing.
        self.proc = subprocess.Popen([sys.executable, "-m", "mpirl.data.dump_writer", spec],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     start_new_session=True)
        self.path = path
        _widen_pipe(self.proc.stdin.fileno())
        self.acked: list[tuple[int, int]] = []
        self.lock = threading.Lock()
        self.in_flight = 0
        self.done = threading.Condition(self.lock)
        self.reader = threading.Thread(target=self._read_acks, daemon=True)
        self.reader.start()

    def _read_acks(self) -> None:
        for line in self.proc.stdout:
            with self.lock:
                self.acked.extend(tuple(pair) for pair in json.loads(line))
                self.in_flight -= 1
                self.done.notify_all()
        with self.lock:
            self.in_flight = -1  # the writer is gone
            self.done.notify_all()

    def send(self, block: dict[str, Any]) -> None:
        import pickle

        payload = pickle.dumps(block, protocol=5)
        with self.lock:
            if self.in_flight < 0:
                self._failed()
            self.in_flight += 1
        try:
            self.proc.stdin.write(len(payload).to_bytes(8, "little") + payload)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self._failed()

    def take_acked(self, wait: bool = False, timeout: float | None = None
                   ) -> list[tuple[int, int]]:
        """(id, steps) of the episodes written and closed since the last call; with ``wait``, once
        every episode sent is, or ``DumpWriterTimeout`` after ``timeout`` seconds
        (``WRITER_ACK_TIMEOUT_S`` by default)."""
        timeout = WRITER_ACK_TIMEOUT_S if timeout is None else timeout
        with self.lock:
            if wait and not self.done.wait_for(lambda: self.in_flight <= 0, timeout=timeout):
                raise DumpWriterTimeout(
                    f"the trajectory writer of {self.path} (pid {self.proc.pid}) has not "
                    f"confirmed {self.in_flight} batch(es) of episodes after {timeout:g} s (a "
                    f"hung file system?); their episodes are not in the dump's index and may be "
                    f"missing from the file. The training results and checkpoints are complete.")
            acked, self.acked = self.acked, []
        return acked

    def _failed(self) -> None:
        self.proc.wait(timeout=10)
        if self.proc.returncode == WRITER_NO_ROOM_EXIT:
            raise OSError(errno.ENOSPC, f"No space left on device: {self.path}")
        raise RuntimeError(f"the trajectory writer of {self.path} ended (exit code "
                           f"{self.proc.returncode}); see its error above")

    def close(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        self.proc.wait(timeout=120)


#: Bytes the pipe to the writer holds. Linux's default, 64 KiB, is less than one batch of
#: CartPole episodes (about 90 KiB every SEND_INTERVAL_S); the rollout rank then blocked in
#: every send that found the writer busy with the previous batch.
PIPE_BYTES = 2**20


def _widen_pipe(fd: int) -> None:
    """Let the pipe ``fd`` hold PIPE_BYTES, where Linux allows it; elsewhere, nothing."""
    import fcntl

    set_size = getattr(fcntl, "F_SETPIPE_SZ", None)
    if set_size is None:
        return
    try:
        fcntl.fcntl(fd, set_size, PIPE_BYTES)
    except OSError:
        pass  # above /proc/sys/fs/pipe-max-size for this user: the default size still works


def _writer_main(spec_text: str) -> int:
    """The writer process: read pickled batches from stdin until EOF, write each, answer."""
    import pickle

    spec = json.loads(spec_text)
    writer = EpisodeFile(Path(spec["path"]), spec["attrs"], spec["level"], spec["min_bytes"])
    stdin, stdout = sys.stdin.fileno(), sys.stdout
    code = 0
    try:
        while True:
            _wait_readable(stdin)
            header = _read_exactly(stdin, 8)
            if len(header) < 8:
                break  # EOF: the rank closed the pipe, or is gone
            payload = _read_exactly(stdin, int.from_bytes(header, "little"))
            stdout.write(json.dumps(writer.write_block(pickle.loads(payload))) + "\n")
            stdout.flush()
    except BrokenPipeError:
        pass  # the rank is gone; the file is closed below all the same
    except OSError as error:
        if error.errno not in NO_ROOM_ERRNOS:
            raise
        # Silent: the rollout rank turns this code into ENOSPC, and the driver says it once.
        code = WRITER_NO_ROOM_EXIT
    finally:
        try:
            writer.close()
        except OSError as error:
            if error.errno not in NO_ROOM_ERRNOS:
                raise
            code = WRITER_NO_ROOM_EXIT
    return code


#: The writer's exit code when the file system under its file is full (ENOSPC or EDQUOT).
WRITER_NO_ROOM_EXIT = 28

#: How often the writer looks for new batches when it has none.
WRITER_POLL_S = 0.02


def _wait_readable(fd: int) -> None:
    """Wait until ``fd`` has data or EOF, waking on a timer rather than on the pipe. Linux
    tends to run a process woken by a pipe write on the core of the process that wrote
    (wake-affine placement): blocked in read, this writer kept preempting its own rollout rank.
    dump_efficiency was 0.83 with blocking reads and 0.91 with this, on the 2-core machine."""
    import select

    while not select.select([fd], [], [], 0)[0]:
        time.sleep(WRITER_POLL_S)


def _read_exactly(fd: int, size: int) -> bytes:
    """``size`` bytes from ``fd`` (unbuffered: no data may hide from ``_wait_readable``);
    fewer only at EOF."""
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(left, PIPE_BYTES))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


if __name__ == "__main__":
    sys.exit(_writer_main(sys.argv[1]))
