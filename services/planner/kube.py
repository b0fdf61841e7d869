"""Reading and changing a Deployment's replica count through the Kubernetes API's ``scale`` subresource.

Design decisions:

- The official ``kubernetes`` client, ``AppsV1Api.read_namespaced_deployment_scale`` and
  ``patch_namespaced_deployment_scale``: the scale subresource is what ``kubectl scale`` and the HPA use, it
  needs only the ``deployments/scale`` RBAC verb, and it never touches the rest of the Deployment.
- The patch body is built by a pure function (``scale_body``) so that it is tested on its own; it is a
  JSON merge patch of ``spec.replicas`` only, sent with that content type.
- Credentials: in a pod, the service account (``kubeconfig`` unset); elsewhere an explicit kubeconfig file.
  There is no guessing between the two: an unusable choice is an error naming it.
"""

from __future__ import annotations

from typing import Any

#: the body is a JSON merge patch (RFC 7386); said explicitly, as the client would otherwise pick a type itself
MERGE_PATCH = "application/merge-patch+json"


class KubeError(RuntimeError):
    """The Kubernetes API refused or could not be reached; ``status`` is the HTTP status when there was one."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def scale_body(replicas: int) -> dict[str, Any]:
    """The merge-patch body of the ``scale`` subresource setting ``spec.replicas``."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        raise ValueError(f"replicas must be an int >= 0, got {replicas!r}")
    return {"spec": {"replicas": replicas}}


def api_client(kubeconfig: str | None = None, context: str | None = None):
    """An ``ApiClient`` from ``kubeconfig`` (a file), or the pod's service account when it is None."""
    from kubernetes import config as k8s_config
    from kubernetes.config.config_exception import ConfigException

    try:
        if kubeconfig is None:
            configuration = _in_cluster_configuration()
            from kubernetes import client as k8s

            return k8s.ApiClient(configuration)
        return k8s_config.new_client_from_config(config_file=kubeconfig, context=context, persist_config=False)
    except ConfigException as exc:
        where = f"kubeconfig {kubeconfig}" if kubeconfig else "in-cluster service account (kubeconfig unset)"
        raise ValueError(f"cannot configure the Kubernetes client from {where}: {exc}") from None


def _in_cluster_configuration():
    from kubernetes import client as k8s
    from kubernetes.config import incluster_config

    configuration = k8s.Configuration()
    incluster_config.InClusterConfigLoader(
        token_filename=incluster_config.SERVICE_TOKEN_FILENAME,
        cert_filename=incluster_config.SERVICE_CERT_FILENAME,
    ).load_and_set(configuration)
    return configuration


class DeploymentScaler:
    """Replica counts of Deployments in one namespace."""

    def __init__(self, api_client, namespace: str, timeout_s: float = 10.0):
        from kubernetes import client as k8s

        if not namespace:
            raise ValueError("namespace must not be empty")
        self._apps = k8s.AppsV1Api(api_client)
        self._api_client = api_client
        self.namespace = namespace
        self.timeout_s = timeout_s

    def _call(self, what: str, fn, *args, **kwargs):
        from kubernetes.client.rest import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return fn(*args, namespace=self.namespace, _request_timeout=self.timeout_s, **kwargs)
        except ApiException as exc:
            raise KubeError(f"{what} in namespace {self.namespace}: {exc.status} {exc.reason}",
                            status=exc.status) from None
        except HTTPError as exc:
            raise KubeError(f"{what} in namespace {self.namespace}: {exc}") from None

    def replicas(self, deployment: str) -> int:
        """The Deployment's desired replica count (``spec.replicas`` of its scale)."""
        scale = self._call(f"reading the scale of deployment {deployment}",
                           self._apps.read_namespaced_deployment_scale, deployment)
        return int(scale.spec.replicas or 0)

    def scale(self, deployment: str, replicas: int) -> int:
        """Set the Deployment's replicas; returns the count the API server stored."""
        scale = self._call(f"scaling deployment {deployment} to {replicas}",
                           self._apps.patch_namespaced_deployment_scale, deployment, body=scale_body(replicas),
                           _content_type=MERGE_PATCH)
        return int(scale.spec.replicas or 0)

    def close(self) -> None:
        self._api_client.close()
