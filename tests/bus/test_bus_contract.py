"""The event bus contract, run against every backend (embedded log and a real Kafka broker)."""

import re
import threading
import time

import pytest

from k3.services.bus import Consumer, EventBus

pytestmark = pytest.mark.timeout(180)


def values(records) -> list[bytes]:
    return [r.value for r in records]


def test_bus_and_consumer_implement_the_protocols(bus, topic, group):
    consumer = bus.subscribe([topic], group)
    assert isinstance(bus, EventBus)
    assert isinstance(consumer, Consumer)


def test_records_arrive_in_publish_order_with_their_fields(bus, topic, group, drain):
    before_ms = int(time.time() * 1000)
    for i in range(20):
        bus.publish(topic, f"v{i}".encode(), key=b"one-key")
    after_ms = int(time.time() * 1000)

    records = drain(bus.subscribe([topic], group), 20)

    assert values(records) == [f"v{i}".encode() for i in range(20)]
    assert {r.topic for r in records} == {topic}
    assert len({r.partition for r in records}) == 1  # one key, one partition
    assert [r.offset for r in records] == list(range(20))
    assert all(r.key == b"one-key" for r in records)
    assert all(before_ms - 1000 <= r.timestamp_ms <= after_ms + 1000 for r in records)


def test_unkeyed_records_keep_publish_order_within_each_partition(bus, topic, group, drain):
    for i in range(30):
        bus.publish(topic, str(i).encode())
    records = drain(bus.subscribe([topic], group), 30)

    assert sorted(int(r.value) for r in records) == list(range(30))
    assert all(r.key is None for r in records)
    for partition in {r.partition for r in records}:
        mine = [r for r in records if r.partition == partition]
        assert [r.offset for r in mine] == list(range(len(mine)))
        assert [int(r.value) for r in mine] == sorted(int(r.value) for r in mine)


def test_equal_keys_go_to_the_same_partition(bus, topic, group, drain):
    keys = [f"user-{i}".encode() for i in range(6)]
    for round_ in range(4):
        for key in keys:
            bus.publish(topic, round_.to_bytes(1, "big"), key=key)
    records = drain(bus.subscribe([topic], group), 24)

    assert len(records) == 24
    for key in keys:
        mine = [r for r in records if r.key == key]
        assert len({r.partition for r in mine}) == 1
        assert [r.value[0] for r in mine] == [0, 1, 2, 3]


def test_a_subscription_reads_all_its_topics(bus, topic, group, drain):
    other = topic + ".other"
    for i in range(5):
        bus.publish(topic, b"a%d" % i)
        bus.publish(other, b"b%d" % i)
    records = drain(bus.subscribe([topic, other], group), 10)

    assert sorted(values(r for r in records if r.topic == topic)) == [b"a%d" % i for i in range(5)]
    assert sorted(values(r for r in records if r.topic == other)) == [b"b%d" % i for i in range(5)]


def test_consumer_groups_have_independent_offsets(bus, topic, drain):
    for i in range(5):
        bus.publish(topic, b"%d" % i, key=b"k")
    first = bus.subscribe([topic], "group-a-" + topic)
    assert values(drain(first, 5)) == [b"%d" % i for i in range(5)]
    first.commit()

    second = bus.subscribe([topic], "group-b-" + topic)
    assert values(drain(second, 5)) == [b"%d" % i for i in range(5)]


def test_restart_after_commit_resumes_after_the_committed_record(open_test_bus, topic, group, drain):
    bus = open_test_bus()
    for i in range(10):
        bus.publish(topic, b"%d" % i, key=b"k")
    consumer = bus.subscribe([topic], group)
    assert values(drain(consumer, 4, max_records=4)) == [b"0", b"1", b"2", b"3"]
    consumer.commit()
    assert len(drain(consumer, 6)) == 6  # read, but never committed
    consumer.close()

    restarted = open_test_bus().subscribe([topic], group)  # a new process, as far as the bus can tell
    records = drain(restarted, 6)
    assert values(records) == [b"%d" % i for i in range(4, 10)]
    assert [r.offset for r in records] == list(range(4, 10))
    assert restarted.poll(timeout_s=1.0) == []


def test_uncommitted_records_are_delivered_again_after_restart(open_test_bus, topic, group, drain):
    bus = open_test_bus()
    for i in range(5):
        bus.publish(topic, b"%d" % i, key=b"k")
    consumer = bus.subscribe([topic], group)
    first = drain(consumer, 5)
    consumer.close()

    again = drain(open_test_bus().subscribe([topic], group), 5)
    assert [(r.offset, r.value) for r in again] == [(r.offset, r.value) for r in first]


