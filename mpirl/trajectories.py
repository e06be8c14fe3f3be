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
``main_data.hdf5`` and ``metadata.json`` (``DumpIndex``), after each iteration; ``mpirl.io``
also finds episodes that a killed run wrote but never indexed.

Each run start (fresh or ``--resume``) is a new session: its ranks write new files, so no
existing episode is ever reopened or overwritten.

A per-rank file that cannot be read (truncated, overwritten, replaced) is quarantined when a
dumping run starts or resumes in its directory: renamed ``*.hdf5.damaged``, its links dropped from
``main_data.hdf5``, and recorded under ``mpirl_quarantined`` in ``metadata.json`` with the
number of indexed episodes lost. Readers (``mpirl.io``) skip such a file without touching it.

File locks: HDF5 locks every file it opens (flock). Where the file system refuses (NFS without
a lock daemon, Lustre mounted without flock), ``open_hdf5`` opens without the lock.
"""

from __future__ import annotations

import errno
import json
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import h5py
import numpy as np

from mpirl.errors import ConfigError, MpirlError
from mpirl.run_dir import write_atomically

#: The driver's index of every episode, and Minari's metadata file.
MAIN_FILE = "main_data.hdf5"
METADATA_FILE = "metadata.json"
#: Per-rank data files: rollout-s{session}-w{worker}.hdf5.
RANK_FILE_RE = re.compile(r"^rollout-s(\d+)-w(\d+)\.hdf5$")
#: A damaged per-rank file is renamed with this suffix (then RANK_FILE_RE no longer matches it).
QUARANTINE_SUFFIX = ".damaged"
#: metadata.json key: the files quarantined so far, with why and how many episodes were lost.
QUARANTINE_KEY = "mpirl_quarantined"
#: Root attribute that marks a per-rank file as written by mpirl.
FORMAT_ATTR = "mpirl_trajectories"
FORMAT_VERSION = 1
#: The Minari dataset format these files follow (Minari checks it against what it supports).
MINARI_FORMAT_VERSION = "0.5.3"
#: Longest time a completed episode waits on its rollout rank before going to the writer.
SEND_INTERVAL_S = 0.05
#: HDF5 file format bounds: 1.8's keeps groups compact (a third smaller files than the oldest
#: format for short episodes) and, unlike 1.10's, has no "open for write" flag that would make
#: the file of a killed writer unreadable.
FILE_FORMAT = ("v108", "v108")
#: Rows per HDF5 chunk at most (an episode's datasets are one chunk unless longer).
MAX_CHUNK_ROWS = 4096


# File locking. HDF5 takes a flock on every file it opens; the file systems of many clusters refuse.


#: errno of a file system without flock: NFS without a lock daemon (ENOLCK), Lustre mounted
#: without flock (ENOSYS; HDF5 2.0 already ignores that one), others (EOPNOTSUPP).
NO_FLOCK_ERRNOS = frozenset({errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP})
#: Why this process opens files without locks (None while locks work); warned about once.
_no_flock: str | None = None
_no_flock_warned = False


def open_hdf5(path: str | Path, mode: str, *, warn: bool = False, **kwargs: Any) -> h5py.File:
    """``h5py.File(path, mode, **kwargs)``, without HDF5's file lock where it cannot be taken.

    A file system without flock turns locking off for the rest of this process; with ``warn``
    (the driver only: only rank 0 prints) that is said once on stderr. A lock held by another
    process (a reader of a file being written, the writer of a file being read) is skipped for
    this open only: each dump file has one writer, and it closes the file after every batch,
    so a reader reads what is complete. Setting ``HDF5_USE_FILE_LOCKING=FALSE`` skips locks
    from the start."""
    global _no_flock
    if _no_flock is None:
        created = mode in ("w-", "x", "a") and not os.path.exists(path)
        try:
            return h5py.File(path, mode, **kwargs)
        except OSError as error:
            if "unable to lock file" not in str(error):
                raise
            if error.errno in NO_FLOCK_ERRNOS:
                _no_flock = f"{Path(path).parent}: {error}"
            if created:
                mode = "w"  # the failed open left the file it created, empty: ours to reuse
    if warn:
        _warn_no_flock()
    return h5py.File(path, mode, locking=False, **kwargs)


def _warn_no_flock() -> None:
    global _no_flock_warned
    if _no_flock is not None and not _no_flock_warned:
        _no_flock_warned = True
        print(f"mpirl: warning: the file system refuses HDF5's file locks ({_no_flock}); "
              f"trajectory files are written and read without them", file=sys.stderr,
              flush=True)


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


# Spaces, serialized the way Minari writes them in metadata.json (JSON strings).


def serialize_space(space: gym.Space) -> str:
    return json.dumps(_space_dict(space))


def _space_dict(space: gym.Space) -> dict[str, Any]:
    if isinstance(space, gym.spaces.Box):
        return {"type": "Box", "dtype": str(space.dtype), "shape": list(space.shape),
                "low": space.low.tolist(), "high": space.high.tolist()}
    if isinstance(space, gym.spaces.Discrete):
        return {"type": "Discrete", "dtype": "int64", "start": int(space.start),
                "n": int(space.n)}
    if isinstance(space, gym.spaces.MultiDiscrete):
        return {"type": "MultiDiscrete", "dtype": str(space.dtype), "nvec": space.nvec.tolist(),
                "start": space.start.tolist()}
    if isinstance(space, gym.spaces.MultiBinary):
        return {"type": "MultiBinary", "n": space.n}
    if isinstance(space, gym.spaces.Dict):
        return {"type": "Dict", "subspaces": {k: _space_dict(s) for k, s in space.spaces.items()}}
    if isinstance(space, gym.spaces.Tuple):
        return {"type": "Tuple", "subspaces": [_space_dict(s) for s in space.spaces]}
    raise ConfigError(f"trajectory dumps cannot describe a {type(space).__name__} space")


def deserialize_space(text: str | dict[str, Any]) -> gym.Space:
    """The inverse of ``serialize_space``; ValueError on what it does not know."""
    d = json.loads(text) if isinstance(text, str) else text
    kind = d.get("type")
    if kind == "Box":
        return gym.spaces.Box(np.array(d["low"], dtype=d["dtype"]),
                              np.array(d["high"], dtype=d["dtype"]), tuple(d["shape"]),
                              dtype=d["dtype"])
    if kind == "Discrete":
        return gym.spaces.Discrete(d["n"], start=d["start"])
    if kind == "MultiDiscrete":
        return gym.spaces.MultiDiscrete(d["nvec"], dtype=d["dtype"], start=d["start"])
    if kind == "MultiBinary":
        return gym.spaces.MultiBinary(d["n"])
    if kind == "Dict":
        return gym.spaces.Dict({k: deserialize_space(s) for k, s in d["subspaces"].items()})
    if kind == "Tuple":
        return gym.spaces.Tuple([deserialize_space(s) for s in d["subspaces"]])
    raise ValueError(f"unknown space type {kind!r}")


# Rollout rank: buffering episodes; a writer process writes them.


class EpisodeFile:
    """One per-rank HDF5 file, written episode by episode. Runs in the writer process (or in
    the rollout worker itself with ``dump_writer_process`` off).

    The file is open only while a batch of episodes is written, and closed after each: a
    closed file is complete on disk, whatever happens to the writer next, and other programs
    (``mpirl inspect``, Minari) can open it between batches. Closing is also the cheapest way
    to flush here: with metadata held until the flush (``_hold_metadata_until_flush``), a flush
    walks the whole metadata cache, which grows with every episode kept open; writing slowed
    from 2,300 to 550 CartPole episodes/s over 20,000 episodes with the file kept open, while
    closing after every batch writes a steady 3,900/s."""

    def __init__(self, path: Path, attrs: dict[str, Any], compression_level: int,
                 compression_min_bytes: int) -> None:
        self.path = path
        # 'w-': a session's file is new; an existing one is never overwritten.
        with open_hdf5(path, "w-", libver=FILE_FORMAT) as file:
            file.attrs.update(attrs)
        self.level = compression_level
        self.min_bytes = compression_min_bytes
        # HDF5 property lists, datatypes and dataspaces are reused across episodes: each new one
        # costs a few microseconds plus a registry entry in h5py, and an episode needs 12.
        self.dcpl_cache: dict[tuple, Any] = {}
        self.type_cache: dict[np.dtype, Any] = {}
        self.space_cache: dict[tuple, Any] = {}

    def write_block(self, block: dict[str, Any]) -> list[tuple[int, int]]:
        """Write the episodes of a ``StepBlock`` (see ``EpisodeRecorder.flush``)."""
        return self.write(list(episodes_of_block(block)))

    def write(self, episodes: list[tuple[int, dict[str, Any]]]) -> list[tuple[int, int]]:
        """Write (local id, episode) pairs, then close the file; return (local id, steps) of
        each."""
        if not episodes:
            return []
        written = []
        file = open_hdf5(self.path, "r+", libver=FILE_FORMAT)
        try:
            _hold_metadata_until_flush(file)
            for k, episode in episodes:
                # Low-level h5py throughout: it halves the cost of these small objects.
                group = h5py.h5g.create(file.id, f"episode_{k}".encode())
                steps = len(episode["rewards"])
                _int_attr(group, "id", k)
                _int_attr(group, "total_steps", steps)
                if episode.get("seed") is not None:
                    _int_attr(group, "seed", episode["seed"])
                for key in ("observations", "actions", "rewards", "terminations",
                            "truncations"):
                    self._write(group, key, episode[key])
                infos = h5py.h5g.create(group, b"infos")
                self._write(infos, "action_logp", episode["action_logp"])
                written.append((k, steps))
        finally:
            # What a kill -9 after this line leaves on disk reads back in full.
            file.close()
        return written

    def _write(self, parent: Any, name: str, data: Any) -> None:
        """Write ``data`` as dataset ``name`` of the group whose low-level id is ``parent``."""
        if isinstance(data, dict):  # Dict observation spaces: one subgroup per key
            sub = h5py.h5g.create(parent, name.encode())
            for key, value in data.items():
                self._write(sub, key, value)
            return
        if isinstance(data, tuple):
            sub = h5py.h5g.create(parent, name.encode())
            for j, value in enumerate(data):
                self._write(sub, f"_index_{j}", value)
            return
        array = np.ascontiguousarray(data)
        # h5py's low-level API: create_dataset costs about twice as much per dataset, and a
        # CartPole episode is ~20 steps. Below min_bytes a dataset is stored compact (in its
        # object header): a chunk index and filter would triple the size of such small arrays.
        # Compact datasets must fit in 64 KiB.
        chunked = (array.nbytes >= min(self.min_bytes, 32768)) and len(array) > 0
        key = (array.shape[1:], min(len(array), MAX_CHUNK_ROWS)) if chunked else None
        dcpl = self.dcpl_cache.get(key)
        if dcpl is None:
            dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
            if chunked:
                dcpl.set_chunk((min(len(array), MAX_CHUNK_ROWS), *array.shape[1:]))
                if self.level:
                    dcpl.set_deflate(self.level)
            else:
                dcpl.set_layout(h5py.h5d.COMPACT)
            if len(self.dcpl_cache) < 1024:
                self.dcpl_cache[key] = dcpl
        space = self.space_cache.get((array.shape, chunked))
        if space is None:
            maxshape = (h5py.h5s.UNLIMITED, *array.shape[1:]) if chunked else array.shape
            space = h5py.h5s.create_simple(array.shape, maxshape)
            if len(self.space_cache) < 4096:
                self.space_cache[(array.shape, chunked)] = space
        dtype = self.type_cache.get(array.dtype)
        if dtype is None:
            dtype = self.type_cache[array.dtype] = h5py.h5t.py_create(array.dtype,
                                                                          logical=True)
        dataset = h5py.h5d.create(parent, name.encode(), dtype, space, dcpl=dcpl)
        dataset.write(h5py.h5s.ALL, h5py.h5s.ALL, array)

    def close(self) -> None:
        """Nothing to do: the file is closed between batches."""


def _hold_metadata_until_flush(file: h5py.File) -> None:
    """Keep every changed metadata block in memory until the next flush. By default HDF5 writes
    some out early (evictions); a writer killed then leaves metadata that points at blocks not
    yet written, and the file is corrupt. Now only a kill while the file closes can do that."""
    config = file.id.get_mdc_config()
    config.set_initial_size = True
    config.initial_size = config.max_size = 64 * 2**20
    config.min_size = 2**20
    config.incr_mode = 0  # H5C_incr__off
    config.flash_incr_mode = 0  # H5C_flash_incr__off
    config.decr_mode = 0  # H5C_decr__off
    config.evictions_enabled = False
    file.id.set_mdc_config(config)


_SCALAR = None


def _int_attr(group: Any, name: str, value: int) -> None:
    global _SCALAR
    if _SCALAR is None:
        _SCALAR = h5py.h5s.create(h5py.h5s.SCALAR)
    attr = h5py.h5a.create(group, name.encode(), h5py.h5t.STD_I64LE, _SCALAR)
    attr.write(np.array(value, dtype=np.int64))


def episodes_of_block(block: dict[str, Any]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(local id, episode arrays) of each episode a block of steps holds. A block holds
    ``rows`` of vector-env steps (arrays shaped (W, num_envs, ...)) from global step ``lo`` on,
    ``ends`` = [(local id, sub-env, first step, last step, seed)] and each one's final obs."""
    lo = block["lo"]
    for (k, i, first, last, seed), final in zip(block["ends"], block["finals"], strict=True):
        a, b = first - lo, last - lo + 1
        yield k, {
            "observations": _append_row(_rows_of(block["obs"], a, b, i), final),
            "actions": block["actions"][a:b, i],
            "rewards": block["rewards"][a:b, i].astype(np.float64),
            "terminations": block["terminated"][a:b, i],
            "truncations": block["truncated"][a:b, i],
            "action_logp": block["logp"][a:b, i],
            "seed": seed,
        }


