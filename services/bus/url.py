"""Bus URLs: how configuration names a bus, and ``open_bus`` which turns one into a backend.

- ``embedded:///absolute/path`` — the on-disk log in that directory (created if missing).
- ``kafka://host:port[,host:port...]`` — a Kafka cluster, by its bootstrap servers.

URLs are checked strictly (scheme, host part, path, ports) so a typo fails at start-up with a message that
names the URL, rather than as a connection error later.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from k3.services.bus.embedded import EmbeddedBus, EmbeddedConfig

if TYPE_CHECKING:
    from k3.services.bus.kafka_bus import KafkaBus, KafkaConfig

_EXPECTED = "expected 'embedded:///path/to/dir' or 'kafka://host:port[,host:port]'"


def parse_kafka_servers(url: str, servers: str) -> list[str]:
    result = []
    for server in servers.split(","):
        host, sep, port = server.strip().rpartition(":")
        if not sep or not host or not port:
            raise ValueError(f"bus URL {url!r}: bootstrap server {server!r} must be host:port")
        if not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"bus URL {url!r}: port {port!r} of {server!r} must be a number in 1..65535")
        result.append(f"{host}:{int(port)}")
    return result


def open_bus(
    url: str, *, embedded: EmbeddedConfig | None = None, kafka: KafkaConfig | None = None
) -> EmbeddedBus | KafkaBus:
    """Opens the bus named by ``url``; ``embedded``/``kafka`` tune the respective backend."""
    if not isinstance(url, str) or "://" not in url:
        raise ValueError(f"bus URL {url!r} has no scheme; {_EXPECTED}")
    scheme, rest = url.split("://", 1)
    if scheme == "embedded":
        parts = urlsplit(url)
        if parts.netloc:
            raise ValueError(
                f"bus URL {url!r} names a host {parts.netloc!r}; an embedded bus is a local directory, "
                "written embedded:///absolute/path (three slashes)"
            )
        if parts.query or parts.fragment:
            raise ValueError(f"bus URL {url!r} must not have a query or fragment")
        if not parts.path or parts.path == "/":
            raise ValueError(f"bus URL {url!r} needs a directory path, e.g. embedded:///var/lib/k3/bus")
        return EmbeddedBus(parts.path, embedded)
    if scheme == "kafka":
        if not rest or "/" in rest.rstrip("/") or "?" in rest or "#" in rest:
            raise ValueError(f"bus URL {url!r} must be kafka://host:port[,host:port] with nothing after the servers")
        servers = parse_kafka_servers(url, rest.rstrip("/"))
        # Imported here: kafka-python takes about a second to import, which embedded users never need.
        from k3.services.bus.kafka_bus import KafkaBus

        return KafkaBus(servers, kafka)
    raise ValueError(f"bus URL {url!r} has unknown scheme {scheme!r}; {_EXPECTED}")
