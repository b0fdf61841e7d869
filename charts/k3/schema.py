"""Generates ``values.schema.json`` (JSON Schema draft-07), which Helm checks every install, upgrade,
template and lint against.

    python charts/k3/schema.py           # rewrite values.schema.json
    python charts/k3/schema.py --check   # exit 1 if the committed file differs from what this script makes

Design decisions:

- Written as Python rather than by hand because every component shares one shape (replicas, resources,
  scheduling, probes, PDB, ...): the shape is defined once here and expanded into each component. Draft-07
  ignores keywords next to ``$ref``, so shared shapes are inlined instead of referenced.
- Strict: every object the chart itself defines has ``additionalProperties: false``, so a misspelt key is an
  error rather than a silently ignored setting; unknown top-level keys are rejected the same way. Objects
  that are passed through to Kubernetes verbatim (affinity, tolerations, env, volumes, HPA behavior) are only
  checked for their JSON type; the rendered manifests are validated against the Kubernetes schemas
  separately (ops/tools/kube_validate.py).
- What JSON Schema cannot say (a shard index below its count, pool names unique, minReplicas <= maxReplicas)
  is checked in the templates with ``fail`` and a message naming the field.
- Standard library only, and the output is stable (sorted keys), so the generated file diffs cleanly.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

SCHEMA_PATH = Path(__file__).with_name("values.schema.json")

# Kubernetes resource quantity, e.g. 500m, 2, 1.5Gi, 1e3.
QUANTITY_PATTERN = r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+|[numkMGTPE]|[KMGTPE]i)?$"
# "i/n": slice i (0-based) of n slices of the routed experts.
SHARD_PATTERN = r"^(0|[1-9][0-9]*)/([1-9][0-9]*)$"
# A DNS label short enough that "<release>-k3-expert-<name>" stays within Kubernetes' 63-character limit.
POOL_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# Prometheus metric name.
METRIC_PATTERN = r"^[a-zA-Z_:][a-zA-Z0-9_:]*$"

COMPONENTS = {
    "router": "router (public API)",
    "prefill": "prefill workers",
    "decode": "decode workers",
    "cache": "cache store",
    "vision": "vision encoder",
    "trainer": "trainer",
    "rollout": "rollout workers",
    "planner": "planner",
}


def obj(properties: dict[str, Any], description: str = "", required: list[str] | None = None) -> dict[str, Any]:
    """A closed object: only the listed properties are allowed."""
    schema: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": False}
    if description:
        schema["description"] = description
    if required:
        schema["required"] = required
    return schema


def typed(kind: str | list[str], description: str, **extra: Any) -> dict[str, Any]:
    return {"type": kind, "description": description, **extra}


def string_map(description: str) -> dict[str, Any]:
    return {"type": "object", "description": description, "additionalProperties": {"type": "string"}}


def object_list(description: str) -> dict[str, Any]:
    return {"type": "array", "description": description, "items": {"type": "object"}}


def count(description: str, minimum: int = 0) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum, "description": description}


PORT = {"type": "integer", "minimum": 1, "maximum": 65535, "description": "gRPC port of the server and its Service."}
QUANTITY = {
    "oneOf": [{"type": "string", "pattern": QUANTITY_PATTERN}, {"type": "number", "minimum": 0}],
    "description": "A Kubernetes quantity (e.g. 500m, 4Gi, 1).",
}
RESOURCES = obj(
    {
        "limits": {"type": "object", "additionalProperties": QUANTITY, "description": "Upper limits by resource name."},
        "requests": {"type": "object", "additionalProperties": QUANTITY, "description": "Requests by resource name."},
        "claims": object_list("Dynamic resource claims."),
    },
    "Container resources; GPUs as nvidia.com/gpu limits.",
)
IMAGE = obj(
    {
        "repository": typed("string", "Image repository.", minLength=1),
        "tag": typed("string", "Image tag; empty uses the chart's appVersion."),
        "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"], "description": "imagePullPolicy."},
    },
    "Container image.",
)


def probe(description: str, with_timeout: bool = False) -> dict[str, Any]:
    properties = {
        "periodSeconds": count("Seconds between checks.", 1),
        "failureThreshold": count("Failed checks tolerated.", 1),
    }
    if with_timeout:
        properties["timeoutSeconds"] = count("Timeout of one check, seconds.", 1)
    return obj(properties, description)


PROBES = obj(
    {
        "startup": probe("gRPC health check while the process starts."),
        "readiness": probe("gRPC readiness check."),
        "liveness": probe("gRPC liveness check.", with_timeout=True),
    },
    "Native gRPC probes (grpc.health.v1).",
)
PDB = obj(
    {
        "enabled": typed("boolean", "Render a PodDisruptionBudget."),
        "maxUnavailable": {
            "oneOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": r"^[0-9]+%$"}],
            "description": "Pods (or percent) that may be down at once.",
        },
    },
    "PodDisruptionBudget.",
)
SERVICE = obj(
    {
        "type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"], "description": "Service type."},
        "annotations": string_map("Service annotations."),
    },
    "The component's Service.",
)


def pod_fields() -> dict[str, Any]:
    """The per-component fields that componentDefaults provides and every component may override."""
    return {
        "replicas": count("Pod replicas (ignored where an HPA manages the Deployment)."),
        "image": IMAGE,
        "resources": RESOURCES,
        "nodeSelector": string_map("Node labels a pod must match."),
        "tolerations": object_list("Tolerations."),
        "affinity": typed("object", "Pod affinity and anti-affinity."),
        "podAnnotations": string_map("Extra pod annotations."),
        "podLabels": string_map("Extra pod labels."),
        "env": object_list("Extra environment variables (EnvVar list)."),
        "extraVolumes": object_list("Extra pod volumes."),
        "extraVolumeMounts": object_list("Extra container volume mounts."),
        "service": SERVICE,
        "probes": PROBES,
        "pdb": PDB,
    }


def autoscaling(description: str) -> dict[str, Any]:
    return obj(
        {
            "enabled": typed("boolean", "Render a HorizontalPodAutoscaler."),
            "minReplicas": count("Fewest replicas.", 1),
            "maxReplicas": count("Most replicas.", 1),
            "metric": typed("string", "Pods metric (Prometheus name) averaged over the pods.", pattern=METRIC_PATTERN),
            "targetAverageValue": typed("string", "Target average per pod (quantity).", pattern=QUANTITY_PATTERN),
            "behavior": typed("object", "autoscaling/v2 behavior."),
        },
        description,
    )


def component(name: str, description: str) -> dict[str, Any]:
    properties = {
        "enabled": typed("boolean", f"Run the {description}."),
        "port": PORT,
        "config": typed("object", f"Config of the {description}, merged over the generated config.yaml."),
        **pod_fields(),
    }
    if name == "decode":
        properties["autoscaling"] = autoscaling("HPA of the decode Deployment.")
    return obj(properties, f"The {description}.")


EXPERT_POOL = obj(
    {
        "name": typed("string", "Pool name (DNS label).", pattern=POOL_NAME_PATTERN, maxLength=30),
        "shard": typed("string", "'i/n': this pool hosts slice i (0-based) of n of the routed experts.",
                       pattern=SHARD_PATTERN),
        "config": typed("object", "Config of the pool, merged over the generated config.yaml."),
        "autoscaling": autoscaling("HPA of this pool's Deployment."),
        **pod_fields(),
    },
    "One expert pool: its own Deployment, Service, ConfigMap, PDB and HPA.",
    required=["name", "shard"],
)

RAY_WORKER_GROUP = obj(
    {
        "name": typed("string", "Group name.", pattern=POOL_NAME_PATTERN, maxLength=40),
        "replicas": count("Workers."),
        "minReplicas": count("Fewest workers (Ray autoscaler)."),
        "maxReplicas": count("Most workers (Ray autoscaler)."),
        "resources": RESOURCES,
        "nodeSelector": string_map("Node labels a worker must match."),
        "tolerations": object_list("Tolerations."),
        "rayStartParams": string_map("`ray start` parameters."),
    },
    "A Ray worker group.",
    required=["name"],
)


def values_schema() -> dict[str, Any]:
    properties: dict[str, Any] = {
        "global": typed("object", "Values shared with subcharts (unused by this chart)."),
        "nameOverride": typed("string", "Overrides the chart name in object names."),
        "fullnameOverride": typed("string", "Overrides the full object-name prefix."),
        "image": obj({**IMAGE["properties"]}, "Image holding the k3 command.", required=["repository"]),
        "imagePullSecrets": object_list("Image pull secrets."),
        "serviceAccount": obj(
            {
                "create": typed("boolean", "Create the ServiceAccount."),
                "name": typed("string", "ServiceAccount name; empty derives it."),
                "annotations": string_map("ServiceAccount annotations."),
            },
            "ServiceAccount of the k3 pods.",
        ),
        "auth": obj(
            {
                "enabled": typed("boolean", "Require a bearer token on every RPC."),
                "existingSecret": typed("string", "Existing Secret holding the token."),
                "secretKey": typed("string", "Key of the token in the Secret.", minLength=1),
                "token": typed("string", "Token of the created Secret; empty generates one."),
            },
            "Bearer-token authentication.",
        ),
        "server": obj(
            {
                "graceSeconds": typed("number", "Drain time on shutdown, seconds.", minimum=0),
                "maxMessageBytes": count("Largest gRPC message, bytes.", 1024),
                "maxWorkers": count("RPC threads per process.", 1),
            },
            "Settings of every gRPC server.",
        ),
        "telemetry": obj({
            "otlpEndpoint": typed("string", "OTLP/gRPC collector host:port."),
            "metricsPort": typed("integer", "Port of every container's Prometheus /metrics endpoint; 0 = none.",
                                 minimum=0, maximum=65535),
        }, "Telemetry."),
        "kafka": obj({"bootstrap": typed("string", "Bootstrap servers, host:port[,host:port].",
                                         pattern=r"^$|^[^,\s:]+:[0-9]+(,[^,\s:]+:[0-9]+)*$")},
                     "External Kafka."),
        "redis": obj({"url": typed("string", "Redis URL.", pattern=r"^$|^rediss?://")}, "External Redis."),
        "podSecurityContext": typed("object", "Pod securityContext."),
        "securityContext": typed("object", "Container securityContext."),
        "networkPolicy": obj(
            {
                "enabled": typed("boolean", "Render NetworkPolicies."),
                "routerFrom": object_list("Peers allowed to reach the router; empty allows all."),
                "internalFrom": object_list("Extra peers allowed to reach internal services."),
                "metricsFrom": object_list("Peers allowed to scrape the metrics port; empty allows all."),
            },
            "NetworkPolicies.",
        ),
        "componentDefaults": obj(pod_fields(), "Settings every component starts from."),
        "expertPools": {"type": "array", "items": EXPERT_POOL, "description": "Expert pools, one Deployment each."},
        "expertPoolDefaults": obj(
            {"port": PORT, "autoscaling": autoscaling("HPA settings every pool starts from."),
             "config": typed("object", "Config every pool starts from.")},
            "Settings every expert pool starts from.",
        ),
        "metricsAdapter": obj(
            {
                "rules": typed("boolean", "Render prometheus-adapter rules for the HPA metrics."),
                "decodeQueueSeries": typed("string", "Series of the decode queue.", pattern=METRIC_PATTERN),
                "expertPoolLoadSeries": typed("string", "Series of an expert pool's load.", pattern=METRIC_PATTERN),
                "namespaceLabel": typed("string", "Series label holding the pod's namespace.",
                                        pattern=r"^[a-zA-Z_][a-zA-Z0-9_]*$"),
                "podLabel": typed("string", "Series label holding the pod's name.", pattern=r"^[a-zA-Z_][a-zA-Z0-9_]*$"),
            },
            "Custom-metrics adapter rules.",
        ),
        "ray": obj(
            {
                "rayVersion": typed("string", "Ray version inside the image.", minLength=1),
                "cluster": obj(
                    {
                        "enabled": typed("boolean", "Render a KubeRay RayCluster."),
                        "head": obj(
                            {"resources": RESOURCES, "rayStartParams": string_map("`ray start` parameters.")},
                            "Ray head pod.",
                        ),
                        "workerGroups": {"type": "array", "items": RAY_WORKER_GROUP,
                                         "description": "Ray worker groups."},
                    },
                    "KubeRay RayCluster.",
                ),
                "job": obj(
                    {
                        "enabled": typed("boolean", "Render a KubeRay RayJob."),
                        "entrypoint": typed("string", "Command the job runs."),
                        "shutdownAfterJobFinishes": typed("boolean", "Delete a job-owned cluster afterwards."),
                        "ttlSecondsAfterFinished": count("Seconds a job-owned cluster is kept afterwards."),
                    },
                    "KubeRay RayJob.",
                ),
            },
            "Optional KubeRay resources for training (ray.io/v1).",
        ),
    }
    for name, description in COMPONENTS.items():
        properties[name] = component(name, description)
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": "Values of the k3 Helm chart",
        **obj(properties),
    }


def render() -> str:
    return json.dumps(values_schema(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if values.schema.json is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = SCHEMA_PATH.read_text() if SCHEMA_PATH.exists() else ""
        if current != text:
            print(f"{SCHEMA_PATH} is out of date; run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    SCHEMA_PATH.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
