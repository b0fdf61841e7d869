"""Telemetry over real gRPC: one trace across a relay hop, server metrics, and export to an OTLP collector."""

from __future__ import annotations

import hashlib
import threading
from concurrent import futures

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from servicekit import ProbeService, probe_call, rpc_error

from k3.protos.v1 import cache_pb2, cache_pb2_grpc
from k3.services.cache.service import CacheServiceConfig, build
from k3.services.common.client import make_channel
from k3.services.common.config import ServerConfig
from k3.services.common.telemetry import setup_telemetry
from k3.services.engine import tracing as engine_tracing

pytestmark = pytest.mark.timeout(60)
RELAY = "k3.test.Relay"
KEY = hashlib.blake2b(b"block", digest_size=32).digest()


class RelayService:
    """A test-only service whose one method calls the cache store twice (unary and server-streaming)."""

    name = "relay"
    service_names = (RELAY,)

    def __init__(self, cache_address: str, telemetry):
        self._channel = make_channel(cache_address, telemetry=telemetry)
        self._stub = cache_pb2_grpc.CacheStoreStub(self._channel)

    def fetch(self, request: bytes, context) -> bytes:
        self._stub.Lookup(cache_pb2.LookupRequest(keys=[KEY], kind="mla_block"))
        found = list(self._stub.GetMany(cache_pb2.GetManyRequest(keys=[KEY], kind="mla_block")))
        return str(len(found)).encode()

    def add_to_server(self, server: grpc.Server) -> None:
        handler = grpc.unary_unary_rpc_method_handler(self.fetch)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(RELAY, {"Fetch": handler}),))

    def close(self) -> None:
        self._channel.close()


def _wait_for_spans(exporter: InMemorySpanExporter, count: int):
    # Client spans end on the call's done-callback, which may run just after the caller got its answer.
    for _ in range(500):
        spans = exporter.get_finished_spans()
        if len(spans) >= count:
            return spans
        threading.Event().wait(0.01)
    raise AssertionError(f"expected {count} spans, got {[s.name for s in exporter.get_finished_spans()]}")


def test_one_trace_crosses_the_relay_hop(serve):
    exporter = InMemorySpanExporter()
    config = ServerConfig(metrics=False)
    # Separate providers per "process", one exporter to look at everything.
    cache_tel = setup_telemetry("cache", config, span_exporter=exporter)
    relay_tel = setup_telemetry("relay", config, span_exporter=exporter)
    client_tel = setup_telemetry("client", config, span_exporter=exporter)

    cache = serve(build(CacheServiceConfig()), telemetry=cache_tel)
    with make_channel(cache.address) as channel:
        block = cache_pb2.Block(key=KEY, kind="mla_block")
        cache_pb2_grpc.CacheStoreStub(channel).Put(cache_pb2.PutRequest(block=block))
    exporter.clear()  # that Put was untraced on the client side; start from a clean slate

    relay = serve(RelayService(cache.address, relay_tel), telemetry=relay_tel)
    with make_channel(relay.address, telemetry=client_tel) as channel:
        assert channel.unary_unary(f"/{RELAY}/Fetch")(b"") == b"1"
    spans = {(s.name, s.kind): s for s in _wait_for_spans(exporter, 6)}

    client = spans[(f"{RELAY}/Fetch", SpanKind.CLIENT)]
    relay_server = spans[(f"{RELAY}/Fetch", SpanKind.SERVER)]
    lookup_client = spans[("k3.v1.CacheStore/Lookup", SpanKind.CLIENT)]
    lookup_server = spans[("k3.v1.CacheStore/Lookup", SpanKind.SERVER)]
    stream_client = spans[("k3.v1.CacheStore/GetMany", SpanKind.CLIENT)]
    stream_server = spans[("k3.v1.CacheStore/GetMany", SpanKind.SERVER)]

    trace_ids = {s.context.trace_id for s in spans.values()}
    assert trace_ids == {client.context.trace_id} and len(spans) == 6
    assert client.parent is None
    assert relay_server.parent.span_id == client.context.span_id and relay_server.parent.is_remote
    for hop_client, hop_server in ((lookup_client, lookup_server), (stream_client, stream_server)):
        assert hop_client.parent.span_id == relay_server.context.span_id
        assert hop_server.parent.span_id == hop_client.context.span_id and hop_server.parent.is_remote
        assert hop_server.attributes["rpc.grpc.status_code"] == 0
    assert relay_server.resource.attributes["service.name"] == "k3-relay"
    assert lookup_server.resource.attributes["service.name"] == "k3-cache"


def test_failed_calls_mark_spans_as_errors(serve):
    exporter = InMemorySpanExporter()
    telemetry = setup_telemetry("probe", ServerConfig(metrics=False), span_exporter=exporter)
    handle = serve(ProbeService(), telemetry=telemetry)
    with make_channel(handle.address, telemetry=telemetry) as channel:
        rpc_error(lambda: probe_call(channel, "Fail", b"invalid"))
    spans = _wait_for_spans(exporter, 2)
    assert {s.kind for s in spans} == {SpanKind.CLIENT, SpanKind.SERVER}
    for span in spans:
        assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert not span.status.is_ok and span.status.description == "INVALID_ARGUMENT"


def _points(reader: InMemoryMetricReader, name: str):
    data = reader.get_metrics_data()
    for resource_metrics in data.resource_metrics:
        for scope in resource_metrics.scope_metrics:
            for metric in scope.metrics:
                if metric.name == name:
                    return {
                        tuple(sorted(p.attributes.items())): p for p in metric.data.data_points
                    }
    raise AssertionError(f"no metric {name}")


