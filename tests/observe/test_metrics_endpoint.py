"""The per-process Prometheus endpoint and the metric catalogue, through the real exporter and a real service."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from opentelemetry.metrics import Observation
from opentelemetry.sdk.metrics import MeterProvider
from prometheus_client.parser import text_string_to_metric_families

from k3.protos.v1 import cache_pb2, cache_pb2_grpc
from k3.services.cache.service import CacheService, CacheServiceConfig, build
from k3.services.cache.store import CacheStoreConfig, TieredStore
from k3.services.common import metric_names as mn
from k3.services.common.client import make_channel
from k3.services.common.config import ConfigError, ServerConfig, load_config
from k3.services.common.prometheus import MetricsEndpointError, PrometheusEndpoint
from k3.services.common.server import BindError, start_server
from k3.services.common.telemetry import setup_telemetry

pytestmark = pytest.mark.timeout(60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url: str) -> dict[str, list]:
    """Sample name -> samples of one scrape."""
    with urllib.request.urlopen(url, timeout=5) as answer:
        text = answer.read().decode()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def test_every_catalogue_entry_is_exported_under_its_prometheus_name():
    endpoint = PrometheusEndpoint("127.0.0.1", 0)
    provider = MeterProvider(metric_readers=[endpoint.reader])
    try:
        meter = provider.get_meter("k3")
        entries = list(mn.catalogue())
        for metric in entries:
            if metric.kind is mn.Kind.GAUGE:
                metric.instrument(meter, callbacks=[lambda options: [Observation(2.0)]])
            elif metric.kind is mn.Kind.HISTOGRAM:
                metric.instrument(meter).record(0.5)
            else:
                metric.instrument(meter).add(3)
        samples = scrape(endpoint.url)
        for metric in entries:
            for series in metric.series:
                assert series in samples, f"{metric.name}: {series} not exported ({sorted(samples)})"
        # The histogram advice is honoured: the buckets are the catalogue's, not the SDK's millisecond ones.
        les = {float(s.labels["le"]) for s in samples[f"{mn.TTFT.prometheus}_bucket"]}
        assert les == {*mn.LATENCY_BUCKETS, float("inf")}
    finally:
        provider.shutdown()
        endpoint.close()


def test_catalogue_names_are_unique_and_checked():
    names = [m.name for m in mn.catalogue()]
    assert len(names) == len(set(names)) and len(names) >= 20
    assert len(mn.by_prometheus_name()) == sum(len(m.series) for m in mn.catalogue())
    with pytest.raises(ValueError, match=r"unit of k3\.x\.y: 'ms' is not s, By, 1 or a \{annotation\}"):
        mn.MetricName("k3.x.y", mn.Kind.GAUGE, "ms", "d", "router")
    with pytest.raises(ValueError, match=r"buckets of k3\.x\.y: histograms need them"):
        mn.MetricName("k3.x.y", mn.Kind.HISTOGRAM, "s", "d", "router")
    with pytest.raises(ValueError, match=r"name: 'K3-x' is not a dotted lower-case name"):
        mn.MetricName("K3-x", mn.Kind.GAUGE, "1", "d", "router")


def cache_config(metrics_port: int, disk_dir) -> CacheServiceConfig:
    store = CacheStoreConfig(memory_bytes=64 * 1024, max_value_bytes=16 * 1024, disk_dir=str(disk_dir))
    return CacheServiceConfig(server=ServerConfig(port=0, metrics_port=metrics_port), store=store)


@pytest.fixture
def cache_with_metrics(tmp_path):
    port = free_port()
    config = cache_config(port, tmp_path / "disk")
    handle = start_server(build(config), config.server)
    try:
        yield handle, port
    finally:
        handle.stop(grace=0)


def test_a_service_serves_its_rpc_metrics_on_its_metrics_port(cache_with_metrics):
    handle, port = cache_with_metrics
    assert handle.telemetry.metrics_endpoint.port == port
    with make_channel(handle.address) as channel:
        stub = cache_pb2_grpc.CacheStoreStub(channel)
        for _ in range(3):
            stub.Stats(cache_pb2.StatsRequest())
    samples = scrape(f"http://127.0.0.1:{port}/metrics")
    stats = [s for s in samples[mn.RPC_REQUESTS.prometheus] if s.labels["rpc_method"] == "Stats"]
    assert [(s.labels["rpc_service"], s.labels["rpc_grpc_status_code"], s.value) for s in stats] == [
        ("k3.v1.CacheStore", "0", 3.0)]
    assert f"{mn.RPC_DURATION.prometheus}_count" in samples
    handle.stop(grace=0)
    with pytest.raises(OSError):  # the port is released with the server
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_a_taken_metrics_port_fails_the_start_with_a_bind_error(cache_with_metrics, tmp_path):
    _, port = cache_with_metrics
    config = cache_config(port, tmp_path / "d2")
    # The cache builds its own telemetry (its lookups record hit metrics), so the port fails its build...
    with pytest.raises(MetricsEndpointError, match=rf"cannot serve metrics on 127\.0\.0\.1:{port}: "):
        build(config)
    # ...and a service that leaves telemetry to the server fails the server's start with a bind error.
    service = CacheService(TieredStore(config.store))
    with pytest.raises(BindError, match=rf"cannot serve metrics on 127\.0\.0\.1:{port}: "):
        start_server(service, config.server)
    with pytest.raises(MetricsEndpointError, match=rf"cannot serve metrics on 127\.0\.0\.1:{port}"):
        setup_telemetry("x", ServerConfig(metrics_port=port))


def test_metrics_port_config_is_validated():
    with pytest.raises(ConfigError) as info:
        load_config(ServerConfig, env={"K3_METRICS_PORT": "1"}, overrides={"metrics_port": 70000})
    assert info.value.field == "metrics_port" and info.value.reason == "must be in 0..65535, got 70000"
    with pytest.raises(ConfigError) as info:
        ServerConfig(metrics_port=9464, metrics=False)
    assert info.value.field == "metrics_port"
    assert info.value.reason == "needs metrics: true (nothing would be recorded to serve)"
    assert load_config(CacheServiceConfig, env={"K3_SERVER_METRICS_PORT": "9464"}).server.metrics_port == 9464
    assert setup_telemetry("x", ServerConfig()).metrics_endpoint is None  # 0 = off
