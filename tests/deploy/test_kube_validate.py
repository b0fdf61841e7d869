"""The offline validator itself: it must reject what a strict API server rejects, or the chart tests that
rely on it would prove nothing."""

from __future__ import annotations

import copy

import pytest

pytestmark = pytest.mark.timeout(120)

DEPLOYMENT = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {"name": "d", "labels": {"a": "b"}},
    "spec": {
        "selector": {"matchLabels": {"a": "b"}},
        "template": {
            "metadata": {"labels": {"a": "b"}},
            "spec": {"containers": [{"name": "c", "image": "k3", "readinessProbe": {"grpc": {"port": 50051}}}]},
        },
    },
}
RAY_CLUSTER = {
    "apiVersion": "ray.io/v1",
    "kind": "RayCluster",
    "metadata": {"name": "r"},
    "spec": {
        "rayVersion": "2.60.0",
        "headGroupSpec": {"rayStartParams": {}, "template": {"spec": {"containers": [{"name": "h", "image": "k3"}]}}},
    },
}


def test_valid_objects_pass(validator):
    assert validator.errors([DEPLOYMENT, RAY_CLUSTER]) == []


def test_a_misspelt_field_is_rejected_with_its_path(validator):
    bad = copy.deepcopy(DEPLOYMENT)
    container = bad["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    (error,) = validator.errors([bad])
    assert error.where == "Deployment/d"
    assert error.path == "spec.template.spec.containers.0"
    assert "'readinesProbe' was unexpected" in error.reason


def test_a_wrong_type_is_rejected(validator):
    bad = copy.deepcopy(DEPLOYMENT)
    bad["spec"]["replicas"] = "two"
    (error,) = validator.errors([bad])
    assert error.path == "spec.replicas" and "'two' is not of type" in error.reason


def test_custom_resources_are_checked_against_the_crd_schema_strictly(validator):
    bad = copy.deepcopy(RAY_CLUSTER)
    bad["spec"]["headGroupSpec"]["replica"] = 1
    (error,) = validator.errors([bad])
    assert error.where == "RayCluster/r" and error.path == "spec.headGroupSpec"
    assert "'replica' was unexpected" in error.reason
    meta = copy.deepcopy(RAY_CLUSTER)
    meta["metadata"]["label"] = {"x": "y"}
    (error,) = validator.errors([meta])
    assert error.path == "metadata" and "'label' was unexpected" in error.reason


def test_a_kind_without_schema_is_an_error_not_a_pass(validator):
    unknown = {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": {"name": "m"}}
    (error,) = validator.errors([unknown])
    assert "no schema for ServiceMonitor in monitoring.coreos.com/v1" in error.reason
    (error,) = validator.errors([{"apiVersion": "v1", "kind": "Nonsense", "metadata": {"name": "n"}}])
    assert "no schema for Nonsense in v1" in error.reason
