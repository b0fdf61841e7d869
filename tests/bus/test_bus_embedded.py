"""Embedded log specifics: crash recovery, durability across reopen, processes sharing a directory."""

import json
import logging
import multiprocessing
import os

import pytest

from k3.services.bus import EmbeddedBus, EmbeddedConfig, open_bus
from k3.services.bus.segment import FILE_HEADER, SegmentCorrupt

pytestmark = pytest.mark.timeout(120)


def segment_path(directory, topic):
    return directory / "topics" / f"{topic}.log"


def drain(consumer, count, rounds=50):
    records = []
    for _ in range(rounds):
        if len(records) >= count:
            break
        records += consumer.poll(timeout_s=0.2, max_records=count - len(records))
    return records


def publish_values(directory, topic, values):
    with EmbeddedBus(directory) as bus:
        for value in values:
            bus.publish(topic, value)


def test_torn_tail_is_dropped_on_reopen_and_later_appends_follow_the_intact_records(tmp_path, caplog):
    publish_values(tmp_path, "t", [b"zero", b"one", b"two-" * 10])
    path = segment_path(tmp_path, "t")
    size = path.stat().st_size
    os.truncate(path, size - 7)  # a crash in the middle of writing the last record

    with caplog.at_level(logging.WARNING, logger="k3.services.bus.embedded"), EmbeddedBus(tmp_path) as bus:
        consumer = bus.subscribe(["t"], "g")
        records = drain(consumer, 2)
        assert [(r.offset, r.value) for r in records] == [(0, b"zero"), (1, b"one")]
        assert consumer.poll(timeout_s=0.2) == []
        assert "dropping a torn tail of" in caplog.text
        bus.publish("t", b"two again")
        assert [(r.offset, r.value) for r in drain(consumer, 1)] == [(2, b"two again")]

    with EmbeddedBus(tmp_path) as bus:
        assert [r.value for r in drain(bus.subscribe(["t"], "fresh"), 3)] == [b"zero", b"one", b"two again"]


def test_a_record_with_a_bad_checksum_at_the_tail_is_dropped(tmp_path):
    publish_values(tmp_path, "t", [b"good", b"flipped"])
    path = segment_path(tmp_path, "t")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # the last byte of the last value
    path.write_bytes(bytes(data))

    with EmbeddedBus(tmp_path) as bus:
        consumer = bus.subscribe(["t"], "g")
        assert [r.value for r in drain(consumer, 1)] == [b"good"]
        assert consumer.poll(timeout_s=0.2) == []
    assert path.stat().st_size < len(data)


def test_a_reader_never_delivers_a_tail_that_is_still_torn(tmp_path):
    with EmbeddedBus(tmp_path) as bus:
        bus.publish("t", b"whole")
        consumer = bus.subscribe(["t"], "g")
        assert [r.value for r in drain(consumer, 1)] == [b"whole"]
        with open(segment_path(tmp_path, "t"), "ab") as f:  # half a frame from a writer that died
            f.write(b"\x00\x00\x01\x00\xde\xad")
        assert consumer.poll(timeout_s=0.2) == []
        bus.publish("t", b"next")  # the next append cuts the torn bytes first
        assert [(r.offset, r.value) for r in drain(consumer, 1)] == [(1, b"next")]


def test_uncommitted_records_survive_closing_and_reopening_the_log(tmp_path):
    publish_values(tmp_path, "jobs", [b"a", b"b", b"c"])
    bus = open_bus(f"embedded://{tmp_path}")
    consumer = bus.subscribe(["jobs"], "g")
    assert [r.value for r in consumer.poll(timeout_s=1, max_records=1)] == [b"a"]
    consumer.commit()
    assert [r.value for r in drain(consumer, 2)] == [b"b", b"c"]  # read, not committed
    bus.close()  # as if the process stopped

    with EmbeddedBus(tmp_path) as bus:
        assert [(r.offset, r.value) for r in drain(bus.subscribe(["jobs"], "g"), 2)] == [(1, b"b"), (2, b"c")]


