"""Bus URLs: which backend a URL opens, and precise errors for malformed ones."""

import re

import pytest

from k3.services.bus import EmbeddedBus, open_bus
from k3.services.bus.url import parse_kafka_servers


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("/var/lib/k3/bus", "bus URL '/var/lib/k3/bus' has no scheme; expected 'embedded:///path/to/dir' or"),
        ("redis://localhost:6379", "bus URL 'redis://localhost:6379' has unknown scheme 'redis'"),
        ("embedded://", "bus URL 'embedded://' needs a directory path, e.g. embedded:///var/lib/k3/bus"),
        ("embedded:///", "bus URL 'embedded:///' needs a directory path"),
        ("embedded://host/dir", "bus URL 'embedded://host/dir' names a host 'host'; an embedded bus is a local"),
        ("embedded:///dir?fsync=0", "bus URL 'embedded:///dir?fsync=0' must not have a query or fragment"),
        ("kafka://", "bus URL 'kafka://' must be kafka://host:port[,host:port] with nothing after the servers"),
        ("kafka://h:9092/topic", "bus URL 'kafka://h:9092/topic' must be kafka://host:port"),
        ("kafka://broker", "bus URL 'kafka://broker': bootstrap server 'broker' must be host:port"),
        ("kafka://a:1,:2", "bootstrap server ':2' must be host:port"),
        ("kafka://h:x", "bus URL 'kafka://h:x': port 'x' of 'h:x' must be a number in 1..65535"),
        ("kafka://h:70000", "port '70000' of 'h:70000' must be a number in 1..65535"),
        (None, "bus URL None has no scheme"),
    ],
)
def test_bad_urls_are_rejected_with_the_reason(url, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        open_bus(url)


def test_embedded_url_opens_the_directory(tmp_path):
    with open_bus(f"embedded://{tmp_path}/nested/bus") as bus:
        assert isinstance(bus, EmbeddedBus)
        bus.publish("t", b"x")
    assert (tmp_path / "nested" / "bus" / "topics" / "t.log").is_file()


def test_kafka_servers_are_split_and_normalised():
    assert parse_kafka_servers("u", "a:9092, b.example:19092,10.0.0.1:0019092") == [
        "a:9092",
        "b.example:19092",
        "10.0.0.1:19092",
    ]
