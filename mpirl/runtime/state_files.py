"""Worker state files: pickled, fsynced and checked against their SHA-256 entry on the way back.
Written by each rank for itself."""

from __future__ import annotations

import hashlib
import os
import pickle
from pathlib import Path
from typing import Any

from mpirl.errors import CheckpointError

__all__ = ["read_state_file"]


def write_state_file(path: str | Path, state: Any) -> dict[str, Any]:
    """Pickle ``state`` to ``path`` and fsync it; return its ``{"sha256", "bytes"}`` entry.

    The pickle is streamed into the file and hashed on the way (protocol 5 writes large NumPy
    buffers straight from the arrays), so a replay shard never holds a second copy of itself.
    """
    with open(path, "wb") as file:
        writer = _HashingWriter(file)
        pickle.dump(state, writer, protocol=5)
        file.flush()
        os.fsync(file.fileno())
    return {"sha256": writer.sha256.hexdigest(), "bytes": writer.bytes}


class _HashingWriter:
    """A write-only file object that hashes and counts what passes through it."""

    def __init__(self, file: Any) -> None:
        self.file = file
        self.sha256 = hashlib.sha256()
        self.bytes = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.sha256.update(view)
        self.bytes += view.nbytes
        return self.file.write(view)


def read_state_file(path: str | Path, entry: dict[str, Any]) -> Any:
    """Unpickle ``path`` after checking it, from disk, against its manifest ``entry``."""
    path = Path(path)
    check_file(path, entry)
    with open(path, "rb") as file:
        return pickle.load(file)


#: Files are hashed in pieces of this size, so checking one never holds it in memory.
HASH_CHUNK = 1 << 20


def check_file(path: Path, entry: dict[str, Any]) -> None:
    """CheckpointError unless ``path`` has the size and SHA-256 its manifest ``entry`` gives."""
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise CheckpointError(f"{path}: {size} bytes where the manifest says "
                              f"{entry['bytes']} (truncated?)")
    digest = hashlib.sha256()
    chunk = bytearray(HASH_CHUNK)
    with open(path, "rb", buffering=0) as file:
        while n := file.readinto(chunk):
            digest.update(memoryview(chunk)[:n])
    if digest.hexdigest() != entry["sha256"]:
        raise CheckpointError(f"{path}: SHA-256 does not match the manifest (corrupted)")
