"""The embedded event bus: Kafka's contract on local disk, the one-machine default (as SQLite is to Postgres).

Layout under the bus directory::

    topics/<topic>.log                 one append-only segment per topic (format: segment.py)
    groups/<hash>/offsets.json         committed offsets of a consumer group (offsets.py)
    groups/<hash>/commit.lock          serialises commits of that group
    groups/<hash>/<topic>.owner        held (flock) by the group's consumer that owns the topic

Design decisions:
- Every topic has exactly one partition, 0. Keys are stored and delivered but do not route: with one
  partition, "same key, same partition" holds trivially, and all records of a topic keep publish order.
- Several processes on one machine may use the same directory. Appends take an exclusive ``flock`` on the
  segment and readers a shared one, so a reader never sees a frame that is still being written; a frame
  left incomplete by a crashed writer is cut off by the next writer (and skipped by readers until then).
  A topic's torn tail is also cut off when a bus first opens the topic.
- ``publish`` returns after ``fsync`` (``EmbeddedConfig.fsync``), which is what "durable" means here.
- Group membership mirrors Kafka with one partition per topic: one consumer of a group owns a topic at a
  time (an exclusive ``flock`` on its ``.owner`` file); other consumers of the group get nothing from that
  topic until the owner closes or its process dies (the kernel drops the lock), and then continue from
  the group's committed offset, exactly as after a Kafka rebalance.
- A seek past the end of a topic is kept: polls return nothing until the topic grows that far (Kafka
  would reset such a position to the earliest offset instead; callers should not rely on either).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from k3.services.bus import segment
from k3.services.bus.api import (
    Record,
    validate_group,
    validate_payload,
    validate_poll,
    validate_position,
    validate_timestamp,
    validate_topic,
    validate_topics,
)
from k3.services.bus.offsets import GroupOffsets

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddedConfig:
    """Settings of the embedded log.

    Fields:
        fsync: fsync the segment after every publish, so a published record survives power loss; without
            it a record survives a crash of the process but not of the machine.
        max_record_bytes: largest accepted key + value; a length field above it is treated as corruption.
        poll_interval_s: how often a waiting ``poll`` looks for new records.
    """

    fsync: bool = True
    max_record_bytes: int = 64 << 20
    poll_interval_s: float = 0.02

    def __post_init__(self) -> None:
        if self.max_record_bytes < 1:
            raise ValueError(f"max_record_bytes must be >= 1, got {self.max_record_bytes}")
        if self.poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s must be > 0, got {self.poll_interval_s}")


class TopicLog:
    """One topic's segment file as seen by one bus: the positions of its frames, kept current."""

    def __init__(self, path: Path, config: EmbeddedConfig):
        self.path = path
        self._max_frame = config.max_record_bytes + segment.FRAME_OVERHEAD
        self._fsync = config.fsync
        self._lock = threading.Lock()  # in-process: flock on one descriptor does not exclude threads
        self._positions: list[int] = []
        self._end = len(segment.FILE_HEADER)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            with self._lock:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
                try:
                    if os.fstat(self._fd).st_size == 0:
                        self._write_all(segment.FILE_HEADER, 0)
                    segment.check_header(self._fd, str(path))
                    self._catch_up(truncate=True)
                finally:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
        except BaseException:
            os.close(self._fd)
            raise

    @property
    def end_offset(self) -> int:
        return len(self._positions)

    def append(self, frame: bytes) -> int:
        """Appends one encoded frame; returns its offset once it is on disk."""
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                # Another process may have appended (or crashed mid-append) since we last looked.
                self._catch_up(truncate=True)
                self._write_all(frame, self._end)
                self._positions.append(self._end)
                self._end += len(frame)
                return len(self._positions) - 1
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def refresh(self) -> None:
        """Picks up frames appended by other buses (other processes) since the last look."""
        if os.fstat(self._fd).st_size == self._end:
            return
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_SH)
            try:
                self._catch_up(truncate=False)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def read(self, offset: int, max_records: int) -> list[tuple[int, segment.Frame]]:
        with self._lock:
            positions = self._positions[offset : offset + max_records]
        # Frames before the known end are immutable, so they are read without holding any lock.
        return [(offset + i, segment.read_frame(self._fd, pos)) for i, pos in enumerate(positions)]

    def offset_for_time(self, timestamp_ms: int) -> int:
        """Offset of the first frame published at or after ``timestamp_ms``; the end offset if none is.

        A linear scan of the frame headers (timestamps are the publishers' clocks, so they need not be
        monotonic and a binary search could miss a frame), reading 12 bytes per frame."""
        self.refresh()
        with self._lock:
            positions = list(self._positions)
        for offset, pos in enumerate(positions):
            if segment.read_timestamp(self._fd, pos) >= timestamp_ms:
                return offset
        return len(positions)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def _catch_up(self, truncate: bool) -> None:
        # Called with the flock held: under LOCK_EX nobody is writing, so bytes that do not form a valid
        # frame are a torn tail and can be cut; under LOCK_SH they are only skipped.
        size = os.fstat(self._fd).st_size
        if size <= self._end:
            return
        positions, valid_end = segment.scan(self._fd, self._end, size, self._max_frame)
        self._positions.extend(positions)
        self._end = valid_end
        if valid_end < size and truncate:
            log.warning(
                "event log %s: dropping a torn tail of %d bytes after offset %d (an append was interrupted)",
                self.path,
                size - valid_end,
                len(self._positions) - 1,
            )
            os.ftruncate(self._fd, valid_end)
            os.fsync(self._fd)

    def _write_all(self, data: bytes, pos: int) -> None:
        view = memoryview(data)
        while view:
            written = os.pwrite(self._fd, view, pos)
            view = view[written:]
            pos += written
        if self._fsync:
            os.fsync(self._fd)