def test_commit_without_new_records_keeps_the_position(bus, topic, group, drain):
    for i in range(3):
        bus.publish(topic, b"%d" % i, key=b"k")
    consumer = bus.subscribe([topic], group)
    assert len(drain(consumer, 3)) == 3
    consumer.commit()
    consumer.commit()
    consumer.close()
    bus.publish(topic, b"3", key=b"k")
    assert values(drain(bus.subscribe([topic], group), 1)) == [b"3"]


def test_seek_moves_the_next_poll(bus, topic, group, drain):
    for i in range(10):
        bus.publish(topic, b"%d" % i, key=b"k")
    consumer = bus.subscribe([topic], group)
    records = drain(consumer, 10)
    partition = records[0].partition

    consumer.seek(topic, partition, 3)  # after the partition was assigned
    assert [r.offset for r in drain(consumer, 7)] == list(range(3, 10))

    early = bus.subscribe([topic], group + "-early")
    early.seek(topic, partition, 8)  # before the group assigned anything: applied on assignment
    assert values(drain(early, 2)) == [b"8", b"9"]


def test_seek_to_beginning_replays_committed_records(bus, topic, group, drain):
    for i in range(4):
        bus.publish(topic, b"%d" % i, key=b"k")
    consumer = bus.subscribe([topic], group)
    assert len(drain(consumer, 4)) == 4
    consumer.commit()
    consumer.seek_to_beginning()
    assert values(drain(consumer, 4)) == [b"0", b"1", b"2", b"3"]
    consumer.close()

    fresh = bus.subscribe([topic], group)  # the group's committed offset is 4...
    fresh.seek_to_beginning()  # ...but a seek before the first poll wins
    assert values(drain(fresh, 4)) == [b"0", b"1", b"2", b"3"]


def _now_ms_between_publishes() -> int:
    """A time strictly after every record published so far and before every one published next."""
    time.sleep(0.05)
    now = int(time.time() * 1000)
    time.sleep(0.05)
    return now


def test_offsets_for_time_find_the_first_record_at_or_after_it(bus, topic, group, drain):
    consumer = bus.subscribe([topic], group)
    assert set(consumer.offsets_for_time(topic, 0).values()) == {0}  # empty topic: its end
    for i in range(3):
        bus.publish(topic, b"old%d" % i, key=b"k")
    cut = _now_ms_between_publishes()
    for i in range(2):
        bus.publish(topic, b"new%d" % i, key=b"k")
    after_all = _now_ms_between_publishes()

    assert sum(consumer.offsets_for_time(topic, 0).values()) == 0
    at_cut = consumer.offsets_for_time(topic, cut)
    assert sum(at_cut.values()) == 3  # one key, one partition: offset 3 there, the others empty
    at_end = consumer.offsets_for_time(topic, after_all)
    assert sum(at_end.values()) == 5  # nothing that late: every partition's end

    for partition, offset in at_cut.items():
        consumer.seek(topic, partition, offset)
    assert values(drain(consumer, 2)) == [b"new0", b"new1"]
    late = bus.subscribe([topic], f"{group}-late")
    for partition, offset in at_end.items():
        late.seek(topic, partition, offset)
    assert late.poll(timeout_s=0.5) == []
    bus.publish(topic, b"later", key=b"k")
    assert values(drain(late, 1)) == [b"later"]


def test_poll_waits_for_a_record_published_meanwhile(bus, topic, group, drain):
    bus.publish(topic, b"first", key=b"k")
    consumer = bus.subscribe([topic], group)
    assert values(drain(consumer, 1)) == [b"first"]

    publisher = threading.Timer(0.3, bus.publish, args=(topic, b"later"), kwargs={"key": b"k"})
    publisher.start()
    try:
        assert values(drain(consumer, 1)) == [b"later"]
    finally:
        publisher.join(timeout=30)


def test_many_records_in_batches(bus, topic, group):
    count = 400
    for i in range(count):
        bus.publish(topic, i.to_bytes(4, "big") * 25, key=(i % 5).to_bytes(1, "big"))
    consumer = bus.subscribe([topic], group)
    seen: list[int] = []
    deadline = time.monotonic() + 120
    while len(seen) < count and time.monotonic() < deadline:
        batch = consumer.poll(timeout_s=1.0, max_records=64)
        assert len(batch) <= 64
        seen += [int.from_bytes(r.value[:4], "big") for r in batch]
        assert all(r.value == r.value[:4] * 25 for r in batch)
    assert sorted(seen) == list(range(count))
    assert consumer.poll(timeout_s=0.5) == []


