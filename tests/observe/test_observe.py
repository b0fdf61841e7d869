"""`k3 up --observe`'s pieces against the real thing: a k3 service with a metrics port, scraped by a real
Prometheus (Debian package ``prometheus``) on loopback, queried through its HTTP API.

Without the ``prometheus`` binary these tests fail when CI is set and are skipped otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from k3.cli import main
from k3.protos.v1 import cache_pb2, cache_pb2_grpc
from k3.services.cache.service import CacheServiceConfig, build
from k3.services.cache.store import CacheStoreConfig
from k3.services.common import metric_names as mn
from k3.services.common.client import make_channel
from k3.services.common.config import ServerConfig
from k3.services.common.server import start_server
from k3.services.launcher import SERVICES, LaunchConfig
from k3.services.observe import (
    LocalPrometheus,
    ObserveConfig,
    ObserveError,
    assign_metrics_ports,
    free_port,
    observe_launch,
    prometheus_config,
)
from k3.services.planner.source import PrometheusSource, SourceError, signal_queries

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[2]


def require(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        reason = f"{binary} not found (apt-get install -y prometheus)"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; CI must run the observability tests")
        pytest.skip(reason)
    return path


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    """A cache service with a metrics port, and a Prometheus scraping it every second."""
    require("prometheus")
    tmp = tmp_path_factory.mktemp("observe")
    metrics_port = free_port("127.0.0.1")
    config = CacheServiceConfig(
        server=ServerConfig(port=0, metrics_port=metrics_port),
        store=CacheStoreConfig(memory_bytes=64 * 1024, max_value_bytes=16 * 1024, disk_dir=str(tmp / "disk")),
    )
    handle = start_server(build(config), config.server)
    prometheus = LocalPrometheus(ObserveConfig(port=0, scrape_interval_s=1.0, data_dir=str(tmp / "prometheus"),
                                               rule_files=[str(REPO / "ops/prometheus/alerts.yml")]),
                                 {"cache": f"127.0.0.1:{metrics_port}"})
    try:
        prometheus.start()
        yield handle, prometheus
    finally:
        prometheus.stop()
        handle.stop(grace=0)


def test_a_k3_metric_reaches_prometheus(observed):
    handle, prometheus = observed
    with make_channel(handle.address) as channel:
        stub = cache_pb2_grpc.CacheStoreStub(channel)
        for _ in range(4):
            stub.Stats(cache_pb2.StatsRequest())
    expr = f'{mn.RPC_REQUESTS.prometheus}{{job="k3-cache", rpc_method="Stats"}}'

    def scraped():
        result = prometheus.query(expr)
        return result if result and float(result[0]["value"][1]) >= 4 else None

    (series,) = wait_for(scraped, 60, f"{expr} >= 4 in Prometheus")
    assert series["metric"]["service"] == "cache" and series["metric"]["rpc_service"] == "k3.v1.CacheStore"
    assert float(series["value"][1]) == 4.0
    # The planner's source reads the same server: one aggregated value, or None for a metric with no data.
    source = PrometheusSource(prometheus.url)
    assert source.query(f'sum({expr})') == 4.0
    signals = source.signals(signal_queries("decode", 'job="k3-decode"'))
    assert signals.queue_length is None and signals.tokens_per_s is None and signals.ttft_p95_s is None
    with pytest.raises(SourceError, match=r"query 'sum\(' failed: HTTP 400: "):
        source.query("sum(")
    with pytest.raises(SourceError, match=r"gave \d+ series, expected one \(aggregate it\)"):
        source.query('up or vector(1)')


def test_every_dashboard_query_and_alert_parses_on_the_real_server(observed):
    _, prometheus = observed
    source = PrometheusSource(prometheus.url)
    for path in sorted((REPO / "ops/dashboards").glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel["targets"]:
                expr = target["expr"].replace("$__rate_interval", "1m").replace("$job", "k3-.*")
                prometheus.query(expr)  # raises on a query the server refuses
    for queries in (signal_queries("experts", 'job="k3-experts"'), signal_queries("decode")):
        source.signals(queries)
    # The rules file was loaded: its groups are on the server.
    with urllib.request.urlopen(f"{prometheus.url}/api/v1/rules", timeout=5) as answer:
        groups = {g["name"] for g in json.loads(answer.read())["data"]["groups"]}
    assert groups == {"k3-availability", "k3-serving", "k3-experts", "k3-rl"}


def test_generated_config_passes_promtool(observed):
    tool = require("promtool")
    _, prometheus = observed
    result = subprocess.run([tool, "check", "config", str(prometheus.config_path)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_metrics_ports_are_assigned_to_every_launched_service():
    config = LaunchConfig(services={"router": {"server": {"metrics_port": 9999}}}, preset="tiny")
    prometheus = observe_launch(config, ObserveConfig(port=0))
    launched = [name for name in SERVICES if name != "vision"]  # no vision encoder to serve: no vision service
    assert set(prometheus.targets) == set(launched)
    assert "vision" not in config.services  # a section of its own would make k3 up start it
    assert prometheus.targets["router"] == "127.0.0.1:9999"  # the user's choice is kept
    ports = [config.services[name]["server"]["metrics_port"] for name in launched]
    assert len(set(ports)) == len(ports) and all(p > 0 for p in ports)
    body = prometheus_config(prometheus.targets, 5.0)
    assert [job["job_name"] for job in body["scrape_configs"]] == [f"k3-{name}" for name in launched]
    assert body["global"]["scrape_interval"] == "5000ms"
    with pytest.raises(ValueError, match=r"decode\.server\.metrics is false; --observe needs metrics on"):
        assign_metrics_ports({"decode": {"server": {"metrics": False}}}, ["decode"], "127.0.0.1")


def test_expert_pools_get_consecutive_metrics_ports_in_one_job():
    config = LaunchConfig(preset="tiny", expert_pools=3)
    prometheus = observe_launch(config, ObserveConfig(port=0))
    base = config.services["experts"]["server"]["metrics_port"]
    assert prometheus.targets["experts"] == [f"127.0.0.1:{base + i}" for i in range(3)]  # the launcher adds i
    body = prometheus_config(prometheus.targets, 5.0)
    (job,) = [j for j in body["scrape_configs"] if j["job_name"] == "k3-experts"]
    assert job["static_configs"] == [{"targets": prometheus.targets["experts"], "labels": {"service": "experts"}}]
    kept = LaunchConfig(services={"experts": {"server": {"metrics_port": 9600}}}, preset="tiny", expert_pools=2)
    assert observe_launch(kept, ObserveConfig(port=0)).targets["experts"] == ["127.0.0.1:9600", "127.0.0.1:9601"]
    assert "experts" not in observe_launch(LaunchConfig(preset="tiny"), ObserveConfig(port=0)).targets
    with pytest.raises(ValueError, match=r"experts\.server\.metrics is false; --observe needs metrics on"):
        observe_launch(LaunchConfig(services={"experts": {"server": {"metrics": False}}}, preset="tiny",
                                    expert_pools=1), ObserveConfig(port=0))


def test_bad_observe_settings_are_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"observe\.scrape_interval_s must be >= 1 \(Prometheus' resolution\)"):
        ObserveConfig(scrape_interval_s=0.5)
    with pytest.raises(ValueError, match=r"observe\.rule_files: .*missing\.yml is not a file"):
        ObserveConfig(rule_files=[str(tmp_path / "missing.yml")])
    with pytest.raises(ObserveError, match=r"'no-such-prometheus' not found; install it"):
        LocalPrometheus(ObserveConfig(binary="no-such-prometheus"), {})


def test_up_observe_without_prometheus_fails_before_starting_anything(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty PATH: no prometheus to find
    assert main(["up", "--preset", "tiny", "--observe", "--prometheus-port", "0"]) == 2
    assert capsys.readouterr().err == ("k3: error: --observe: 'prometheus' not found; install it (Debian/Ubuntu: "
                                       "apt-get install prometheus) or give its path\n")


def test_a_prometheus_that_cannot_start_is_reported_with_its_log(tmp_path):
    require("prometheus")
    bad = tmp_path / "bad.yml"
    bad.write_text("groups: [{name: x, rules: [{alert: A, expr: 'sum('}]}]\n")
    prometheus = LocalPrometheus(ObserveConfig(port=0, rule_files=[str(bad)], data_dir=str(tmp_path / "p")), {})
    with pytest.raises(ObserveError, match=r"prometheus exited with status 1:"):
        prometheus.start()
    assert prometheus.process is None
