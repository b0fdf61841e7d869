"""The event bus contract shared by every backend: records, the bus and consumer protocols, validation.

Design decisions:
- The contract is Kafka's, reduced to what k3 needs: topics of partitions of offset-addressed records,
  consumer groups with independent committed offsets, explicit commits (at-least-once delivery), seeks.
  Anything that is not expressible on a plain Kafka cluster is deliberately absent, so that code written
  against the embedded log runs unchanged on Kafka.
- Payloads are bytes. Serialisation (protobuf, JSON) belongs to the producer and consumer of a topic,
  never to the bus, and nothing is ever unpickled.
- Names are validated with Kafka's rules on every backend, so a topic that works locally cannot be
  rejected by a real cluster later.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

# Kafka's own limit: a topic name becomes a directory name (with a partition suffix) on the broker.
MAX_TOPIC_LENGTH = 249
_TOPIC_CHARS = re.compile(r"[a-zA-Z0-9._-]+")


class BusUnavailable(ConnectionError):
    """The bus backend cannot be reached (for Kafka: after all connection attempts were used)."""


@dataclass(frozen=True)
class Record:
    """One record as delivered to a consumer.

    Fields:
        topic: topic the record was published to.
        partition: partition within the topic (always 0 on the embedded log).
        offset: position of the record in its partition; commit semantics refer to it.
        key: routing key given at publish time, or None.
        value: the payload.
        timestamp_ms: publish time in milliseconds since the Unix epoch (producer clock).
    """

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    timestamp_ms: int


@runtime_checkable
class Consumer(Protocol):
    """A member of a consumer group, reading the topics it subscribed to.

    A consumer is used from one thread at a time (as Kafka's own consumers are).
    """

    def poll(self, timeout_s: float, max_records: int = 500) -> list[Record]:
        """Returns up to ``max_records`` records, waiting at most ``timeout_s`` for the first one."""
        ...

    def commit(self) -> None:
        """Commits, for the group, the position after every record returned by ``poll`` so far."""
        ...

    def seek(self, topic: str, partition: int, offset: int) -> None:
        """Makes the next ``poll`` of ``topic``/``partition`` start at ``offset``."""
        ...

    def seek_to_beginning(self) -> None:
        """Makes the next ``poll`` start at the first record of every subscribed partition."""
        ...

    def offsets_for_time(self, topic: str, timestamp_ms: int) -> dict[int, int]:
        """Partition -> offset of the first record of ``topic`` published at or after ``timestamp_ms`` (ms
        since the Unix epoch), or the partition's end offset when there is none. Only a query: combine it
        with ``seek`` to start reading there."""
        ...

    def close(self) -> None:
        """Leaves the group without committing; uncommitted records will be delivered again."""
        ...


@runtime_checkable
class EventBus(Protocol):
    """Publishes records and creates consumers."""

    def publish(self, topic: str, value: bytes, key: bytes | None = None) -> None:
        """Appends one record; when this returns the record is durable (flushed and acknowledged)."""
        ...

    def subscribe(self, topics: list[str], group: str) -> Consumer:
        """Returns a consumer of ``topics`` in consumer group ``group``."""
        ...

    def close(self) -> None:
        """Releases connections and files; consumers created by the bus must be closed first."""
        ...


def validate_topic(topic: object) -> str:
    """Returns ``topic`` if it is a legal Kafka topic name, else raises ValueError saying why."""
    if not isinstance(topic, str):
        raise ValueError(f"topic name must be a string, got {type(topic).__name__}")
    if not topic:
        raise ValueError("topic name must not be empty")
    if topic in (".", ".."):
        raise ValueError(f"topic name {topic!r} is not allowed")
    if len(topic) > MAX_TOPIC_LENGTH:
        raise ValueError(
            f"topic name {topic[:20]!r}... is {len(topic)} characters long; the limit is {MAX_TOPIC_LENGTH}"
        )
    if not _TOPIC_CHARS.fullmatch(topic):
        bad = sorted({c for c in topic if not _TOPIC_CHARS.fullmatch(c)})
        raise ValueError(
            f"topic name {topic!r} contains {''.join(bad)!r}; only ASCII letters, digits, '.', '_' and '-' "
            "are allowed"
        )
    return topic


def validate_topics(topics: object) -> list[str]:
    """Validates a subscription list: a non-empty list of distinct legal topic names."""
    if isinstance(topics, str) or not isinstance(topics, list | tuple):
        raise ValueError(f"topics must be a list of topic names, got {type(topics).__name__}")
    if not topics:
        raise ValueError("topics must name at least one topic")
    names = [validate_topic(t) for t in topics]
    if len(set(names)) != len(names):
        raise ValueError(f"topics contains duplicates: {names}")
    return names


def validate_group(group: object) -> str:
    """Consumer group ids may be any non-empty string (Kafka's rule)."""
    if not isinstance(group, str) or not group:
        raise ValueError(f"consumer group must be a non-empty string, got {group!r}")
    return group


def validate_payload(value: object, key: object) -> tuple[bytes, bytes | None]:
    """Checks a record's value and key are bytes-like and returns them as bytes."""
    if not isinstance(value, bytes | bytearray | memoryview):
        raise TypeError(f"value must be bytes, got {type(value).__name__}")
    if key is not None and not isinstance(key, bytes | bytearray | memoryview):
        raise TypeError(f"key must be bytes or None, got {type(key).__name__}")
    return bytes(value), (None if key is None else bytes(key))


def validate_poll(timeout_s: object, max_records: object) -> None:
    if not isinstance(timeout_s, int | float) or timeout_s < 0:
        raise ValueError(f"timeout_s must be a number >= 0, got {timeout_s!r}")
    if not isinstance(max_records, int) or isinstance(max_records, bool) or max_records < 1:
        raise ValueError(f"max_records must be an int >= 1, got {max_records!r}")


def validate_timestamp(timestamp_ms: object) -> int:
    if not isinstance(timestamp_ms, int) or isinstance(timestamp_ms, bool) or timestamp_ms < 0:
        raise ValueError(f"timestamp_ms must be an int >= 0 (ms since the Unix epoch), got {timestamp_ms!r}")
    return timestamp_ms


def validate_position(partition: object, offset: object) -> None:
    if not isinstance(partition, int) or isinstance(partition, bool) or partition < 0:
        raise ValueError(f"partition must be an int >= 0, got {partition!r}")
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise ValueError(f"offset must be an int >= 0, got {offset!r}")
