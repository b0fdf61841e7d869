"""The on-disk record format of the embedded log: one append-only segment file per topic.

Layout: an 8-byte file header ``K3BUS01\\n``, then frames back to back::

    u32 body_length | u32 crc32(body) | body
    body = i64 timestamp_ms | i32 key_length (-1 for no key) | key | value

all big-endian. A record's offset is its index in the file (0, 1, 2, ...), so offsets need no storage and
an in-memory list of frame positions, rebuilt by one scan when a topic is opened, serves seeks.

Why length + CRC: an append interrupted by a crash leaves a frame whose length runs past the end of the
file, or whose bytes do not match their checksum. ``scan`` stops at the first such frame and reports where
the valid prefix ends, so the writer can truncate the torn tail and a reader never delivers it.
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass

FILE_HEADER = b"K3BUS01\n"
_FRAME = struct.Struct(">II")  # body length, crc32 of body
_BODY = struct.Struct(">qi")  # timestamp_ms, key length (-1: no key)
FRAME_OVERHEAD = _FRAME.size + _BODY.size
# Reading is done in chunks of this size while scanning, so a scan never loads a whole segment.
_SCAN_CHUNK = 1 << 20


class SegmentCorrupt(ValueError):
    """The file is not a segment file (wrong header)."""


@dataclass(frozen=True)
class Frame:
    timestamp_ms: int
    key: bytes | None
    value: bytes


def encode(timestamp_ms: int, key: bytes | None, value: bytes) -> bytes:
    key_bytes = b"" if key is None else key
    body = _BODY.pack(timestamp_ms, -1 if key is None else len(key_bytes)) + key_bytes + value
    return _FRAME.pack(len(body), zlib.crc32(body)) + body


def decode(frame: bytes) -> Frame:
    """Decodes one complete, already CRC-checked frame (as read back at a position found by ``scan``)."""
    body = frame[_FRAME.size :]
    timestamp_ms, key_length = _BODY.unpack_from(body)
    start = _BODY.size
    if key_length < 0:
        return Frame(timestamp_ms, None, bytes(body[start:]))
    return Frame(timestamp_ms, bytes(body[start : start + key_length]), bytes(body[start + key_length :]))


def check_header(fd: int, name: str) -> None:
    """Raises SegmentCorrupt when the non-empty file ``name`` does not start with the segment header."""
    head = os.pread(fd, len(FILE_HEADER), 0)
    if head and head != FILE_HEADER[: len(head)]:
        raise SegmentCorrupt(f"{name} is not an event log segment (it starts with {head!r})")


def scan(fd: int, start: int, end: int, max_frame_bytes: int) -> tuple[list[int], int]:
    """Finds the complete, intact frames in ``[start, end)`` of the file.

    Returns the positions of the frames and the position where the valid data ends. Anything between that
    position and ``end`` is a torn or corrupt tail: an incomplete frame, a length above ``max_frame_bytes``
    (a garbage length field), or a CRC mismatch.
    """
    positions: list[int] = []
    pos = start
    while pos + _FRAME.size <= end:
        length, crc = _FRAME.unpack(os.pread(fd, _FRAME.size, pos))
        if length < _BODY.size or length > max_frame_bytes or pos + _FRAME.size + length > end:
            break
        if _crc_of(fd, pos + _FRAME.size, length) != crc:
            break
        _, key_length = _BODY.unpack(os.pread(fd, _BODY.size, pos + _FRAME.size))
        if key_length < -1 or key_length > length - _BODY.size:
            break
        positions.append(pos)
        pos += _FRAME.size + length
    return positions, pos


def _crc_of(fd: int, pos: int, length: int) -> int:
    crc = 0
    while length > 0:
        chunk = os.pread(fd, min(length, _SCAN_CHUNK), pos)
        if not chunk:
            break
        crc = zlib.crc32(chunk, crc)
        pos += len(chunk)
        length -= len(chunk)
    return crc


def read_timestamp(fd: int, pos: int) -> int:
    """The publish time of the frame at ``pos``, without reading its key or value."""
    return _BODY.unpack(os.pread(fd, _BODY.size, pos + _FRAME.size))[0]


def read_frame(fd: int, pos: int) -> Frame:
    length, _ = _FRAME.unpack(os.pread(fd, _FRAME.size, pos))
    return decode(os.pread(fd, _FRAME.size + length, pos))
