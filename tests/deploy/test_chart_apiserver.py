"""`helm install` of every example against a real kube-apiserver (with etcd) on 127.0.0.1.

The API server validates, defaults and admits each object exactly as a cluster would (only nothing runs:
there are no controllers or nodes). KubeRay's CRDs are installed first, so the RayCluster of the
multi-node example goes through the CRD's structural schema as well.
"""

from __future__ import annotations

import base64
import time
from pathlib import Path

import pytest
import yaml
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.rest import ApiException

pytestmark = pytest.mark.timeout(600)

EXAMPLES = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "charts/k3/examples").glob("*.yaml"))


@pytest.fixture(scope="module")
def api(control_plane, crd_paths):
    api_client = k8s_config.new_client_from_config(config_file=str(control_plane.kubeconfig))
    extensions = k8s.ApiextensionsV1Api(api_client)
    for path in crd_paths:
        for crd in yaml.load_all(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
            extensions.create_custom_resource_definition(crd)
    deadline = time.monotonic() + 60
    for name in ("rayclusters.ray.io", "rayjobs.ray.io"):
        while True:
            conditions = extensions.read_custom_resource_definition(name).status.conditions or []
            if any(c.type == "Established" and c.status == "True" for c in conditions):
                break
            assert time.monotonic() < deadline, f"CRD {name} not established"
            time.sleep(0.2)
    yield api_client
    api_client.close()


def helm_kube(chart, control_plane, *args: str):
    return chart.helm([*args, "--kubeconfig", str(control_plane.kubeconfig)], timeout=300)


@pytest.mark.parametrize("example", EXAMPLES)
def test_helm_install_is_accepted_by_the_api_server(chart, control_plane, api, render, example):
    namespace = f"k3-{example}"
    result = helm_kube(chart, control_plane, "install", "k3", str(chart.CHART_DIR), "-n", namespace,
                       "--create-namespace", "-f", str(chart.EXAMPLES_DIR / f"{example}.yaml"))
    assert result.returncode == 0, result.stderr
    rendered = render(example)
    apps = k8s.AppsV1Api(api)
    stored = {d.metadata.name for d in apps.list_namespaced_deployment(namespace).items}
    assert stored == rendered.names("Deployment")
    hpas = k8s.AutoscalingV2Api(api).list_namespaced_horizontal_pod_autoscaler(namespace).items
    assert {h.metadata.name for h in hpas} == rendered.names("HorizontalPodAutoscaler")
    for hpa in hpas:
        assert hpa.spec.metrics[0].type == "Pods"
    policies = k8s.NetworkingV1Api(api).list_namespaced_network_policy(namespace).items
    assert {p.metadata.name for p in policies} == rendered.names("NetworkPolicy")
    pdbs = k8s.PolicyV1Api(api).list_namespaced_pod_disruption_budget(namespace).items
    assert {p.metadata.name for p in pdbs} == rendered.names("PodDisruptionBudget")
    clusters = k8s.CustomObjectsApi(api).list_namespaced_custom_object("ray.io", "v1", namespace, "rayclusters")
    assert {c["metadata"]["name"] for c in clusters["items"]} == rendered.names("RayCluster")
    # What the server stored (after its defaulting) still carries the native gRPC probe.
    router = apps.read_namespaced_deployment("k3-router", namespace)
    assert router.spec.template.spec.containers[0].readiness_probe.grpc.port == 50051


def test_server_side_dry_run_with_everything_on(chart, control_plane, api):
    result = helm_kube(chart, control_plane, "install", "k3-all", str(chart.CHART_DIR), "-n", "k3-all",
                       "--create-namespace", "--dry-run=server",
                       "-f", str(chart.EXAMPLES_DIR / "multi-node.yaml"),
                       "--set", "planner.enabled=true,ray.job.enabled=true,ray.job.entrypoint=k3 train")
    assert result.returncode == 0, result.stderr
    assert "kind: RayJob" in result.stdout and "name: k3-all-planner" in result.stdout


def test_generated_token_survives_an_upgrade(chart, control_plane, api):
    """The Secret's token is generated once; `lookup` against the live server keeps it on upgrade."""
    namespace = "k3-upgrade"
    values = str(chart.EXAMPLES_DIR / "cpu-single-node.yaml")
    core = k8s.CoreV1Api(api)
    installed = helm_kube(chart, control_plane, "install", "k3", str(chart.CHART_DIR), "-n", namespace,
                          "--create-namespace", "-f", values)
    assert installed.returncode == 0, installed.stderr
    token = base64.b64decode(core.read_namespaced_secret("k3-auth", namespace).data["token"])
    assert len(token) == 32
    upgraded = helm_kube(chart, control_plane, "upgrade", "k3", str(chart.CHART_DIR), "-n", namespace,
                         "-f", values, "--set", "decode.config.engine.max_batch=4")
    assert upgraded.returncode == 0, upgraded.stderr
    assert base64.b64decode(core.read_namespaced_secret("k3-auth", namespace).data["token"]) == token
    config = core.read_namespaced_config_map("k3-decode", namespace).data["config.yaml"]
    assert yaml.safe_load(config)["engine"]["max_batch"] == 4


def test_the_api_server_really_rejects_invalid_objects(api):
    """Guards the tests above: acceptance means something only if the server refuses bad objects."""
    bad = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
           "metadata": {"name": "bad"},
           "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "x"},
                    "minReplicas": 5, "maxReplicas": 2,
                    "metrics": [{"type": "Pods", "pods": {"metric": {"name": "m"},
                                                          "target": {"type": "AverageValue", "averageValue": "1"}}}]}}
    with pytest.raises(ApiException) as caught:
        k8s.AutoscalingV2Api(api).create_namespaced_horizontal_pod_autoscaler("default", bad)
    assert caught.value.status == 422 and "maxReplicas" in caught.value.body
