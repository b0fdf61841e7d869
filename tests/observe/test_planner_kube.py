"""The planner's Kubernetes calls against a real kube-apiserver (with etcd) on 127.0.0.1.

The binaries come from ops/tools (etcd.sh, kube-apiserver.sh) and are only looked up here; when they are
missing the test fails if CI is set and is skipped otherwise.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from k3.services.common import metric_names as mn
from k3.services.common.config import ServerConfig, load_config
from k3.services.common.telemetry import setup_telemetry
from k3.services.observe import LocalPrometheus, ObserveConfig, free_port
from k3.services.planner.kube import DeploymentScaler, KubeError, api_client
from k3.services.planner.service import Planner, PlannerConfig
from k3.services.planner.source import PrometheusSource

pytestmark = pytest.mark.timeout(300)

TOOLS = Path(__file__).resolve().parents[2] / "ops" / "tools"


def local_apiserver():
    name = "local_apiserver"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="module")
def kubeconfig(tmp_path_factory):
    try:
        plane = local_apiserver().LocalControlPlane(tmp_path_factory.mktemp("apiserver"))
    except FileNotFoundError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"{exc}; CI must run the planner's API server test")
        pytest.skip(str(exc))
    plane.start()
    try:
        yield str(plane.kubeconfig)
    finally:
        plane.stop()


def deployment(name: str, replicas: int) -> dict:
    labels = {"app.kubernetes.io/name": "k3", "app.kubernetes.io/component": name}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels},
                              "spec": {"containers": [{"name": "main", "image": "k3:test",
                                                       "args": ["serve", "experts"]}]}}},
    }


def test_scaling_a_real_deployment_through_the_scale_subresource(kubeconfig):
    from kubernetes import client as k8s

    client = api_client(kubeconfig)
    core, apps = k8s.CoreV1Api(client), k8s.AppsV1Api(client)
    core.create_namespace({"metadata": {"name": "k3-planner"}})
    apps.create_namespaced_deployment("k3-planner", deployment("k3-experts-0", 1))
    scaler = DeploymentScaler(client, "k3-planner")
    try:
        assert scaler.replicas("k3-experts-0") == 1
        assert scaler.scale("k3-experts-0", 3) == 3
        stored = apps.read_namespaced_deployment("k3-experts-0", "k3-planner")
        assert stored.spec.replicas == 3
        # Only the replica count changed.
        assert stored.spec.template.spec.containers[0].args == ["serve", "experts"]
        assert scaler.scale("k3-experts-0", 1) == 1 and scaler.replicas("k3-experts-0") == 1
        with pytest.raises(KubeError, match=r"reading the scale of deployment missing in namespace k3-planner: "
                                            r"404 Not Found") as info:
            scaler.replicas("missing")
        assert info.value.status == 404
    finally:
        scaler.close()


def test_planner_round_scales_through_the_api_server_and_exports_its_metrics(kubeconfig, tmp_path):
    """A real planner round: signals from a real Prometheus (no k3 series there: "no data"), a Deployment below
    the policy's minimum scaled up through the real API server, and the planner's catalogue metrics on its
    Prometheus endpoint."""
    from kubernetes import client as k8s

    if shutil.which("prometheus") is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus not found; CI must run the planner's metrics test")
        pytest.skip("prometheus not found (apt-get install -y prometheus)")
    client = api_client(kubeconfig)
    k8s.CoreV1Api(client).create_namespace({"metadata": {"name": "k3-planner-metrics"}})
    k8s.AppsV1Api(client).create_namespaced_deployment("k3-planner-metrics", deployment("k3-decode", 1))
    prometheus = LocalPrometheus(ObserveConfig(port=0, data_dir=str(tmp_path / "prometheus")), {})
    telemetry = setup_telemetry("planner", ServerConfig(metrics_port=free_port("127.0.0.1")))
    scaler = DeploymentScaler(client, "k3-planner-metrics")
    try:
        prometheus.start()
        config = load_config(PlannerConfig, env={}, overrides={
            "dry_run": False, "namespace": "k3-planner-metrics", "prometheus_url": prometheus.url,
            "targets": [{"deployment": "k3-decode", "kind": "decode", "selector": 'job="k3-decode"',
                         "policy": {"min_replicas": 2, "max_replicas": 4, "target_queue_length": 4}}]})
        decision = Planner(config, scaler, PrometheusSource(prometheus.url), telemetry).run_once()["k3-decode"]
        assert (decision.current, decision.desired) == (1, 2) and decision.reason == "outside bounds [2, 4]"
        assert scaler.replicas("k3-decode") == 2
        with urllib.request.urlopen(telemetry.metrics_endpoint.url, timeout=5) as answer:
            families = text_string_to_metric_families(answer.read().decode())
            samples = {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if not k.startswith("otel_scope_")))):
                       s.value for f in families for s in f.samples}
        assert samples[(mn.PLANNER_DESIRED.prometheus, (("deployment", "k3-decode"),))] == 2.0
        assert samples[(mn.PLANNER_SCALINGS.prometheus, (("deployment", "k3-decode"), ("direction", "up")))] == 1.0
    finally:
        scaler.close()
        telemetry.shutdown()
        prometheus.stop()