def test_empty_and_binary_values_round_trip(bus, topic, group, drain):
    payloads = [b"", bytes(range(256)), b"\x00" * 1000]
    for payload in payloads:
        bus.publish(topic, payload, key=b"\x00\xff")
    records = drain(bus.subscribe([topic], group), 3)
    assert values(records) == payloads
    assert [r.key for r in records] == [b"\x00\xff"] * 3


BAD_TOPICS = [
    ("", "topic name must not be empty"),
    ("a b", "topic name 'a b' contains ' '; only ASCII letters, digits"),
    ("k3/jobs", "topic name 'k3/jobs' contains '/'"),
    ("tópico", "contains 'ó'"),
    (".", "topic name '.' is not allowed"),
    ("..", "topic name '..' is not allowed"),
    ("x" * 250, "is 250 characters long; the limit is 249"),
    (7, "topic name must be a string, got int"),
]


@pytest.mark.parametrize(("name", "message"), BAD_TOPICS)
def test_bad_topic_names_are_rejected(bus, group, name, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        bus.publish(name, b"x")
    with pytest.raises(ValueError, match=re.escape(message)):
        bus.subscribe([name], group)


def test_longest_legal_topic_name_works(bus, topic, group, drain):
    name = (topic + "-" + "x" * 249)[:249]
    bus.publish(name, b"long")
    assert values(drain(bus.subscribe([name], group), 1)) == [b"long"]


@pytest.mark.parametrize(
    ("topics", "message"),
    [
        ([], "topics must name at least one topic"),
        ("k3.jobs", "topics must be a list of topic names, got str"),
        (["a", "a"], r"topics contains duplicates: \['a', 'a'\]"),
    ],
)
def test_bad_subscription_lists_are_rejected(bus, group, topics, message):
    with pytest.raises(ValueError, match=message):
        bus.subscribe(topics, group)


@pytest.mark.parametrize("group_id", ["", None, 3])
def test_bad_groups_are_rejected(bus, topic, group_id):
    with pytest.raises(ValueError, match="consumer group must be a non-empty string, got"):
        bus.subscribe([topic], group_id)


def test_bad_payloads_are_rejected(bus, topic):
    with pytest.raises(TypeError, match="value must be bytes, got str"):
        bus.publish(topic, "text")
    with pytest.raises(TypeError, match="key must be bytes or None, got int"):
        bus.publish(topic, b"x", key=5)


def test_bad_poll_and_seek_arguments_are_rejected(bus, topic, group):
    consumer = bus.subscribe([topic], group)
    with pytest.raises(ValueError, match="timeout_s must be a number >= 0, got -1"):
        consumer.poll(timeout_s=-1)
    with pytest.raises(ValueError, match="max_records must be an int >= 1, got 0"):
        consumer.poll(timeout_s=0, max_records=0)
    with pytest.raises(ValueError, match="offset must be an int >= 0, got -5"):
        consumer.seek(topic, 0, -5)
    with pytest.raises(ValueError, match="partition must be an int >= 0, got -1"):
        consumer.seek(topic, -1, 0)
    with pytest.raises(ValueError, match="topic 'elsewhere' is not subscribed by this consumer"):
        consumer.seek("elsewhere", 0, 0)
    with pytest.raises(ValueError, match="got partition 99"):
        consumer.seek(topic, 99, 0)
    for bad in (-1, 1.5, True, "0"):
        with pytest.raises(ValueError, match="timestamp_ms must be an int >= 0"):
            consumer.offsets_for_time(topic, bad)
    with pytest.raises(ValueError, match="topic 'elsewhere' is not subscribed by this consumer"):
        consumer.offsets_for_time("elsewhere", 0)


def test_a_closed_consumer_refuses_work(bus, topic, group):
    consumer = bus.subscribe([topic], group)
    consumer.close()
    consumer.close()  # idempotent
    for call in (lambda: consumer.poll(0.1), consumer.commit, consumer.seek_to_beginning,
                 lambda: consumer.offsets_for_time(topic, 0)):
        with pytest.raises(RuntimeError, match=f"consumer of group '{group}' is closed"):
            call()


def test_a_closed_bus_refuses_to_publish(open_test_bus, topic):
    bus = open_test_bus()
    bus.close()
    with pytest.raises(RuntimeError, match="is closed"):
        bus.publish(topic, b"x")
