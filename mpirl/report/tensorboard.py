"""A minimal TensorBoard event-file writer for scalars, with no TensorFlow or TensorBoard import.

An event file is a sequence of TFRecord frames::

    uint64 length | uint32 masked_crc32c(length bytes) | data | uint32 masked_crc32c(data)

(all little-endian), each ``data`` being a serialized ``tensorflow.Event`` protobuf. The first
event carries ``file_version = "brain.Event:2"``; every later one carries a ``Summary`` with one
``Value{tag, simple_value}``. The few protobuf fields needed are encoded by hand below.
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import struct
import time
from pathlib import Path

_CASTAGNOLI = 0x82F63B78  # CRC-32C polynomial, bit-reflected


def _make_crc_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ _CASTAGNOLI if crc & 1 else crc >> 1
        table.append(crc)
    return tuple(table)


_CRC_TABLE = _make_crc_table()


def crc32c(data: bytes) -> int:
    """The CRC-32C (Castagnoli) checksum of ``data``."""
    crc = 0xFFFFFFFF
    table = _CRC_TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """The CRC as TFRecord stores it: rotated and offset, so CRCs of CRCs stay well-distributed."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(value: int) -> bytes:
    # Protobuf encodes negative int64 values as their 64-bit two's complement (10 bytes).
    value &= 0xFFFFFFFFFFFFFFFF
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def _length_delimited(field: int, payload: bytes) -> bytes:
    return _key(field, 2) + _varint(len(payload)) + payload


def _float32(value: float) -> bytes:
    try:
        return struct.pack("<f", value)
    except OverflowError:
        # Finite doubles beyond float32's range: TensorBoard would show them as inf anyway.
        return struct.pack("<f", math.copysign(math.inf, value))


def encode_event(wall_time: float, step: int, *, file_version: str | None = None,
                 tag: str | None = None, value: float | None = None) -> bytes:
    """Serialize one ``tensorflow.Event``: either a file-version record or one scalar summary."""
    # Event: 1 wall_time (double), 2 step (int64), 3 file_version (string), 5 summary (Summary).
    data = _key(1, 1) + struct.pack("<d", wall_time) + _key(2, 0) + _varint(step)
    if file_version is not None:
        return data + _length_delimited(3, file_version.encode())
    assert tag is not None and value is not None
    # Summary.Value: 1 tag (string), 2 simple_value (float); Summary: 1 value (repeated Value).
    summary_value = _length_delimited(1, tag.encode()) + _key(2, 5) + _float32(value)
    return data + _length_delimited(5, _length_delimited(1, summary_value))


def frame_record(data: bytes) -> bytes:
    """Wrap ``data`` in TFRecord framing."""
    header = struct.pack("<Q", len(data))
    return (header + struct.pack("<I", masked_crc32c(header)) + data
            + struct.pack("<I", masked_crc32c(data)))


class EventWriter:
    """Writes scalar summaries to a TensorBoard event file in ``logdir``.

    The file is named ``events.out.tfevents.<unix time>.<host>``; if a file of that name exists
    (two writers in one second), a ``.<pid>.<n>`` suffix keeps them apart, since TensorBoard reads
    every ``*tfevents*`` file in the directory.
    """

    def __init__(self, logdir: str | Path) -> None:
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        base = f"events.out.tfevents.{int(now)}.{socket.gethostname()}"
        for n in itertools.count():
            name = base if n == 0 else f"{base}.{os.getpid()}.{n}"
            try:
                self._file = open(self.logdir / name, "xb")
                break
            except FileExistsError:
                continue
        self.path = self.logdir / name
        self._file.write(frame_record(encode_event(now, 0, file_version="brain.Event:2")))
        self._file.flush()

    def add_scalar(self, tag: str, value: float, step: int,
                   wall_time: float | None = None) -> None:
        """Append one scalar; it reaches the disk at the next ``flush`` or ``close``."""
        if self._file.closed:
            raise ValueError(f"EventWriter for {self.path} is closed")
        wall_time = time.time() if wall_time is None else wall_time
        self._file.write(frame_record(encode_event(float(wall_time), int(step), tag=tag,
                                                   value=float(value))))

    def flush(self) -> None:
        """Hand the buffered records to the operating system."""
        if not self._file.closed:
            self._file.flush()

    def close(self) -> None:
        """Flush and close the file; closing twice is harmless."""
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> EventWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
