"""The trajectory dump's on-disk format: file names, HDF5 attributes, space (de)serialization and
locking."""

from __future__ import annotations

import errno
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import gymnasium as gym
import h5py
import numpy as np

from mpirl.errors import ConfigError

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


#: HDF5 file format bounds: 1.8's keeps groups compact (a third smaller files than the oldest
#: format for short episodes) and, unlike 1.10's, has no "open for write" flag that would make
#: the file of a killed writer unreadable.
FILE_FORMAT = ("v108", "v108")


#: Rows per HDF5 chunk at most (an episode's datasets are one chunk unless longer).
MAX_CHUNK_ROWS = 4096


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
