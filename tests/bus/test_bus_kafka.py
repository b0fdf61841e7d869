"""Kafka backend specifics: unreachable clusters, back-off, and a real broker restart losing nothing."""

import logging
import re
import socket
import uuid

import pytest
from kafka.errors import KafkaConnectionError

from k3.services.bus import BusUnavailable, KafkaBus, KafkaConfig, open_bus
from k3.services.bus.kafka_bus import connect_with_retry


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nobody listens once the socket is closed


@pytest.mark.timeout(60)
def test_unreachable_kafka_fails_with_a_clear_error_after_logged_retries(caplog):
    port = closed_port()
    config = KafkaConfig(connect_attempts=2, retry_base_delay_s=0.01, connect_timeout_s=0.3)
    with caplog.at_level(logging.WARNING, logger="k3.services.bus.kafka_bus"):
        with pytest.raises(BusUnavailable) as raised:
            open_bus(f"kafka://127.0.0.1:{port}", kafka=config)
    assert re.fullmatch(
        rf"Kafka at 127\.0\.0\.1:{port} unreachable after 2 attempts over \d+\.\d s: .+", str(raised.value)
    )
    messages = [r.getMessage() for r in caplog.records if r.name == "k3.services.bus.kafka_bus"]
    assert len(messages) == 2
    assert messages[0].startswith(f"Kafka at 127.0.0.1:{port} unreachable (attempt 1/2): ")
    assert messages[0].endswith("retrying in 0.01 s")
    assert messages[1].startswith(f"Kafka at 127.0.0.1:{port} unreachable (attempt 2/2): ")
    assert messages[1].endswith("giving up")


def test_back_off_doubles_from_the_base_delay():
    waits: list[float] = []

    def refuse():
        raise KafkaConnectionError("connection refused")

    with pytest.raises(BusUnavailable, match=r"unreachable after 5 attempts over .* s: .*connection refused"):
        connect_with_retry(refuse, "h:1", attempts=5, base_delay_s=0.5, sleep=waits.append)
    assert waits == [0.5, 1.0, 2.0, 4.0]


def test_a_later_success_returns_the_client_without_raising():
    outcomes = iter([KafkaConnectionError("not yet"), "client"])

    def flaky():
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    waits: list[float] = []
    assert connect_with_retry(flaky, "h:1", attempts=3, base_delay_s=0.2, sleep=waits.append) == "client"
    assert waits == [0.2]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("connect_attempts", 0, "connect_attempts must be >= 1, got 0"),
        ("retry_base_delay_s", -1, "retry_base_delay_s must be >= 0, got -1"),
        ("connect_timeout_s", 0, "connect_timeout_s must be > 0, got 0"),
        ("partitions", 0, "partitions must be >= 1, got 0"),
        ("replication_factor", 0, "replication_factor must be >= 1, got 0"),
    ],
)
def test_bad_config_is_rejected(field, value, message):
    with pytest.raises(ValueError, match=message):
        KafkaConfig(**{field: value})


@pytest.mark.kafka
@pytest.mark.timeout(120)
def test_key_routing_is_deterministic_across_clients_and_topics(kafka_bootstrap, drain):
    keys = [f"key-{i}".encode() for i in range(8)]
    placements = []
    for _ in range(2):
        topic = f"test-{uuid.uuid4().hex}"
        with KafkaBus([kafka_bootstrap], KafkaConfig(partitions=4)) as bus:
            for key in keys:
                bus.publish(topic, b"v", key=key)
            records = drain(bus.subscribe([topic], "g"), len(keys))
        placements.append({r.key: r.partition for r in records})
    assert placements[0] == placements[1]
    assert len(placements[0]) == len(keys)
    assert len(set(placements[0].values())) > 1  # 8 keys over 4 partitions do not all collide


@pytest.mark.kafka
@pytest.mark.timeout(420)
def test_a_broker_restart_loses_no_published_record(kafka_broker_factory, drain):
    broker = kafka_broker_factory()
    topic, group = f"test-{uuid.uuid4().hex}", "restart-group"
    bus = open_bus(f"kafka://{broker.bootstrap}")
    for i in range(30):
        bus.publish(topic, b"%d" % i, key=b"%d" % (i % 3))
    consumer = bus.subscribe([topic], group)
    committed = drain(consumer, 10, max_records=10)
    assert len(committed) == 10
    consumer.commit()
    assert len(drain(consumer, 20)) == 20  # delivered, but the commit never happens
    bus.close()

    broker.stop()
    assert not broker.is_running()
    broker.start()  # same port, same data directory

    bus = open_bus(f"kafka://{broker.bootstrap}")
    try:
        records = drain(bus.subscribe([topic], group), 20, timeout_s=120)
        expected = {int(r.value) for r in committed} ^ set(range(30))
        assert sorted(int(r.value) for r in records) == sorted(expected)
        bus.publish(topic, b"after restart", key=b"0")  # the restarted broker also takes new records
        everything = drain(bus.subscribe([topic], group + "-new"), 31, timeout_s=120)
        assert sorted(r.value for r in everything) == sorted([b"%d" % i for i in range(30)] + [b"after restart"])
    finally:
        bus.close()
