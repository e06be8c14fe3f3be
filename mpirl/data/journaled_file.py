"""JournaledFile: the file object HDF5 writes a dump file through, so that a writer killed at
any moment, inside HDF5's close included, leaves a file that reads back.

HDF5 has no journal: closing a file rewrites its superblock and the root group's index in
place, a few hundred writes, and a writer killed among them left the file corrupt (12 of 100
random kills of a writer busy with 10-episode batches, before this). Here a batch's writes are
held in memory: those at offsets the file already had, and those past its old end (one write
at commit instead of hundreds; nothing old points there). Once HDF5 has closed the file, the
new end goes to disk, the held writes go to a journal (``<file>.journal``, complete once
renamed into place), then into the file, and the journal is removed. A journal found later (its
writer was killed while applying it) is applied again by ``recover``, which readers call
before they open the file.

Nothing here crosses ranks: one writer process owns each file."""

from __future__ import annotations

import fcntl
import os
import struct
import zlib
from pathlib import Path

JOURNAL_SUFFIX = ".journal"
_MAGIC = b"MPIRLJ01"
_HEAD = struct.Struct("<8sQQ")  # magic, final size, patch count
_PATCH = struct.Struct("<QQ")  # offset, length
_TAIL = struct.Struct("<I8s")  # crc32 of all before it, magic


