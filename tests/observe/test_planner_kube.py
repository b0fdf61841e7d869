"""The planner's Kubernetes calls against a real kube-apiserver (with etcd) on 127.0.0.1.

The binaries come from ops/tools (etcd.sh, kube-apiserver.sh) and are only looked up here; when they are
missing the test fails if CI is set and is skipped otherwise.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from k3.services.planner.kube import DeploymentScaler, KubeError, api_client

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