class EmbeddedBus:
    """The event bus on a local directory. Safe to share between threads and between processes."""

    def __init__(self, directory: str | Path, config: EmbeddedConfig | None = None):
        self.directory = Path(directory)
        self.config = config or EmbeddedConfig()
        (self.directory / "topics").mkdir(parents=True, exist_ok=True)
        (self.directory / "groups").mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._logs: dict[str, TopicLog] = {}
        self._consumers: list[EmbeddedConsumer] = []
        self._closed = False

    def __enter__(self) -> EmbeddedBus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EmbeddedBus({str(self.directory)!r})"

    def publish(self, topic: str, value: bytes, key: bytes | None = None) -> None:
        validate_topic(topic)
        value, key = validate_payload(value, key)
        size = len(value) + (len(key) if key else 0)
        if size > self.config.max_record_bytes:
            raise ValueError(
                f"record of {size} bytes (key + value) exceeds max_record_bytes={self.config.max_record_bytes}"
            )
        frame = segment.encode(time.time_ns() // 1_000_000, key, value)
        self.topic_log(topic).append(frame)

    def subscribe(self, topics: list[str], group: str) -> EmbeddedConsumer:
        names = validate_topics(topics)
        validate_group(group)
        logs = {name: self.topic_log(name) for name in names}
        consumer = EmbeddedConsumer(logs, GroupOffsets(self.directory / "groups", group), self.config)
        with self._lock:
            self._consumers.append(consumer)
        return consumer

    def topic_log(self, topic: str) -> TopicLog:
        """The open segment of ``topic``, created (and recovered) on first use."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self!r} is closed")
            topic_log = self._logs.get(topic)
            if topic_log is None:
                topic_log = TopicLog(self.directory / "topics" / f"{topic}.log", self.config)
                self._logs[topic] = topic_log
            return topic_log

    def close(self) -> None:
        """Closes every consumer created by this bus, then the segment files."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            consumers, self._consumers = self._consumers, []
            logs, self._logs = self._logs, {}
        for consumer in consumers:
            consumer.close()
        for topic_log in logs.values():
            topic_log.close()


class _Assignment:
    """A consumer's state for one topic: whether it owns it for the group, and where it reads next."""

    def __init__(self) -> None:
        self.member_fd: int | None = None  # holds the group's member flock while owned
        self.position = 0
        self.pending_seek: int | None = None  # a seek made before ownership, applied when it is gained


class EmbeddedConsumer:
    """A consumer-group member reading topics of an ``EmbeddedBus``; see the module notes on ownership."""

    def __init__(self, logs: dict[str, TopicLog], offsets: GroupOffsets, config: EmbeddedConfig):
        self._logs = logs
        self._offsets = offsets
        self._config = config
        self._assignments = {topic: _Assignment() for topic in logs}
        self._topics = list(logs)
        self._next_topic = 0  # round-robin start, so one busy topic cannot starve the others
        self._closed = False

    @property
    def group(self) -> str:
        return self._offsets.group

    def owned_topics(self) -> list[str]:
        """Topics this consumer currently owns for its group (claims free ones first)."""
        self._check_open()
        self._claim()
        return [t for t in self._topics if self._assignments[t].member_fd is not None]

    def poll(self, timeout_s: float, max_records: int = 500) -> list[Record]:
        validate_poll(timeout_s, max_records)
        self._check_open()
        deadline = time.monotonic() + timeout_s
        while True:
            records = self._poll_once(max_records)
            remaining = deadline - time.monotonic()
            if records or remaining <= 0:
                return records
            time.sleep(min(self._config.poll_interval_s, remaining))

    def commit(self) -> None:
        self._check_open()
        self._offsets.commit(
            {t: a.position for t, a in self._assignments.items() if a.member_fd is not None}
        )

    def seek(self, topic: str, partition: int, offset: int) -> None:
        self._check_open()
        validate_position(partition, offset)
        assignment = self._assignment(topic)
        if partition != 0:
            raise ValueError(f"the embedded log has a single partition 0 per topic; got partition {partition}")
        if assignment.member_fd is not None:
            assignment.position = offset
        else:
            assignment.pending_seek = offset

    def seek_to_beginning(self) -> None:
        self._check_open()
        for assignment in self._assignments.values():
            if assignment.member_fd is not None:
                assignment.position = 0
            else:
                assignment.pending_seek = 0

    def offsets_for_time(self, topic: str, timestamp_ms: int) -> dict[int, int]:
        self._check_open()
        validate_timestamp(timestamp_ms)
        self._assignment(topic)  # only subscribed topics, as on Kafka
        return {0: self._logs[topic].offset_for_time(timestamp_ms)}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for assignment in self._assignments.values():
            if assignment.member_fd is not None:
                os.close(assignment.member_fd)  # releases ownership; committed offsets stay as they are
                assignment.member_fd = None

    def _assignment(self, topic: str) -> _Assignment:
        try:
            return self._assignments[topic]
        except KeyError:
            raise ValueError(f"topic {topic!r} is not subscribed by this consumer ({self._topics})") from None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"consumer of group {self.group!r} is closed")

    def _claim(self) -> None:
        committed: dict[str, int] | None = None
        for topic, assignment in self._assignments.items():
            if assignment.member_fd is not None:
                continue
            path = self._offsets.member_path(topic)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)  # another member of the group owns the topic
                continue
            assignment.member_fd = fd
            if assignment.pending_seek is not None:
                assignment.position, assignment.pending_seek = assignment.pending_seek, None
            else:
                if committed is None:
                    committed = self._offsets.load()
                assignment.position = committed.get(topic, 0)

    def _poll_once(self, max_records: int) -> list[Record]:
        self._claim()
        records: list[Record] = []
        count = len(self._topics)
        for i in range(count):
            topic = self._topics[(self._next_topic + i) % count]
            assignment = self._assignments[topic]
            if assignment.member_fd is None:
                continue
            topic_log = self._logs[topic]
            topic_log.refresh()
            for offset, frame in topic_log.read(assignment.position, max_records - len(records)):
                records.append(Record(topic, 0, offset, frame.key, frame.value, frame.timestamp_ms))
                assignment.position = offset + 1
            if len(records) >= max_records:
                break
        self._next_topic = (self._next_topic + 1) % count
        return records
