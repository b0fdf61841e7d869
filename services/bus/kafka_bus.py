"""The event bus on Apache Kafka, through kafka-python.

Design decisions:
- ``publish`` is synchronous: send with ``acks=all``, flush, and wait for the record's acknowledgement, so
  that "returned" means "durably in the partition's in-sync replicas". The delivery future is checked
  after the flush because a flush alone does not report a failed send.
- Consumers never auto-commit (``enable_auto_commit=False``) and start at the earliest offset when their
  group has none (``auto_offset_reset="earliest"``): together with explicit ``commit`` this is
  at-least-once delivery, the same contract as the embedded log.
- Topics are created through the admin client, with ``KafkaConfig.partitions`` partitions, the first time
  this bus publishes to or subscribes to them; relying on broker auto-creation would silently give them
  the broker's default partition count. Keys route with the client's default partitioner (murmur2, the
  same as the Java client), so equal keys always land on the same partition.
- Unreachable at start: the bus connects eagerly and retries with exponential back-off, logging every
  failed attempt, then raises ``BusUnavailable`` naming the servers, attempts, time spent and last error.
- ``seek``/``seek_to_beginning`` on a consumer whose group assignment has not arrived yet are remembered
  and applied when the partitions are assigned (Kafka itself only seeks assigned partitions).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from kafka import ConsumerRebalanceListener, KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewTopic
from kafka.errors import KafkaConnectionError, KafkaError, KafkaTimeoutError, TopicAlreadyExistsError

from k3.services.bus.api import (
    BusUnavailable,
    Record,
    validate_group,
    validate_payload,
    validate_poll,
    validate_position,
    validate_timestamp,
    validate_topic,
    validate_topics,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class KafkaConfig:
    """Settings of the Kafka backend.

    Fields:
        connect_attempts: how many times to try reaching the cluster before raising ``BusUnavailable``.
        retry_base_delay_s: wait after the first failed attempt; each further wait doubles it.
        connect_timeout_s: how long one attempt waits for a bootstrap server to answer.
        request_timeout_s: how long ``publish`` and admin requests wait for the cluster.
        partitions: partition count of the topics this bus creates.
        replication_factor: replica count of the topics this bus creates (1 on a single local broker).
        session_timeout_s: after this long without heartbeats a consumer is dropped from its group and its
            partitions (with their uncommitted records) go to the other members.
        client_id: client name shown in broker logs and metrics.
    """

    connect_attempts: int = 5
    retry_base_delay_s: float = 0.5
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 30.0
    partitions: int = 3
    replication_factor: int = 1
    session_timeout_s: float = 10.0
    client_id: str = "k3"

    def __post_init__(self) -> None:
        if self.connect_attempts < 1:
            raise ValueError(f"connect_attempts must be >= 1, got {self.connect_attempts}")
        if self.retry_base_delay_s < 0:
            raise ValueError(f"retry_base_delay_s must be >= 0, got {self.retry_base_delay_s}")
        for name in ("connect_timeout_s", "request_timeout_s", "session_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.partitions < 1:
            raise ValueError(f"partitions must be >= 1, got {self.partitions}")
        if self.replication_factor < 1:
            raise ValueError(f"replication_factor must be >= 1, got {self.replication_factor}")


def connect_with_retry(
    connect: Callable[[], T],
    servers: str,
    attempts: int,
    base_delay_s: float,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Calls ``connect`` until it succeeds, waiting ``base_delay_s * 2**(n-1)`` after the n-th failure."""
    start = time.monotonic()
    last: Exception | None = None
    for attempt in range(1, attempts + 1):
        try:
            return connect()
        except KafkaError as exc:
            last = exc
        if attempt == attempts:
            log.warning("Kafka at %s unreachable (attempt %d/%d): %s; giving up", servers, attempt, attempts, last)
            break
        delay = base_delay_s * 2 ** (attempt - 1)
        log.warning(
            "Kafka at %s unreachable (attempt %d/%d): %s; retrying in %.2f s", servers, attempt, attempts, last, delay
        )
        sleep(delay)
    elapsed = time.monotonic() - start
    raise BusUnavailable(
        f"Kafka at {servers} unreachable after {attempts} attempts over {elapsed:.1f} s: {last}"
    ) from last


