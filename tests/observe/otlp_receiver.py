"""An in-process OTLP/gRPC receiver for the tests (the official ``opentelemetry.proto`` collector stubs).

``OTLPReceiver.start()`` listens on a free loopback port (``endpoint``) and keeps every span it is sent, with
its resource's ``service.name``, and the names of the metrics each service exported. A plainly named module
(not ``conftest``) so that test files import it explicitly.
"""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2


class OTLPReceiver(trace_service_pb2_grpc.TraceServiceServicer, metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, host: str = "127.0.0.1"):
        self._lock = threading.Lock()
        self._host = host
        self._server: grpc.Server | None = None
        self.endpoint = ""
        self.spans: list[tuple[str, trace_pb2.Span]] = []
        self.metric_names: dict[str, set[str]] = {}

    def start(self) -> OTLPReceiver:
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(self, self._server)
        port = self._server.add_insecure_port(f"{self._host}:0")
        self._server.start()
        self.endpoint = f"{self._host}:{port}"
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=5).wait()

    def Export(self, request, context):
        if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
            with self._lock:
                for resource_spans in request.resource_spans:
                    service = service_name(resource_spans.resource)
                    for scope in resource_spans.scope_spans:
                        self.spans.extend((service, span) for span in scope.spans)
            return trace_service_pb2.ExportTraceServiceResponse()
        with self._lock:
            for resource_metrics in request.resource_metrics:
                names = self.metric_names.setdefault(service_name(resource_metrics.resource), set())
                names.update(m.name for scope in resource_metrics.scope_metrics for m in scope.metrics)
        return metrics_service_pb2.ExportMetricsServiceResponse()


def service_name(resource) -> str:
    return next((a.value.string_value for a in resource.attributes if a.key == "service.name"), "")
