"""The chart rendered with each example values file: strictly valid objects and the promised shape
(one Deployment + Service + ConfigMap per component, gRPC probes, an HPA per expert pool, PDBs,
NetworkPolicies, the token Secret, KubeRay objects), with configs the services really load."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from k3.services import registry
from k3.services.common.config import load_config

pytestmark = pytest.mark.timeout(300)

EXAMPLE_NAMES = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "charts/k3/examples").glob("*.yaml"))
CORE = ["router", "prefill", "decode", "cache"]
PORTS = {"router": 50051, "prefill": 50052, "decode": 50053, "cache": 50055, "vision": 50056,
         "trainer": 50057, "rollout": 50058, "planner": 50059}


def test_the_three_examples_exist():
    assert sorted(EXAMPLE_NAMES) == ["cpu-single-node", "multi-node", "one-gpu"]


@pytest.mark.parametrize("example", EXAMPLE_NAMES)
def test_every_rendered_object_validates_strictly(render, validator, example):
    rendered = render(example)
    assert len(rendered.objects) >= 15
    assert [str(e) for e in validator.errors(rendered.objects)] == []


@pytest.mark.parametrize("example", EXAMPLE_NAMES)
def test_every_deployment_serves_grpc_with_native_grpc_probes(render, example):
    deployments = render(example).of_kind("Deployment")
    assert deployments
    for deployment in deployments:
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        port = container["ports"][0]  # then the metrics port (test_chart_metrics)
        assert port["name"] == "grpc"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"] == {"port": port["containerPort"]}, (deployment["metadata"]["name"], probe)
        assert container["command"][:2] == ["k3", "serve"]
        assert container["command"][3:] == ["--config", "/etc/k3/config.yaml"]
        assert {"name": "config", "mountPath": "/etc/k3", "readOnly": True} in container["volumeMounts"]
        assert pod["terminationGracePeriodSeconds"] > 10  # longer than the server's own 10 s drain


@pytest.mark.parametrize("example", EXAMPLE_NAMES)
def test_each_component_is_its_own_deployment_service_and_configmap(render, example):
    rendered = render(example)
    deployments = rendered.names("Deployment")
    assert deployments == rendered.names("Service") == rendered.names("ConfigMap") - {"k3-metrics-adapter-rules"}
    for deployment in rendered.of_kind("Deployment"):
        name = deployment["metadata"]["name"]
        service = rendered.get("Service", name)
        assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
        assert service["spec"]["ports"][0]["port"] == deployment["spec"]["template"]["spec"]["containers"][0][
            "ports"][0]["containerPort"]


def test_components_follow_their_enabled_switch(render):
    assert render("cpu-single-node").names("Deployment") == {f"k3-{c}" for c in CORE}
    everything = render("multi-node").names("Deployment")
    assert everything == {f"k3-{c}" for c in [*CORE, "vision", "trainer", "rollout"]} | {
        f"k3-expert-shard-{i}" for i in range(4)}
    without_router = render("cpu-single-node", "router.enabled=false")
    assert "k3-router" not in without_router.names("Deployment")
    assert "k3-router" not in without_router.names("NetworkPolicy")


def test_ports_and_commands_match_the_service_map(render):
    rendered = render("multi-node")
    for component, port in PORTS.items():
        if component == "planner":
            continue
        container = rendered.get("Deployment", f"k3-{component}")["spec"]["template"]["spec"]["containers"][0]
        assert container["ports"][0]["containerPort"] == port
        assert container["command"][2] == component
    pool = rendered.get("Deployment", "k3-expert-shard-0")["spec"]["template"]["spec"]["containers"][0]
    assert pool["ports"][0]["containerPort"] == 50054 and pool["command"][2] == "experts"


def test_each_expert_pool_is_its_own_deployment_with_its_own_hpa(render):
    rendered = render("multi-node")
    pools = [d for d in rendered.of_kind("Deployment")
             if d["spec"]["template"]["metadata"]["labels"].get("k3-expert-pool")]
    assert sorted(d["metadata"]["name"] for d in pools) == [f"k3-expert-shard-{i}" for i in range(4)]
    hpas = {h["spec"]["scaleTargetRef"]["name"]: h for h in rendered.of_kind("HorizontalPodAutoscaler")}
    for i, deployment in enumerate(sorted(pools, key=lambda d: d["metadata"]["name"])):
        name = deployment["metadata"]["name"]
        assert "replicas" not in deployment["spec"], "an HPA-managed Deployment must leave replicas to the HPA"
        hpa = hpas[name]
        assert hpa["apiVersion"] == "autoscaling/v2"
        assert hpa["spec"]["metrics"] == [{"type": "Pods", "pods": {
            "metric": {"name": "k3_expert_pool_load"}, "target": {"type": "AverageValue", "averageValue": "800m"}}}]
        assert hpa["spec"]["maxReplicas"] == (6 if i == 3 else 4)
        assert rendered.config(f"expert-shard-{i}")["shard"] == f"{i}/4"
        # Each pool selects only its own pods, so each scales alone.
        assert deployment["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == f"expert-shard-{i}"


def test_decode_hpa_uses_the_queue_metric(render):
    rendered = render("multi-node")
    hpa = rendered.get("HorizontalPodAutoscaler", "k3-decode")
    assert hpa["spec"]["minReplicas"] == 2 and hpa["spec"]["maxReplicas"] == 16
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "k3_decode_queue_length"
    assert hpa["spec"]["behavior"] == {"scaleDown": {"stabilizationWindowSeconds": 600}}
    assert "replicas" not in rendered.get("Deployment", "k3-decode")["spec"]
    assert render("cpu-single-node").of_kind("HorizontalPodAutoscaler") == []
    assert render("cpu-single-node").get("Deployment", "k3-decode")["spec"]["replicas"] == 1


def test_metrics_adapter_rules_publish_the_hpa_metric_names(render):
    rules = render("multi-node").get("ConfigMap", "k3-metrics-adapter-rules")["data"]["config.yaml"]
    assert "as: 'k3_decode_queue_length'" in rules and "matches: '^k3_engine_queued$'" in rules
    assert "as: 'k3_expert_pool_load'" in rules


# (example, extra --set values, ConfigMap suffix, service name for `k3 serve`)
LOADABLE = [(e, (), c, c) for e in ("cpu-single-node", "one-gpu", "multi-node") for c in CORE] + [
    ("multi-node", (), "vision", "vision"),
    ("multi-node", (), "expert-shard-2", "experts"),
    ("multi-node", ("planner.enabled=true",), "planner", "planner"),
    ("multi-node", (), "trainer", "trainer"),
]


@pytest.mark.parametrize(("example", "extra", "configmap", "service"), LOADABLE)
def test_configmaps_load_with_the_services_own_config_classes(render, tmp_path, example, extra, configmap, service):
    """The chart writes config.yaml for the real, strict config loader: unknown keys would fail here."""
    rendered = render(example, *extra)
    path = tmp_path / "config.yaml"
    path.write_text(rendered.get("ConfigMap", f"k3-{configmap}")["data"]["config.yaml"])
    config = load_config(registry.get_spec(service).config_type, path, env={})
    container = rendered.get("Deployment", f"k3-{configmap}")["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][2] == service
    assert config.server.host == "0.0.0.0" and config.server.port == container["ports"][0]["containerPort"]
    assert config.server.grace_seconds == 10.0 and config.server.max_message_bytes == 64 << 20


def test_generated_configs_wire_the_services_together(render, tmp_path):
    rendered = render("multi-node")
    router = rendered.config("router")
    assert router["upstream"] == {"prefill": ["k3-prefill:50052"], "decode": ["k3-decode:50053"],
                                  "cache": ["k3-cache:50055"]}
    assert rendered.config("prefill")["cache_address"] == "k3-cache:50055"
    assert rendered.config("vision")["cache_address"] == "k3-cache:50055"
    pools = [f"k3-expert-shard-{i}:50054" for i in range(4)]
    for worker in ("prefill", "decode"):  # pool addresses merged with the example's own model section
        assert rendered.config(worker)["model"] == {"checkpoint": "/models/k3/latest", "device": "cuda:0",
                                                    "dtype": "bfloat16", "expert_pools": pools}
    assert rendered.config("expert-shard-1")["model"]["checkpoint"] == "/models/k3/latest"
    assert "expert_pools" not in render("cpu-single-node").config("decode")["model"]
    assert render("multi-node", "planner.enabled=true").config("planner")["planner"] == {"namespace": "k3"}
    assert rendered.config("cache")["store"]["redis_url"] == "redis://redis-master.data:6379/0"
    assert rendered.config("cache")["store"]["memory_bytes"] == 68719476736  # values merged over generated
    assert rendered.config("decode")["server"]["otlp_endpoint"] == "otel-collector.observability:4317"
    env = {e["name"]: e for e in rendered.get("Deployment", "k3-trainer")["spec"]["template"]["spec"][
        "containers"][0]["env"]}
    assert env["RAY_ADDRESS"]["value"] == "ray://k3-ray-head-svc:10001"
    assert env["K3_KAFKA_BOOTSTRAP"]["value"].startswith("kafka-0.kafka.data:9092,")
    assert "otlp_endpoint" not in render("cpu-single-node").config("decode")["server"]
    override = render("cpu-single-node", "router.config.upstream.prefill[0]=elsewhere:1")
    assert override.config("router")["upstream"]["prefill"] == ["elsewhere:1"]


def test_a_changed_config_changes_the_pod_template(render):
    before = render("cpu-single-node").get("Deployment", "k3-decode")
    after = render("cpu-single-node", "decode.config.engine.max_batch=3").get("Deployment", "k3-decode")
    key = "checksum/config"
    assert before["spec"]["template"]["metadata"]["annotations"][key] != \
        after["spec"]["template"]["metadata"]["annotations"][key]


def test_gpu_resources_and_scheduling_per_component(render):
    rendered = render("one-gpu")
    for component in ("prefill", "decode"):
        pod = rendered.get("Deployment", f"k3-{component}")["spec"]["template"]["spec"]
        assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    router = rendered.get("Deployment", "k3-router")["spec"]["template"]["spec"]
    assert "nodeSelector" not in router and "limits" not in router["containers"][0]["resources"]
    cache = rendered.get("Deployment", "k3-cache")["spec"]["template"]["spec"]
    assert {"name": "cache-disk", "emptyDir": {"sizeLimit": "20Gi"}} in cache["volumes"]


def test_component_defaults_merge_key_by_key(render):
    rendered = render("multi-node")
    # componentDefaults.tolerations reach every component; a component's own affinity stays its own.
    for deployment in rendered.of_kind("Deployment"):
        assert deployment["spec"]["template"]["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert "affinity" in rendered.get("Deployment", "k3-router")["spec"]["template"]["spec"]
    assert "affinity" not in rendered.get("Deployment", "k3-prefill")["spec"]["template"]["spec"]
    # A falsy override (0 replicas, a disabled PDB) wins over the default instead of being skipped.
    zero = render("cpu-single-node", "prefill.replicas=0", "componentDefaults.pdb.enabled=true",
                  "cache.pdb.enabled=false")
    assert zero.get("Deployment", "k3-prefill")["spec"]["replicas"] == 0
    assert zero.names("PodDisruptionBudget") == {"k3-router", "k3-prefill", "k3-decode"}


def test_pod_disruption_budgets_select_their_deployment(render):
    rendered = render("multi-node")
    pdbs = {p["metadata"]["name"]: p for p in rendered.of_kind("PodDisruptionBudget")}
    assert set(pdbs) == rendered.names("Deployment")
    for deployment in rendered.of_kind("Deployment"):
        pdb = pdbs[deployment["metadata"]["name"]]
        assert pdb["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
        assert pdb["spec"]["maxUnavailable"] == 1
    assert render("cpu-single-node").of_kind("PodDisruptionBudget") == []


def test_network_policies_open_the_router_and_close_the_rest(render):
    rendered = render("multi-node")
    router = rendered.get("NetworkPolicy", "k3-router")
    (rule,) = router["spec"]["ingress"]
    assert "from" not in rule and rule["ports"] == [{"port": 50051, "protocol": "TCP"}]
    assert router["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "router"
    internal = rendered.get("NetworkPolicy", "k3-internal")
    selector = internal["spec"]["podSelector"]
    assert selector["matchExpressions"] == [
        {"key": "app.kubernetes.io/component", "operator": "NotIn", "values": ["router"]}]
    peers = internal["spec"]["ingress"][0]["from"]
    release_pods = {"app.kubernetes.io/name": "k3", "app.kubernetes.io/instance": "k3", "app.kubernetes.io/part-of": "k3"}
    assert peers[0] == {"podSelector": {"matchLabels": release_pods}}
    assert peers[1]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "observability"}
    # Every k3 pod, Ray's included, carries the labels the internal policy trusts.
    for pod_owner in rendered.of_kind("Deployment"):
        labels = pod_owner["spec"]["template"]["metadata"]["labels"]
        assert release_pods.items() <= labels.items()
    ray = rendered.get("RayCluster", "k3-ray")["spec"]["headGroupSpec"]["template"]["metadata"]["labels"]
    assert release_pods.items() <= ray.items()
    assert render("cpu-single-node", "networkPolicy.enabled=false").of_kind("NetworkPolicy") == []


def test_generated_token_secret_and_its_use(render):
    rendered = render("cpu-single-node")
    secret = rendered.get("Secret", "k3-auth")
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) == 32 and token.isalnum()
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    env = rendered.get("Deployment", "k3-router")["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "K3_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {"name": "k3-auth", "key": "token"}}} in env
    given = render("cpu-single-node", "auth.token=s3cret")
    assert base64.b64decode(given.get("Secret", "k3-auth")["data"]["token"]) == b"s3cret"


def test_existing_secret_and_auth_off(render):
    rendered = render("multi-node")
    assert rendered.of_kind("Secret") == []
    env = rendered.get("Deployment", "k3-decode")["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "K3_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {"name": "k3-token", "key": "token"}}} in env
    off = render("cpu-single-node", "auth.enabled=false")
    assert off.of_kind("Secret") == []
    assert "env" not in off.get("Deployment", "k3-router")["spec"]["template"]["spec"]["containers"][0]


def test_kuberay_objects_are_off_by_default_and_strictly_valid_when_on(render, validator):
    assert not any(o["apiVersion"].startswith("ray.io/") for o in render("cpu-single-node").objects)
    cluster = render("multi-node").get("RayCluster", "k3-ray")
    (group,) = cluster["spec"]["workerGroupSpecs"]
    assert (group["groupName"], group["replicas"], group["minReplicas"], group["maxReplicas"]) == ("gpu", 2, 1, 8)
    on_cluster = render("multi-node", "ray.job.enabled=true", "ray.job.entrypoint=k3 train --preset small")
    job = on_cluster.get("RayJob", "k3-ray-job")
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": "k3-ray"} and "rayClusterSpec" not in job["spec"]
    own = render("cpu-single-node", "ray.job.enabled=true", "ray.job.entrypoint=python -m k3 train")
    job = own.get("RayJob", "k3-ray-job")
    assert job["spec"]["shutdownAfterJobFinishes"] is True and job["spec"]["rayClusterSpec"]["rayVersion"] == "2.60.0"
    assert validator.errors(on_cluster.objects) == [] and validator.errors(own.objects) == []


def test_planner_gets_a_role_that_may_only_scale(render, validator):
    rendered = render("multi-node", "planner.enabled=true")
    pod = rendered.get("Deployment", "k3-planner")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "k3-planner"
    role = rendered.get("Role", "k3-planner")
    verbs = {rule["resources"][0]: set(rule["verbs"]) for rule in role["rules"]}
    assert verbs["deployments/scale"] == {"get", "update", "patch"}
    assert verbs["deployments"] == {"get", "list", "watch"}
    binding = rendered.get("RoleBinding", "k3-planner")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "k3-planner", "namespace": "k3"}]
    assert validator.errors(rendered.objects) == []


@pytest.mark.parametrize("example", EXAMPLE_NAMES)
def test_golden_output_is_in_sync(render, chart, example):
    golden = chart.golden_path(chart.EXAMPLES_DIR / f"{example}.yaml")
    assert golden.exists(), f"missing {golden}; run python ops/tools/chart.py golden"
    assert chart.normalise(render(example).text) == golden.read_text(), \
        f"{golden.name} is stale; run python ops/tools/chart.py golden"


def test_no_golden_without_an_example(chart):
    assert {p.stem for p in chart.GOLDEN_DIR.glob("*.yaml")} == set(EXAMPLE_NAMES)


@pytest.mark.parametrize("example", EXAMPLE_NAMES)
def test_helm_lint_passes_strictly(helm, chart, example):
    result = chart.helm(["lint", "--strict", str(chart.CHART_DIR), "-f", str(chart.EXAMPLES_DIR / f"{example}.yaml"),
                         "--kube-version", chart.tool_versions()["KUBERNETES_VERSION"]])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout
