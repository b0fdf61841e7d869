"""Fixtures of the event bus tests: the contract suite runs every test once per backend."""

import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from k3.services.bus import EventBus, Record, open_bus


@pytest.fixture(params=["embedded", pytest.param("kafka", marks=pytest.mark.kafka)])
def backend(request) -> str:
    return request.param


@pytest.fixture
def bus_url(request, backend, tmp_path) -> str:
    if backend == "embedded":
        return f"embedded://{tmp_path / 'bus'}"
    return f"kafka://{request.getfixturevalue('kafka_bootstrap')}"


@pytest.fixture
def open_test_bus(bus_url) -> Iterator[Callable[[], EventBus]]:
    """Opens buses on the backend under test (a second one plays another process); all closed at the end."""
    buses: list[EventBus] = []

    def factory() -> EventBus:
        bus = open_bus(bus_url)
        buses.append(bus)
        return bus

    yield factory
    for bus in buses:
        bus.close()


@pytest.fixture
def bus(open_test_bus) -> EventBus:
    return open_test_bus()


@pytest.fixture
def topic() -> str:
    return f"test-{uuid.uuid4().hex}"


@pytest.fixture
def group() -> str:
    return f"group-{uuid.uuid4().hex}"


def drain(consumer, count: int, timeout_s: float = 60.0, max_records: int = 500) -> list[Record]:
    """Polls until ``count`` records arrived or ``timeout_s`` passed; returns what arrived."""
    records: list[Record] = []
    deadline = time.monotonic() + timeout_s
    while len(records) < count and time.monotonic() < deadline:
        records += consumer.poll(timeout_s=1.0, max_records=min(max_records, count - len(records)))
    return records


@pytest.fixture(name="drain")
def drain_fixture() -> Callable[..., list[Record]]:
    return drain