def _rows_of(obs: Any, a: int, b: int, i: int) -> Any:
    if isinstance(obs, dict):
        return {key: _rows_of(value, a, b, i) for key, value in obs.items()}
    if isinstance(obs, tuple):
        return tuple(_rows_of(value, a, b, i) for value in obs)
    return obs[a:b, i]


def _append_row(rows: Any, row: Any) -> Any:
    if isinstance(rows, dict):
        return {key: _append_row(rows[key], row[key]) for key in rows}
    if isinstance(rows, tuple):
        return tuple(_append_row(r, x) for r, x in zip(rows, row, strict=True))
    return np.concatenate([rows, np.asarray(row, dtype=rows.dtype)[None]])


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
        self.proc = subprocess.Popen([sys.executable, "-m", "mpirl.trajectories", spec],
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
    finally:
        writer.close()
    return 0


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


#: The fields of one recorded vector-env step, in the order EpisodeRecorder keeps them (plain
#: tuples: this runs on the sampling loop). obs is the observation the step was taken from.
STEP_FIELDS = ("obs", "actions", "rewards", "terminated", "truncated", "logp")


class EpisodeRecorder:
    """Buffers the episodes of a worker's ``num_envs`` sub-envs and sends each completed one to
    the rank's writer.

    Steps are kept as the vector env returns them (one record per step for all sub-envs); an
    episode is gathered from them when it ends, and records older than every episode in
    progress are dropped. Nothing here crosses ranks.
    """

    def __init__(self, target: DumpTarget, worker: int, num_envs: int, env_id: str,
                 observation_space: gym.Space, action_space: gym.Space, seed: int) -> None:
        self.target = target
        self.path = Path(target.directory) / target.file_name(worker)
        if self.path.exists():
            raise ConfigError(f"trajectory file {self.path} exists already; it is not "
                              f"overwritten")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigError(f"cannot create {self.path.parent}: {error}") from None
        attrs = {FORMAT_ATTR: FORMAT_VERSION, "env_id": env_id,
                 "observation_space": serialize_space(observation_space),
                 "action_space": serialize_space(action_space),
                 "rollout_worker": worker, "session": target.session}
        self.writer: _WriterProcess | None = None
        self.file: EpisodeFile | None = None
        if target.writer_process:
            self.writer = _WriterProcess(self.path, attrs, target.compression_level,
                                         target.compression_min_bytes)
        else:
            try:
                self.file = EpisodeFile(self.path, attrs, target.compression_level,
                                        target.compression_min_bytes)
            except OSError as error:
                raise ConfigError(f"cannot create trajectory file {self.path}: "
                                  f"{error}") from None
        self.num_envs = num_envs
        self.next_id = 0
        self.steps: list[tuple[Any, ...]] = []  # one per vector-env step: STEP_FIELDS
        self.base = 0  # global step number of steps[0]
        self.now = 0  # global step number of the next step
        self.start = np.zeros(num_envs, dtype=np.int64)
        # An episode whose beginning this recorder did not see (restored from a checkpoint) is
        # not written.
        self.tracked = np.zeros(num_envs, dtype=bool)
        self.seeds: list[int | None] = [None] * num_envs
        # Episodes ended since the last flush: (local id, sub-env, first step, last step,
        # seed), and their final observations.
        self.ends: list[tuple[int, int, int, int, int | None]] = []
        self.finals: list[Any] = []
        self.written: list[tuple[int, int]] = []  # in-process mode: written, not yet reported
        self._seed = seed
        self._next_send = time.monotonic() + SEND_INTERVAL_S

    def begin(self, seeded: bool = False) -> None:
        """Every sub-env starts a new episode at the next step (after a reset)."""
        for i in range(self.num_envs):
            self._start_episode(i, self._seed + i if seeded else None)

    def untrack(self) -> None:
        """Episodes in progress (restored from a checkpoint) began elsewhere: skip them."""
        self.tracked[:] = False

    def _start_episode(self, i: int, seed: int | None = None) -> None:
        self.start[i] = self.now
        self.tracked[i] = True
        self.seeds[i] = seed

    def step(self, obs: Any, env_actions: np.ndarray, rewards: np.ndarray,
             terminated: np.ndarray, truncated: np.ndarray, logp: np.ndarray,
             infos: dict[str, Any], dropped: np.ndarray | None) -> None:
        """Record one vector-env step taken from ``obs``; finish the episodes that ended on it
        (their last observation is ``infos["final_obs"]``)."""
        self.steps.append((obs, env_actions, rewards, terminated, truncated, logp))
        t = self.now
        self.now += 1
        if dropped is not None:
            for i in np.flatnonzero(dropped):
                self._start_episode(i)  # the partial episode is lost with the failed env
        done = terminated | truncated
        if done.any():
            final_obs = infos["final_obs"]
            for i in np.flatnonzero(done).tolist():
                if self.tracked[i]:
                    self.ends.append((self.next_id, i, int(self.start[i]), t, self.seeds[i]))
                    self.finals.append(final_obs[i])
                    self.next_id += 1
                self._start_episode(i)
        if self.ends and time.monotonic() >= self._next_send:
            # Completed episodes reach the writer within SEND_INTERVAL_S, not only at the end
            # of the sample call: a killed rank loses at most that much.
            self._send()

    def flush(self, wait: bool = False) -> list[tuple[int, int]]:
        """Hand the episodes completed since the last call to the writer; return (local id,
        steps) of the episodes now safely on disk (with ``wait``: all of them)."""
        self._send()
        oldest = int(self.start.min())  # records before it no episode in progress needs
        if oldest > self.base:
            del self.steps[:oldest - self.base]
            self.base = oldest
        if self.writer is not None:
            return self.writer.take_acked(wait=wait)
        written, self.written = self.written, []
        return written

    def _send(self) -> None:
        """The steps that the completed episodes span go as one block of stacked arrays: a few
        large pickles instead of many small ones; the writer slices the episodes out."""
        self._next_send = time.monotonic() + SEND_INTERVAL_S
        if self.ends:
            lo = min(first for _, _, first, _, _ in self.ends)
            hi = max(last for _, _, _, last, _ in self.ends) + 1
            columns = zip(*self.steps[lo - self.base:hi - self.base], strict=True)
            block = {"lo": lo, "ends": self.ends, "finals": self.finals,
                     **{key: _stack(list(column)) for key, column in zip(STEP_FIELDS, columns,
                                                                         strict=True)}}
            block["logp"] = block["logp"].astype(np.float32, copy=False)
            if self.writer is not None:
                self.writer.send(block)
            else:
                self.written += self.file.write_block(block)
            self.ends, self.finals = [], []

    def close(self) -> list[tuple[int, int]]:
        written = self.flush(wait=True)
        if self.writer is not None:
            self.writer.close()
        elif self.file is not None:
            self.file.close()
        return written


def _stack(items: list[Any]) -> Any:
    first = items[0]
    if isinstance(first, dict):
        return {k: _stack([item[k] for item in items]) for k in first}
    if isinstance(first, tuple):
        return tuple(_stack([item[j] for item in items]) for j in range(len(first)))
    return np.stack([np.asarray(item) for item in items])


# Driver: main_data.hdf5 and metadata.json.


def rank_files(directory: Path) -> list[Path]:
    """The per-rank data files of a dump directory, in (session, worker) order."""
    found = []
    for path in directory.iterdir() if directory.is_dir() else []:
        match = RANK_FILE_RE.match(path.name)
        if match:
            found.append(((int(match[1]), int(match[2])), path))
    return [path for _, path in sorted(found)]


def episode_number(name: str) -> int | None:
    if name.startswith("episode_") and name[8:].isdigit():
        return int(name[8:])
    return None


class DumpIndex:
    """The driver's side of a dump: picks the session number, and keeps ``main_data.hdf5``
    (external links, numbered contiguously) and ``metadata.json`` up to date."""

    def __init__(self, settings: DumpSettings, env_id: str, observation_space: gym.Space,
                 action_space: gym.Space, algorithm_name: str) -> None:
        assert settings.dump_trajectories is not None
        self.directory = Path(settings.dump_trajectories)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigError(f"dump_trajectories {self.directory}: cannot create it "
                              f"({error})") from None
        existing = rank_files(self.directory)
        # Quarantined files keep their session number: a new session never reuses a name.
        sessions = [int(match[1]) for p in self.directory.iterdir()
                    if (match := RANK_FILE_RE.match(p.name.removesuffix(QUARANTINE_SUFFIX)))]
        self.session = max(sessions, default=-1) + 1
        self.target = DumpTarget(str(self.directory), self.session,
                                 settings.dump_compression_level,
                                 settings.dump_compression_min_bytes,
                                 settings.dump_writer_process)
        self.env_id = env_id
        self.observation_space = observation_space
        self.action_space = action_space
        self.algorithm_name = algorithm_name
        self.pending: list[tuple[str, int]] = []
        #: Files quarantined in this directory so far (metadata.json's QUARANTINE_KEY).
        self.quarantined: list[dict[str, Any]] = []
        self.total_episodes, self.total_steps = self._reconcile(existing)
        self._write_metadata()

    def _reconcile(self, existing: list[Path]) -> tuple[int, int]:
        """Keep the links main_data.hdf5 holds; link the episodes of earlier sessions that it
        lacks (written after the last index update of a run that was killed); quarantine the
        files that cannot be read; return totals."""
        from mpirl.io import DatasetError, open_dataset

        if not existing:
            with open_hdf5(self.directory / MAIN_FILE, "w", warn=True):
                pass
            return 0, 0
        try:
            dataset = open_dataset(self.directory)
        except DatasetError as error:
            raise ConfigError(f"dump_trajectories {self.directory} holds no readable trajectory "
                              f"file: {error}. Choose a new directory.") from None
        with dataset:
            self.quarantined = list(dataset.metadata.get(QUARANTINE_KEY, []))
            for damaged in dataset.damaged:
                self.quarantined.append(self._quarantine(damaged))
            if (dataset.env_id not in (None, self.env_id)
                    or dataset.observation_space not in (None, self.observation_space)
                    or dataset.action_space not in (None, self.action_space)):
                raise ConfigError(
                    f"dump_trajectories {self.directory} holds a dump of {dataset.env_id} "
                    f"(observations {dataset.observation_space}, actions "
                    f"{dataset.action_space}), not of {self.env_id}; choose a new directory")
            links = [(file.name, f"episode_{k}") for file, k in dataset.episode_refs]
            steps = dataset.total_steps
        tmp = self.directory / (MAIN_FILE + ".tmp")
        with open_hdf5(tmp, "w", warn=True) as main:
            for g, (file_name, group) in enumerate(links):
                main[f"episode_{g}"] = h5py.ExternalLink(file_name, group)
        os.replace(tmp, self.directory / MAIN_FILE)
        return len(links), steps

    def _quarantine(self, damaged: Any) -> dict[str, Any]:
        """Rename a damaged file (an ``mpirl.io.DamagedFile``) out of the dump, so that no
        later open trips on it; warn (the driver is the only rank that prints); return its
        metadata.json record."""
        path = damaged.path
        target = path.with_name(path.name + QUARANTINE_SUFFIX)
        n = 0
        while target.exists() or target.is_symlink():
            n += 1
            target = path.with_name(f"{path.name}{QUARANTINE_SUFFIX}.{n}")
        renamed: str | None = None
        if not (path.exists() or path.is_symlink()):
            where = "it is missing"
        else:
            try:
                os.replace(path, target)
                renamed, where = target.name, f"renamed to {target.name}"
            except OSError as error:
                where = f"left in place: cannot rename it ({error})"
        print(f"mpirl: warning: trajectory dump {self.directory}: {damaged.describe()}; "
              f"quarantined ({where}) and left out of {MAIN_FILE}", file=sys.stderr, flush=True)
        return {"file": path.name, "renamed_to": renamed, "reason": damaged.reason,
                "episodes_lost": damaged.episodes_lost}

    def add(self, file_name: str, episodes: list[tuple[int, int]]) -> None:
        """Episodes (local id, steps) that a rollout worker wrote to ``file_name``."""
        for k, steps in episodes:
            self.pending.append((file_name, k))
            self.total_steps += steps

    def commit(self) -> None:
        """Link the episodes added since the last commit; rewrite metadata.json atomically."""
        if not self.pending:
            return
        with open_hdf5(self.directory / MAIN_FILE, "a", warn=True) as main:
            for file_name, k in self.pending:
                main[f"episode_{self.total_episodes}"] = h5py.ExternalLink(file_name,
                                                                           f"episode_{k}")
                self.total_episodes += 1
        self.pending.clear()
        self._write_metadata()

    def _write_metadata(self) -> None:
        import mpirl

        metadata: dict[str, Any] = {
            "dataset_id": f"mpirl/{_slug(self.env_id)}-v0",
            "total_episodes": self.total_episodes,
            "total_steps": self.total_steps,
            "data_format": "hdf5",
            "observation_space": serialize_space(self.observation_space),
            "action_space": serialize_space(self.action_space),
            "minari_version": MINARI_FORMAT_VERSION,
            "algorithm_name": f"mpirl {self.algorithm_name}",
            "dataset_size": round(_size_mb(self.directory), 1),
            "mpirl_version": mpirl.__version__,
            "mpirl_env_id": self.env_id,
        }
        if self.quarantined:
            metadata[QUARANTINE_KEY] = self.quarantined
        env_spec = _env_spec_json(self.env_id)
        if env_spec is not None:
            metadata["env_spec"] = env_spec
        write_atomically(self.directory / METADATA_FILE, json.dumps(metadata))


def _slug(env_id: str) -> str:
    name = re.sub(r"-v\d+$", "", env_id.split(":")[-1])
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "env"


def _env_spec_json(env_id: str) -> str | None:
    if env_id not in gym.registry:
        return None
    try:
        return gym.spec(env_id).to_json()
    except Exception as error:  # noqa: BLE001 - an env's kwargs may not be JSON
        print(f"mpirl: warning: the env spec of {env_id} cannot be saved in the trajectory "
              f"dump's metadata ({error})", file=sys.stderr, flush=True)
        return None


def _size_mb(directory: Path) -> float:
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file()) / 1e6


if __name__ == "__main__":
    sys.exit(_writer_main(sys.argv[1]))
