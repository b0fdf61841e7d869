"""The planner service around the decisions: its config, queries, Kubernetes patch body, and `k3 serve planner`."""

from __future__ import annotations

import socket

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from k3.cli import main
from k3.services.common import metric_names as mn
from k3.services.common.config import ConfigError, ServerConfig, load_config
from k3.services.common.server import start_server
from k3.services.planner.kube import MERGE_PATCH, DeploymentScaler, KubeError, api_client, scale_body
from k3.services.planner.service import Planner, PlannerConfig, PlannerServiceConfig, build
from k3.services.planner.source import PrometheusSource, SourceError, signal_queries
from k3.services.registry import get_spec

pytestmark = pytest.mark.timeout(60)

TARGETS = [
    {"deployment": "k3-experts-0", "kind": "experts", "selector": 'job="k3-experts-0"',
     "policy": {"max_replicas": 4, "target_tokens_per_s": 5000}},
    {"deployment": "k3-decode", "kind": "decode", "selector": 'job="k3-decode"',
     "policy": {"target_queue_length": 8, "target_ttft_p95_s": 1.5}},
]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


def write_config(tmp_path, planner: dict):
    path = tmp_path / "planner.yaml"
    path.write_text(yaml.safe_dump({"server": {"port": 0}, "planner": planner}))
    return path


def kubeconfig_to(tmp_path, port: int):
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "local",
        "clusters": [{"name": "local", "cluster": {"server": f"https://127.0.0.1:{port}",
                                                    "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": "u"}}],
    }))
    return path


def test_scale_body_is_a_merge_patch_of_spec_replicas():
    assert scale_body(3) == {"spec": {"replicas": 3}}
    assert scale_body(0) == {"spec": {"replicas": 0}}
    assert MERGE_PATCH == "application/merge-patch+json"
    for bad in (-1, 2.0, True, "3"):
        with pytest.raises(ValueError, match=r"replicas must be an int >= 0, got "):
            scale_body(bad)


def test_planner_is_registered_and_its_config_file_loads(tmp_path):
    spec = get_spec("planner")
    assert spec.config_type is PlannerServiceConfig
    config = load_config(PlannerServiceConfig, write_config(tmp_path, {"targets": TARGETS, "dry_run": False}),
                         env={})
    experts, decode = config.planner.targets
    assert (experts.kind, experts.policy.max_replicas, experts.policy.target_tokens_per_s) == ("experts", 4, 5000.0)
    assert decode.policy.target_ttft_p95_s == 1.5 and decode.policy.min_replicas == 1
    assert config.planner.dry_run is False and PlannerConfig().dry_run is True  # dry run unless turned off


@pytest.mark.parametrize("change, field, message", [
    ({"kind": "prefill"}, "planner.targets[0].kind", "must be one of experts, decode, got 'prefill'"),
    ({"policy": {"target_tokens_per_s": 1, "min_replicas": 0}}, "planner.targets[0].policy.min_replicas",
     "must be >= 1, got 0"),
    ({"policy": {"target_queue_length": 4}}, "planner.targets[0].policy",
     "needs at least one of target_tokens_per_s for kind experts"),
    ({"selector": "job=k3"}, "planner.targets[0].selector",
     "must be PromQL label matchers like job=\"k3-decode\", got 'job=k3'"),
    ({"replicas": 3}, "planner.targets[0].replicas", "unknown key (known: deployment, kind, policy, selector)"),
    ({"deployment": ""}, "planner.targets[0].deployment", "is required"),
    ({"deployment": "k3-decode"}, "planner.targets[1].deployment", "deployment 'k3-decode' is listed twice"),
])
def test_bad_targets_are_rejected_naming_the_field_and_file(tmp_path, change, field, message):
    targets = [dict(TARGETS[0], **change), TARGETS[1]]
    path = write_config(tmp_path, {"targets": targets})
    with pytest.raises(ConfigError) as info:
        load_config(PlannerServiceConfig, path, env={})
    assert (info.value.field, info.value.reason, info.value.source) == (field, message, str(path))


