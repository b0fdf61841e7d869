"""k3's event bus: durable, ordered, replayable topics with consumer groups (at-least-once delivery).

One interface (``EventBus``/``Consumer`` in ``api``) with two backends chosen by URL (``open_bus``):

- ``embedded:///dir`` — an append-only on-disk log with one partition per topic, safe for several
  processes on one machine; the default when k3 runs on a single machine.
- ``kafka://host:port`` — Apache Kafka, for clusters.

Both pass the same contract test suite, so code written against one runs on the other. Topics used by the
platform: ``k3.trajectories``, ``k3.weights``, ``k3.jobs``, ``k3.cache.events``.
"""

from k3.services.bus.api import (
    BusUnavailable,
    Consumer,
    EventBus,
    Record,
    validate_group,
    validate_topic,
)
from k3.services.bus.embedded import EmbeddedBus, EmbeddedConfig
from k3.services.bus.url import open_bus

_KAFKA_NAMES = ("KafkaBus", "KafkaConfig")


def __getattr__(name: str):
    # The Kafka backend is loaded on first use: importing kafka-python costs about a second.
    if name in _KAFKA_NAMES:
        from k3.services.bus import kafka_bus

        return getattr(kafka_bus, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "BusUnavailable",
    "Consumer",
    "EmbeddedBus",
    "EmbeddedConfig",
    "EventBus",
    "KafkaBus",
    "KafkaConfig",
    "Record",
    "open_bus",
    "validate_group",
    "validate_topic",
]
