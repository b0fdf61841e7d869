"""Tracer and meter providers for one k3 process, built from its ``ServerConfig``.

Design decisions:

- No global state: ``setup_telemetry`` returns a ``Telemetry`` object that the server and its channels are
  given explicitly, so two services (or tests) in one process never share or overwrite providers. The
  OpenTelemetry *context* (the current span) is still the ambient, per-thread one, which is what lets a
  handler's outgoing calls join the trace of the request it is serving.
- Exporting is opt-in: with ``otlp_endpoint`` set, spans go through a batching OTLP/gRPC exporter and metrics
  through a periodic OTLP/gRPC reader; without it the providers are no-ops (nothing recorded, nothing
  buffered). Tests pass their own span exporter and metric reader (e.g. in-memory) instead.
- ``tracing`` / ``metrics`` set to false give no-op providers whatever the endpoint.
- ``metrics_port`` adds a Prometheus scrape endpoint (``k3.services.common.prometheus``) next to (or instead
  of) the OTLP reader; the ``Telemetry`` owns it and closes it on shutdown.
- Trace context travels in gRPC metadata in W3C ``traceparent``/``tracestate`` form only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from opentelemetry import metrics, trace
from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from k3.services.common.config import ServerConfig

if TYPE_CHECKING:
    from k3.services.common.prometheus import PrometheusEndpoint

INSTRUMENTATION_NAME = "k3"


@dataclass
class Telemetry:
    """The providers of one process (or one test). ``enabled`` flags say whether anything is recorded."""

    tracer_provider: trace.TracerProvider = field(default_factory=trace.NoOpTracerProvider)
    meter_provider: metrics.MeterProvider = field(default_factory=metrics.NoOpMeterProvider)
    tracing: bool = False
    metrics: bool = False
    propagator: TextMapPropagator = field(default_factory=TraceContextTextMapPropagator)
    #: the Prometheus scrape endpoint when ``metrics_port`` is set (its ``port`` is the bound one)
    metrics_endpoint: PrometheusEndpoint | None = None

    def tracer(self, name: str = INSTRUMENTATION_NAME) -> trace.Tracer:
        return self.tracer_provider.get_tracer(name)

    def meter(self, name: str = INSTRUMENTATION_NAME) -> metrics.Meter:
        return self.meter_provider.get_meter(name)

    def shutdown(self) -> None:
        """Flush and stop exporters (no-op providers have nothing to flush)."""
        for provider in (self.tracer_provider, self.meter_provider):
            shutdown = getattr(provider, "shutdown", None)
            if shutdown is not None:
                shutdown()
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.close()


def _insecure(endpoint: str) -> bool:
    # In-cluster collectors speak plaintext; an explicit https:// endpoint asks for TLS.
    return not endpoint.startswith("https://")


def setup_telemetry(
    service_name: str,
    config: ServerConfig,
    *,
    span_exporter: SpanExporter | None = None,
    metric_reader: MetricReader | None = None,
) -> Telemetry:
    """Providers for ``service_name`` following ``config`` (``otlp_endpoint``, ``tracing``, ``metrics``).

    ``span_exporter`` / ``metric_reader`` replace the OTLP ones (spans are then exported synchronously, so a
    test sees them as soon as the span ends).
    """
    resource = Resource.create({"service.name": f"k3-{service_name}", "service.namespace": "k3"})
    telemetry = Telemetry()
    endpoint = config.otlp_endpoint
    if config.tracing and (span_exporter is not None or endpoint):
        provider = TracerProvider(resource=resource)
        if span_exporter is not None:
            provider.add_span_processor(SimpleSpanProcessor(span_exporter))
        else:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=endpoint, insecure=_insecure(endpoint))
            provider.add_span_processor(BatchSpanProcessor(exporter))
        telemetry.tracer_provider, telemetry.tracing = provider, True
    if config.metrics and (metric_reader is not None or endpoint or config.metrics_port):
        readers: list[MetricReader] = []
        if metric_reader is not None:
            readers.append(metric_reader)
        elif endpoint:
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

            readers.append(PeriodicExportingMetricReader(
                OTLPMetricExporter(endpoint=endpoint, insecure=_insecure(endpoint))
            ))
        if config.metrics_port:
            from k3.services.common.prometheus import PrometheusEndpoint

            try:
                telemetry.metrics_endpoint = PrometheusEndpoint(config.host, config.metrics_port)
            except BaseException:
                telemetry.shutdown()  # do not leak the tracer provider built above
                raise
            readers.append(telemetry.metrics_endpoint.reader)
        telemetry.meter_provider = MeterProvider(resource=resource, metric_readers=readers)
        telemetry.metrics = True
    return telemetry