def test_server_metrics_per_method_and_status(serve):
    reader = InMemoryMetricReader()
    telemetry = setup_telemetry("probe", ServerConfig(tracing=False), metric_reader=reader)
    handle = serve(ProbeService(), telemetry=telemetry)
    with make_channel(handle.address) as channel:
        for _ in range(3):
            assert probe_call(channel, "Echo", b"x") == b"x"
        rpc_error(lambda: probe_call(channel, "Fail", b"notfound"))
        stream = channel.unary_stream("/k3.test.Probe/Stream")(b"1")
        assert list(stream) == [b"0"]

    def attrs(method: str, code: grpc.StatusCode | None = None):
        out = {"rpc.service": "k3.test.Probe", "rpc.method": method}
        if code is not None:
            out["rpc.grpc.status_code"] = code.value[0]
        return tuple(sorted(out.items()))

    requests = _points(reader, "rpc.server.requests")
    assert requests[attrs("Echo", grpc.StatusCode.OK)].value == 3
    assert requests[attrs("Fail", grpc.StatusCode.NOT_FOUND)].value == 1
    assert requests[attrs("Stream", grpc.StatusCode.OK)].value == 1
    duration = _points(reader, "rpc.server.duration")
    assert duration[attrs("Echo", grpc.StatusCode.OK)].count == 3
    assert duration[attrs("Echo", grpc.StatusCode.OK)].sum > 0
    active = _points(reader, "rpc.server.active_requests")
    assert active[attrs("Echo")].value == 0 and active[attrs("Stream")].value == 0


class _Collector(trace_service_pb2_grpc.TraceServiceServicer, metrics_service_pb2_grpc.MetricsServiceServicer):
    """A minimal OTLP/gRPC receiver keeping what it is sent."""

    def __init__(self):
        self.traces: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.metrics: list[metrics_service_pb2.ExportMetricsServiceRequest] = []

    def Export(self, request, context):
        if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
            self.traces.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()
        self.metrics.append(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()


def test_otlp_export_reaches_a_collector(serve):
    collector = _Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        # start_server builds providers from the config and flushes them when it stops.
        handle = serve(ProbeService(), otlp_endpoint=f"127.0.0.1:{port}")
        assert handle.telemetry.tracing and handle.telemetry.metrics
        with make_channel(handle.address) as channel:
            assert probe_call(channel, "Echo", b"x") == b"x"
        handle.stop(grace=0)
    finally:
        server.stop(0)
    spans = [
        (rs.resource, span)
        for request in collector.traces
        for rs in request.resource_spans
        for ss in rs.scope_spans
        for span in ss.spans
    ]
    assert [span.name for _, span in spans] == ["k3.test.Probe/Echo"]
    service_names = {a.value.string_value for a in spans[0][0].attributes if a.key == "service.name"}
    assert service_names == {"k3-probe"}
    metric_names = {
        m.name
        for request in collector.metrics
        for rm in request.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
    }
    assert {"rpc.server.requests", "rpc.server.duration", "rpc.server.active_requests"} <= metric_names


def test_telemetry_off_records_nothing():
    telemetry = setup_telemetry("x", ServerConfig(otlp_endpoint="127.0.0.1:1", tracing=False, metrics=False))
    assert not telemetry.tracing and not telemetry.metrics
    assert not telemetry.tracer().start_span("s").get_span_context().is_valid
    no_endpoint = setup_telemetry("x", ServerConfig())
    assert not no_endpoint.tracing and not no_endpoint.metrics


def test_an_engine_step_joins_the_oldest_request_and_links_the_others():
    exporter = InMemorySpanExporter()
    telemetry = setup_telemetry("decode", ServerConfig(metrics=False), span_exporter=exporter)
    tracer = telemetry.tracer()
    contexts = []
    for name in ("first", "second"):
        with tracer.start_as_current_span(name):
            contexts.append(engine_tracing.capture())  # as Engine.submit/resume do in the handler thread
    first, second = (trace.get_current_span(c).get_span_context() for c in contexts)

    def scheduler():  # another thread: nothing is current there
        assert not trace.get_current_span().get_span_context().is_valid
        with engine_tracing.step_span(tracer, "k3.engine.decode_step", [*contexts, None], {"k3.engine.batch": 2}):
            inner.append(trace.get_current_span().get_span_context())
        with engine_tracing.step_span(None, "untraced", contexts):
            inner.append(trace.get_current_span().get_span_context())
        with engine_tracing.attached(contexts[1]):
            inner.append(trace.get_current_span().get_span_context())

    inner: list = []
    thread = threading.Thread(target=scheduler)
    thread.start()
    thread.join()
    (step,) = [s for s in exporter.get_finished_spans() if s.name == "k3.engine.decode_step"]
    assert step.parent.span_id == first.span_id and step.context.trace_id == first.trace_id
    assert [link.context.span_id for link in step.links] == [second.span_id]
    assert step.attributes["k3.engine.batch"] == 2 and step.kind == SpanKind.INTERNAL
    assert inner[0].span_id == step.context.span_id
    assert inner[1].span_id == first.span_id  # no tracer: the oldest request's context, no new span
    assert inner[2].span_id == second.span_id
    with engine_tracing.step_span(tracer, "nothing", [None]):  # no request context at all: no span
        assert not trace.get_current_span().get_span_context().is_valid
