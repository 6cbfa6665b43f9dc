"""A run's logs: one JSON object a line, and TensorBoard's event files, written without TensorFlow.

An event file is a TFRecord of `Event` protocol buffers: each record is its length (uint64), the
masked CRC-32C of the length, the bytes, and their masked CRC-32C. The few fields a scalar needs
are encoded here by hand, which is smaller than depending on TensorBoard to write them.
"""

from __future__ import annotations

import json
import math
import os
import socket
import struct
import time
from typing import Dict, IO, Optional


def _crc32c_table():
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_CRC32C = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), the checksum TFRecord frames carry."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(number: int) -> bytes:
    out = bytearray()
    while True:
        byte, number = number & 0x7F, number >> 7
        out.append(byte | (0x80 if number else 0))
        if not number:
            return bytes(out)


def _message(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def scalar_event(step: int, wall_time: float, scalars: Dict[str, float]) -> bytes:
    """An `Event` (wall_time 1: double, step 2: int64, summary 5) whose `Summary` holds one value
    (tag 1: string, simple_value 2: float) per scalar."""
    values = b"".join(_message(1, _message(1, tag.encode()) + _varint(2 << 3 | 5) + struct.pack("<f", value))
                      for tag, value in scalars.items())
    return _varint(1 << 3 | 1) + struct.pack("<d", wall_time) + _varint(2 << 3) + _varint(step) + _message(5, values)


class EventFile:
    """Scalars for TensorBoard: `tensorboard --logdir RUN/tensorboard` shows them."""

    def __init__(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
        self.path = os.path.join(folder, name)
        self._file: IO[bytes] = open(self.path, "ab")
        # The first event names the format's version (file_version, field 3), as TensorBoard expects.
        self._write(_varint(1 << 3 | 1) + struct.pack("<d", time.time()) + _message(3, b"brain.Event:2"))

    def _write(self, event: bytes) -> None:
        length = struct.pack("<Q", len(event))
        self._file.write(length + struct.pack("<I", masked_crc32c(length)) + event
                         + struct.pack("<I", masked_crc32c(event)))

    def scalars(self, step: int, scalars: Dict[str, float]) -> None:
        finite = {tag: float(value) for tag, value in scalars.items() if value is not None and math.isfinite(value)}
        if finite:
            self._write(scalar_event(step, time.time(), finite))
            self._file.flush()

    def close(self) -> None:
        self._file.close()


class RunLog:
    """`log.jsonl` (or `name`) and TensorBoard's events (unless not `events`) under a run's folder; a resumed
    run appends to both."""

    def __init__(self, folder: str, name: str = "log.jsonl", events: bool = True) -> None:
        self.path = os.path.join(folder, name)
        self._lines: IO[str] = open(self.path, "a", encoding="utf-8")
        self.events = EventFile(os.path.join(folder, "tensorboard")) if events else None

    def write(self, record: Dict, scalars: Optional[Dict[str, float]] = None, at: Optional[float] = None) -> None:
        """One line of `record`, and `scalars` (tag: value) as TensorBoard events at `record["step"]`; its `time` is
        `at` (seconds since the epoch), or now."""
        record = dict(record, time=round(time.time() if at is None else at, 3))
        self._lines.write(json.dumps(_finite(record)) + "\n")
        self._lines.flush()
        if scalars and self.events is not None:
            self.events.scalars(int(record["step"]), scalars)

    def close(self) -> None:
        self._lines.close()
        if self.events is not None:
            self.events.close()

    def __enter__(self) -> "RunLog":
        return self

    def __exit__(self, *exception) -> None:
        self.close()


def _finite(value):
    """JSON has no NaN: a loss whose term did not run is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(entry) for key, entry in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(entry) for entry in value]
    return value