class JournaledFile:
    """A seekable binary file object for ``h5py.File(JournaledFile(path), "r+")``, for the
    one process that writes ``path``. It takes no lock on ``path``: readers keep their HDF5
    locks, and they read what the last commit left."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        recover(self.path)  # a journal left by an earlier writer of this file
        self.fd = os.open(self.path, os.O_RDWR)
        self.old_size = os.fstat(self.fd).st_size
        self.size = self.old_size
        self.position = 0
        #: (offset, bytes) written below old_size, in order; later ones win.
        self.patches: list[tuple[int, bytes]] = []
        #: What is written past old_size, written out in one piece by ``commit``.
        self.tail = bytearray()
    # The file-object protocol h5py's "fileobj" driver uses.

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_SET:  # what h5py uses before every read and write
            self.position = offset
        elif whence == os.SEEK_CUR:
            self.position += offset
        else:
            self.position = self.size + offset
        return self.position

    def tell(self) -> int:
        return self.position

    def readinto(self, buffer: memoryview | bytearray) -> int:
        view = memoryview(buffer).cast("B")
        start = self.position
        n = min(len(view), max(0, self.size - start))
        end = start + n
        on_disk = max(0, min(end, self.old_size) - start)
        got = os.preadv(self.fd, [view[:on_disk]], start) if on_disk else 0
        if got < on_disk:
            view[got:on_disk] = bytes(on_disk - got)
        if end > self.old_size:  # from the tail; zeros past it, within the size HDF5 set
            lo = max(start, self.old_size)
            chunk = self.tail[lo - self.old_size:end - self.old_size]
            view[lo - start:lo - start + len(chunk)] = chunk
            view[lo - start + len(chunk):n] = bytes(n - (lo - start) - len(chunk))
        for offset, data in self.patches:
            lo, hi = max(offset, start), min(offset + len(data), end)
            if lo < hi:
                view[lo - start:hi - start] = data[lo - offset:hi - offset]
        self.position = end
        return n

    def read(self, size: int = -1) -> bytes:
        if size < 0:
            size = max(0, self.size - self.position)
        buffer = bytearray(size)
        return bytes(buffer[:self.readinto(buffer)])

    def write(self, data: bytes | memoryview) -> int:
        start = self.position
        end = start + len(data)
        old_size = self.old_size
        if start >= old_size:  # past the old end, nothing points there yet: the tail
            lo = start - old_size
            if len(self.tail) < lo:
                self.tail.extend(bytes(lo - len(self.tail)))
            self.tail[lo:end - old_size] = data
        else:  # over what the file held: kept until commit (HDF5 reuses its buffer: a copy)
            split = min(end, old_size)
            self.patches.append((start, bytes(data[:split - start])))
            if end > split:
                self.tail[0:end - old_size] = data[split - start:]
        self.position = end
        if end > self.size:
            self.size = end
        return len(data)

    def truncate(self, size: int | None = None) -> int:
        self.size = self.position if size is None else size
        return self.size

    def flush(self) -> None:
        """Nothing: the held writes reach the file in ``commit``."""

    # After h5py has closed the file.

    def commit(self) -> None:
        """Make the batch's writes durable as one step (journal, apply, remove), then release
        the file."""
        try:
            if self.tail:  # nothing old points past old_size: safe to write before the journal
                os.pwrite(self.fd, self.tail, self.old_size)
            if self.patches or self.size != os.fstat(self.fd).st_size:
                journal = _journal_of(self.path)
                lock = _write_journal(journal, self.size, self.patches)
                try:
                    _apply(self.fd, self.size, self.patches)
                    journal.unlink()
                finally:
                    os.close(lock)
        finally:
            self.close()

    def close(self) -> None:
        """Let go of the file without writing what is held (a batch that failed)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def recover(path: Path) -> bool:
    """Apply the journal that a writer killed while applying it left beside ``path``; True if
    there was one. A writer alive holds its journal's lock, and then nothing is done."""
    journal = _journal_of(Path(path))
    recovered = False
    for candidate, committed in ((journal, True), (_tmp_of(journal), False)):
        try:
            lock = os.open(candidate, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.stat(candidate).st_ino != os.fstat(lock).st_ino:
                continue  # its writer finished with it meanwhile
            parsed = _parse_journal(_read_all(lock)) if committed else None
            if parsed is not None:
                fd = os.open(path, os.O_RDWR)
                try:
                    _apply(fd, *parsed)
                finally:
                    os.close(fd)
                recovered = True
            # A torn journal (short of a full disk, os.replace rules it out) or one never
            # committed is dropped: the file is as its last batch left it.
            os.unlink(candidate)
        except OSError:
            # Locked by a live writer, gone, a read-only dump, or no flock on this file
            # system: then a live writer cannot be told apart, and the journal is left alone.
            continue
        finally:
            os.close(lock)
    return recovered


def _journal_of(path: Path) -> Path:
    return path.with_name(path.name + JOURNAL_SUFFIX)


def _tmp_of(journal: Path) -> Path:
    return journal.with_name(journal.name + ".tmp")


def _write_journal(journal: Path, size: int, patches: list[tuple[int, bytes]]) -> int:
    """Write the journal, locked, and rename it into place: the batch is committed from then
    on. Returns its descriptor, which holds the lock until the caller closes it."""
    parts = [_HEAD.pack(_MAGIC, size, len(patches))]
    for offset, data in patches:
        parts += [_PATCH.pack(offset, len(data)), data]
    body = b"".join(parts)
    tmp = _tmp_of(journal)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass  # no flock here (NFS without a lock daemon): recover() cannot lock it either
        data = memoryview(body + _TAIL.pack(zlib.crc32(body), _MAGIC))
        while data:
            data = data[os.write(fd, data):]
        os.replace(tmp, journal)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _apply(fd: int, size: int, patches: list[tuple[int, bytes]]) -> None:
    for offset, data in patches:
        os.pwrite(fd, data, offset)
    os.ftruncate(fd, size)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def _parse_journal(body: bytes) -> tuple[int, list[tuple[int, bytes]]] | None:
    if len(body) < _HEAD.size + _TAIL.size:
        return None
    crc, magic = _TAIL.unpack_from(body, len(body) - _TAIL.size)
    content = body[:-_TAIL.size]
    if magic != _MAGIC or zlib.crc32(content) != crc:
        return None
    magic, size, count = _HEAD.unpack_from(content, 0)
    if magic != _MAGIC:
        return None
    at, items = _HEAD.size, []
    for _ in range(count):
        offset, length = _PATCH.unpack_from(content, at)
        at += _PATCH.size
        items.append((offset, content[at:at + length]))
        at += length
    return size, items