def test_committed_offsets_are_a_readable_json_file_written_atomically(tmp_path):
    with EmbeddedBus(tmp_path) as bus:
        bus.publish("t", b"x")
        consumer = bus.subscribe(["t"], "group with spaces/and slashes")
        drain(consumer, 1)
        consumer.commit()
    files = list((tmp_path / "groups").glob("*/offsets.json"))
    assert len(files) == 1
    assert json.loads(files[0].read_text()) == {"group": "group with spaces/and slashes", "offsets": {"t": 1}}
    assert not list((tmp_path / "groups").glob("*/.offsets-*"))  # no temporary file left behind


def test_a_corrupt_offsets_file_is_reported_not_ignored(tmp_path):
    with EmbeddedBus(tmp_path) as bus:
        bus.publish("t", b"x")
        consumer = bus.subscribe(["t"], "g")
        drain(consumer, 1)
        consumer.commit()
        consumer.close()
        (path,) = (tmp_path / "groups").glob("*/offsets.json")
        path.write_text("{not json")
        with pytest.raises(ValueError, match="committed offsets file .* is not valid JSON"):
            bus.subscribe(["t"], "g").poll(timeout_s=0)


def test_only_one_consumer_of_a_group_owns_a_topic_until_it_closes(tmp_path):
    with EmbeddedBus(tmp_path) as bus:
        for i in range(4):
            bus.publish("t", b"%d" % i)
        owner = bus.subscribe(["t"], "g")
        standby = bus.subscribe(["t"], "g")
        assert [r.value for r in drain(owner, 4)] == [b"0", b"1", b"2", b"3"]
        assert standby.owned_topics() == []
        assert standby.poll(timeout_s=0.1) == []
        owner.seek("t", 0, 2)
        owner.commit()
        owner.close()
        assert standby.owned_topics() == ["t"]
        assert [r.value for r in drain(standby, 2)] == [b"2", b"3"]


def test_a_file_that_is_not_a_segment_is_refused(tmp_path):
    (tmp_path / "topics").mkdir()
    segment_path(tmp_path, "t").write_bytes(b"PK\x03\x04 some zip file")
    with EmbeddedBus(tmp_path) as bus, pytest.raises(SegmentCorrupt, match=r"t\.log is not an event log segment"):
        bus.publish("t", b"x")


def test_segment_starts_with_its_header(tmp_path):
    publish_values(tmp_path, "t", [b"x"])
    assert segment_path(tmp_path, "t").read_bytes().startswith(FILE_HEADER)


def test_records_above_the_size_limit_are_rejected(tmp_path):
    with EmbeddedBus(tmp_path, EmbeddedConfig(max_record_bytes=10)) as bus:
        bus.publish("t", b"x" * 6, key=b"k" * 4)
        with pytest.raises(ValueError, match=r"record of 11 bytes \(key \+ value\) exceeds max_record_bytes=10"):
            bus.publish("t", b"x" * 7, key=b"k" * 4)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_record_bytes", 0, "max_record_bytes must be >= 1, got 0"),
        ("poll_interval_s", 0, "poll_interval_s must be > 0, got 0"),
    ],
)
def test_bad_config_is_rejected(field, value, message):
    with pytest.raises(ValueError, match=message):
        EmbeddedConfig(**{field: value})


def _publisher(directory: str, name: str, count: int) -> None:
    with EmbeddedBus(directory, EmbeddedConfig(fsync=False)) as bus:
        for i in range(count):
            bus.publish("shared", f"{name}:{i}".encode(), key=name.encode())


def test_processes_appending_to_one_topic_interleave_whole_records(tmp_path):
    count = 150
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_publisher, args=(str(tmp_path), name, count)) for name in ("a", "b")]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=90)
        assert worker.exitcode == 0

    with EmbeddedBus(tmp_path) as bus:
        records = drain(bus.subscribe(["shared"], "g"), 2 * count)
    assert [r.offset for r in records] == list(range(2 * count))
    for name in ("a", "b"):
        mine = [r.value.decode() for r in records if r.key == name.encode()]
        assert mine == [f"{name}:{i}" for i in range(count)]