class KafkaBus:
    """The event bus on a Kafka cluster. ``publish`` is safe to call from several threads."""

    def __init__(self, bootstrap_servers: list[str], config: KafkaConfig | None = None):
        if not bootstrap_servers:
            raise ValueError("bootstrap_servers must name at least one host:port")
        self.bootstrap_servers = list(bootstrap_servers)
        self.config = config or KafkaConfig()
        self._servers = ",".join(self.bootstrap_servers)
        self._lock = threading.Lock()
        self._known_topics: set[str] = set()
        self._producer: KafkaProducer | None = None
        self._consumers: list[KafkaBusConsumer] = []
        self._closed = False
        self._admin = self._connect(
            lambda: KafkaAdminClient(
                **self._client_options(), request_timeout_ms=int(self.config.request_timeout_s * 1000)
            )
        )

    def __enter__(self) -> KafkaBus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"KafkaBus({self._servers!r})"

    def publish(self, topic: str, value: bytes, key: bytes | None = None) -> None:
        validate_topic(topic)
        value, key = validate_payload(value, key)
        self._check_open()
        self.ensure_topics([topic])
        producer = self._get_producer()
        timeout = self.config.request_timeout_s
        try:
            future = producer.send(topic, value=value, key=key)
            producer.flush(timeout=timeout)
            future.get(timeout=timeout)
        except (KafkaTimeoutError, KafkaConnectionError) as exc:
            raise BusUnavailable(
                f"publish to {topic!r} was not acknowledged by Kafka at {self._servers} within {timeout} s: {exc}"
            ) from exc

    def subscribe(self, topics: list[str], group: str) -> KafkaBusConsumer:
        names = validate_topics(topics)
        validate_group(group)
        self._check_open()
        self.ensure_topics(names)
        consumer = self._connect(
            lambda: KafkaConsumer(
                **self._client_options(),
                group_id=group,
                enable_auto_commit=False,
                auto_offset_reset="earliest",
                session_timeout_ms=int(self.config.session_timeout_s * 1000),
                heartbeat_interval_ms=max(100, int(self.config.session_timeout_s * 1000) // 3),
            )
        )
        wrapped = KafkaBusConsumer(consumer, names, group)
        with self._lock:
            self._consumers.append(wrapped)
        return wrapped

    def ensure_topics(self, topics: list[str]) -> None:
        """Creates the topics this bus has not seen yet (an existing topic is left as it is)."""
        missing = [t for t in topics if t not in self._known_topics]
        for topic in missing:
            try:
                self._admin.create_topics(
                    [NewTopic(topic, self.config.partitions, self.config.replication_factor)],
                    timeout_ms=int(self.config.request_timeout_s * 1000),
                )
                log.info("created Kafka topic %s with %d partitions", topic, self.config.partitions)
            except TopicAlreadyExistsError:
                pass
            with self._lock:
                self._known_topics.add(topic)

    def close(self) -> None:
        """Closes the consumers created by this bus (without committing), the producer and admin client."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            consumers, self._consumers = self._consumers, []
            producer, self._producer = self._producer, None
        for consumer in consumers:
            consumer.close()
        if producer is not None:
            producer.close(timeout=self.config.request_timeout_s)
        self._admin.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")

    def _client_options(self) -> dict:
        return {
            "bootstrap_servers": self.bootstrap_servers,
            "client_id": self.config.client_id,
            "bootstrap_timeout_ms": int(self.config.connect_timeout_s * 1000),
        }

    def _connect(self, make: Callable[[], T]) -> T:
        return connect_with_retry(make, self._servers, self.config.connect_attempts, self.config.retry_base_delay_s)

    def _get_producer(self) -> KafkaProducer:
        with self._lock:
            self._check_open()
            if self._producer is None:
                self._producer = self._connect(
                    lambda: KafkaProducer(
                        **self._client_options(),
                        acks="all",
                        linger_ms=0,
                        request_timeout_ms=int(self.config.request_timeout_s * 1000),
                        max_block_ms=int(self.config.request_timeout_s * 1000),
                    )
                )
            return self._producer


class _ApplyPendingSeeks(ConsumerRebalanceListener):
    def __init__(self, owner: KafkaBusConsumer):
        self._owner = owner

    def on_partitions_revoked(self, revoked) -> None:
        pass

    def on_partitions_assigned(self, assigned) -> None:
        self._owner._apply_pending(assigned)


class KafkaBusConsumer:
    """A consumer-group member on Kafka; partitions are assigned by the group coordinator."""

    def __init__(self, consumer: KafkaConsumer, topics: list[str], group: str):
        self._consumer = consumer
        self._topics = topics
        self.group = group
        self._pending: dict[TopicPartition, int] = {}
        self._pending_beginning = False
        self._closed = False
        # Knowing the partitions before joining lets the first assignment cover them; otherwise the group
        # is assigned nothing and has to rebalance again once metadata arrives.
        for topic in topics:
            consumer.partitions_for_topic(topic)
        consumer.subscribe(topics, listener=_ApplyPendingSeeks(self))

    def poll(self, timeout_s: float, max_records: int = 500) -> list[Record]:
        validate_poll(timeout_s, max_records)
        self._check_open()
        batches = self._consumer.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        return [
            Record(r.topic, r.partition, r.offset, r.key, r.value, r.timestamp)
            for records in batches.values()
            for r in records
        ]

    def commit(self) -> None:
        self._check_open()
        self._consumer.commit()

    def seek(self, topic: str, partition: int, offset: int) -> None:
        self._check_open()
        validate_position(partition, offset)
        if topic not in self._topics:
            raise ValueError(f"topic {topic!r} is not subscribed by this consumer ({self._topics})")
        partitions = self._consumer.partitions_for_topic(topic)
        if partitions and partition not in partitions:
            raise ValueError(f"topic {topic!r} has partitions 0..{max(partitions)}; got partition {partition}")
        tp = TopicPartition(topic, partition)
        if tp in self._consumer.assignment():
            self._consumer.seek(tp, offset)
        else:
            self._pending[tp] = offset

    def seek_to_beginning(self) -> None:
        self._check_open()
        self._pending.clear()
        assigned = self._consumer.assignment()
        if assigned:
            self._consumer.seek_to_beginning(*assigned)
        else:
            self._pending_beginning = True

    def offsets_for_time(self, topic: str, timestamp_ms: int) -> dict[int, int]:
        self._check_open()
        validate_timestamp(timestamp_ms)
        if topic not in self._topics:
            raise ValueError(f"topic {topic!r} is not subscribed by this consumer ({self._topics})")
        partitions = self._consumer.partitions_for_topic(topic)
        if not partitions:
            raise BusUnavailable(f"no partition metadata for topic {topic!r} from Kafka yet")
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        try:
            found = self._consumer.offsets_for_times({tp: timestamp_ms for tp in tps})
            ends = self._consumer.end_offsets(tps)
        except KafkaTimeoutError as exc:
            raise BusUnavailable(f"Kafka did not answer the offsets of {topic!r} at {timestamp_ms} ms: {exc}") from exc
        return {tp.partition: (ends[tp] if found.get(tp) is None else found[tp].offset) for tp in tps}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._consumer.close(autocommit=False)

    def _apply_pending(self, assigned) -> None:
        for tp in assigned:
            if tp in self._pending:
                self._consumer.seek(tp, self._pending.pop(tp))
            elif self._pending_beginning:
                self._consumer.seek_to_beginning(tp)
        if assigned:  # a join can assign nothing (e.g. before topic metadata arrived); keep waiting then
            self._pending_beginning = False

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"consumer of group {self.group!r} is closed")