def test_bad_planner_settings_are_rejected(tmp_path):
    for planner, field, message in [
        ({"rate_window": "1 minute"}, "planner.rate_window",
         "window must be a PromQL duration like 30s, 1m or 1h, got '1 minute'"),
        ({"prometheus_url": "prometheus:9090"}, "planner.prometheus_url",
         "prometheus_url must be an http(s)://host:port URL, got 'prometheus:9090'"),
        ({"interval_s": 0}, "planner.interval_s", "must be > 0, got 0.0"),
        ({"targets": ["k3-decode"]}, "planner.targets[0]", "must be a mapping (section), got str"),
    ]:
        with pytest.raises(ConfigError) as info:
            load_config(PlannerServiceConfig, write_config(tmp_path, planner), env={})
        assert (info.value.field, info.value.reason) == (field, message)


def test_signal_queries_name_catalogue_metrics():
    experts = signal_queries("experts", 'job="k3-experts-0"', "2m")
    assert experts == {
        "tokens_per_s": 'sum(rate(k3_experts_pool_rows_total{job="k3-experts-0"}[2m]))',
        "imbalance": 'max(k3_experts_pool_imbalance{job="k3-experts-0"})',
    }
    decode = signal_queries("decode")
    assert decode["tokens_per_s"] == 'sum(rate(k3_engine_tokens_total{phase="decode"}[1m]))'
    assert decode["queue_length"] == "sum(k3_engine_queued)"
    assert f"{mn.TTFT.prometheus}_bucket" in decode["ttft_p95_s"]
    with pytest.raises(ValueError, match=r"kind must be one of experts, decode, got 'router'"):
        signal_queries("router")
    with pytest.raises(ValueError, match=r"window must be a PromQL duration like 30s, 1m or 1h, got '5'"):
        signal_queries("decode", "", "5")


def test_unreachable_prometheus_and_api_server_skip_the_round(tmp_path):
    """Real client errors (connection refused) become SourceError/KubeError; the round goes on."""
    config = load_config(PlannerConfig, env={}, overrides={"targets": TARGETS, "query_timeout_s": 2.0})
    scaler = DeploymentScaler(api_client(str(kubeconfig_to(tmp_path, closed_port()))), "k3", timeout_s=2.0)
    scaler._api_client.configuration.retries = 0  # fail on the first refused connection
    source = PrometheusSource(f"http://127.0.0.1:{closed_port()}", timeout_s=2.0)
    try:
        with pytest.raises(KubeError, match=r"reading the scale of deployment k3-decode in namespace k3: "):
            scaler.replicas("k3-decode")
        with pytest.raises(SourceError, match=r"cannot query http://127\.0\.0\.1:\d+: "):
            source.query("up")
        results = Planner(config, scaler, source).run_once()
        assert sorted(results) == ["k3-decode", "k3-experts-0"]
        assert all(isinstance(r, KubeError) for r in results.values())
    finally:
        scaler.close()


def test_serve_planner_without_targets_serves_health_and_stops(tmp_path):
    config = load_config(PlannerServiceConfig, write_config(tmp_path, {"interval_s": 0.2}), env={})
    service = build(config)
    handle = start_server(service, ServerConfig(port=0))
    try:
        with grpc.insecure_channel(handle.address) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        assert service.planner.run_once() == {}
    finally:
        handle.stop(grace=0)
    assert not service.planner._thread.is_alive()


def test_serve_planner_cli_reports_an_unusable_kubeconfig(tmp_path, capsys):
    missing = tmp_path / "nope" / "kubeconfig"
    path = write_config(tmp_path, {"targets": TARGETS, "kubeconfig": str(missing)})
    assert main(["serve", "planner", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"k3: error: cannot start planner: cannot configure the Kubernetes client from "
                          f"kubeconfig {missing}: ")

