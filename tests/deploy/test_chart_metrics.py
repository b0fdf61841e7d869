"""The chart's metrics wiring against what the services export and what the cluster Prometheus scrapes.

Every container serves ``/metrics`` on the port named ``metrics`` (``server.metrics_port`` in its config),
which ops/prometheus/prometheus.yml keeps pods by; a NetworkPolicy opens that port (only) to the scraper;
the HPA metrics the prometheus-adapter rules publish come from series the services really export (the metric
catalogue) and map pods through the labels that Prometheus config attaches.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from k3.services.common import metric_names as mn

REPO_PROMETHEUS = Path(__file__).resolve().parents[2] / "ops" / "prometheus" / "prometheus.yml"


def test_every_container_serves_metrics_on_the_port_prometheus_keeps(render):
    rendered = render("multi-node", "planner.enabled=true")
    deployments = rendered.of_kind("Deployment")
    assert len(deployments) >= 8
    for deployment in deployments:
        name = deployment["metadata"]["name"]
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["metrics"] == 9464, name
        config = yaml.safe_load(rendered.get("ConfigMap", name)["data"]["config.yaml"])
        assert config["server"]["metrics_port"] == 9464, name
    scrape = yaml.safe_load(REPO_PROMETHEUS.read_text())["scrape_configs"][0]
    keep = [r for r in scrape["relabel_configs"] if r.get("source_labels") == ["__meta_kubernetes_pod_container_port_name"]]
    assert keep == [{"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": "metrics",
                     "action": "keep"}]


def test_the_metrics_port_is_open_to_the_scraper_only(render):
    policy = render("multi-node").get("NetworkPolicy", "k3-metrics")
    assert policy["spec"]["ingress"] == [{"ports": [{"port": "metrics", "protocol": "TCP"}]}]
    scoped = render("multi-node", "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.team=obs")
    (rule,) = scoped.get("NetworkPolicy", "k3-metrics")["spec"]["ingress"]
    assert rule["from"] == [{"namespaceSelector": {"matchLabels": {"team": "obs"}}}]


def test_metrics_port_zero_serves_none(render):
    rendered = render("multi-node", "telemetry.metricsPort=0")
    assert "k3-metrics" not in rendered.names("NetworkPolicy")
    for deployment in rendered.of_kind("Deployment"):
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert [p["name"] for p in container["ports"]] == ["grpc"]
        config = yaml.safe_load(rendered.get("ConfigMap", deployment["metadata"]["name"])["data"]["config.yaml"])
        assert "metrics_port" not in config["server"]


def test_adapter_rules_read_exported_series_through_the_scraped_pod_labels(render):
    rules = yaml.safe_load(render("multi-node").get("ConfigMap", "k3-metrics-adapter-rules")["data"]["config.yaml"])
    series = {rule["name"]["as"]: rule for rule in rules["rules"]}
    assert series["k3_decode_queue_length"]["name"]["matches"] == f"^{mn.ENGINE_QUEUED.prometheus}$"
    assert series["k3_expert_pool_load"]["name"]["matches"] == f"^{mn.EXPERT_POOL_LOAD.prometheus}$"
    assert mn.ENGINE_QUEUED.emitted and "decode" in mn.ENGINE_QUEUED.service
    assert mn.EXPERT_POOL_LOAD.emitted and mn.EXPERT_POOL_LOAD.service == "experts"
    relabels = yaml.safe_load(REPO_PROMETHEUS.read_text())["scrape_configs"][0]["relabel_configs"]
    targets = {r["target_label"]: r["source_labels"] for r in relabels if "target_label" in r}
    assert targets["namespace"] == ["__meta_kubernetes_namespace"] and targets["pod"] == ["__meta_kubernetes_pod_name"]
    for rule in series.values():
        assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
        assert rule["seriesQuery"].endswith('{namespace!="",pod!=""}')
    collector = render("multi-node", "metricsAdapter.namespaceLabel=k8s_namespace_name",
                       "metricsAdapter.podLabel=k8s_pod_name")
    rules = yaml.safe_load(collector.get("ConfigMap", "k3-metrics-adapter-rules")["data"]["config.yaml"])
    assert rules["rules"][0]["resources"]["overrides"] == {"k8s_namespace_name": {"resource": "namespace"},
                                                           "k8s_pod_name": {"resource": "pod"}}
