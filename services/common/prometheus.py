"""A Prometheus scrape endpoint (``GET /metrics``) for one process's OpenTelemetry meter provider.

Design decisions:

- The SDK's metrics reach Prometheus through ``opentelemetry-exporter-prometheus``'s pull reader: on every
  scrape it collects the meter provider and translates the points into the Prometheus text format (dots
  become underscores, the unit is appended, counters end in ``_total``; ``k3.services.common.metric_names``
  lists the resulting names).
- No global state: each endpoint has its own ``CollectorRegistry`` (not ``prometheus_client.REGISTRY``), so two
  services in one process (tests) each expose only their own metrics, and closing one frees its port.
- The HTTP server is ``prometheus_client``'s threaded WSGI server; it binds when the endpoint is created,
  so a taken port fails the service's start instead of going unnoticed. ``target_info`` (the resource) is
  exported too: Prometheus joins on it to tell services apart when they share a job.
"""

from __future__ import annotations

import logging

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from prometheus_client import CollectorRegistry, start_http_server

from k3.services.common.config import format_address

log = logging.getLogger(__name__)


class MetricsEndpointError(OSError):
    """The scrape endpoint could not listen on its address (an ``OSError``, like any failed bind)."""


class PrometheusEndpoint:
    """A metric reader to give the ``MeterProvider`` plus the HTTP server exposing what it reads."""

    def __init__(self, host: str, port: int):
        if not 0 <= port <= 65535:
            raise ValueError(f"metrics port must be in 0..65535, got {port}")
        self.registry = CollectorRegistry(auto_describe=True)
        self.reader = PrometheusMetricReader(registry=self.registry)
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise MetricsEndpointError(
                f"cannot serve metrics on {format_address(host, port)}: {exc.strerror or exc}"
            ) from None
        self.host = host
        self.port = self._server.server_address[1]
        self._closed = False
        log.info("Prometheus metrics on http://%s/metrics", format_address(host, self.port))

    @property
    def url(self) -> str:
        return f"http://{format_address(self.host, self.port)}/metrics"

    def close(self) -> None:
        """Stop serving and release the port; idempotent. The reader is shut down with its meter provider."""
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
