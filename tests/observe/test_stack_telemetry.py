"""One request through real service processes, traced end to end and measured on every /metrics.

``k3 up``'s launcher starts cache, one expert pool, prefill, decode and router as separate processes (tiny
preset), each exporting spans over OTLP/gRPC to a receiver this test runs in-process (the official
``opentelemetry.proto`` collector stubs) and serving Prometheus metrics on its own port. Two Generate
requests with the same 1100-token prompt go through the router (the first stores the prompt's checkpoints,
the second restores its first two 512-token blocks from the cache store); then

- every service's ``/metrics`` holds every catalogue entry that service records (``emitted``);
- with the ``prometheus`` binary (CI installs it), a real Prometheus scraping them finds the same series
  through its query API;
- after the services stop (which flushes their span exporters) the second request's trace holds the spans of
  all five services, with the parent of every span inside the trace and each hop's server span the child of
  the calling service's client span.
"""

from __future__ import annotations

import os
import shutil
import time
import urllib.request
from dataclasses import dataclass, field

import grpc
import pytest
from opentelemetry.proto.trace.v1 import trace_pb2
from otlp_receiver import OTLPReceiver
from prometheus_client.parser import text_string_to_metric_families

from k3.protos.v1 import inference_pb2, inference_pb2_grpc
from k3.services.common import metric_names as mn
from k3.services.launcher import EXPERTS, LaunchConfig, Launcher
from k3.services.observe import (
    LocalPrometheus,
    ObserveConfig,
    assign_metrics_ports,
    assign_pool_metrics_ports,
)

pytestmark = pytest.mark.timeout(420)

HOST = "127.0.0.1"
WORKERS = ("cache", "prefill", "decode", "router")  # no vision: the tiny preset has no encoder to serve
STACK = (*WORKERS, EXPERTS)
# Byte tokenizer: 1100 tokens, two full 512-token blocks (the cache store's unit) and a partial one; restoring
# the second block's checkpoint streams the first block's latents (GetMany).
PROMPT = ("Trace one request through every k3 service, then measure it. " * 20)[:1100]
SERVER_KIND = trace_pb2.Span.SPAN_KIND_SERVER
CLIENT_KIND = trace_pb2.Span.SPAN_KIND_CLIENT


def expected_series(service: str) -> set[str]:
    """Every Prometheus series name ``service`` must export (the catalogue's entries for it)."""
    return {series for metric in mn.catalogue() if metric.emitted
            and (metric.service == "all" or service in metric.service.split(","))
            for series in metric.series}


def scrape(address: str) -> set[str]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


def prometheus_binary() -> str | None:
    if shutil.which("prometheus") is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus not found (apt-get install -y prometheus); CI must run the observability tests")
        return None
    return "prometheus"


@dataclass
class StackRun:
    responses: list[inference_pb2.GenerateResponse]
    scraped: dict[str, set[str]]
    prometheus_series: dict[str, set[str]] | None
    spans: list[tuple[str, trace_pb2.Span]]
    otlp_metrics: dict[str, set[str]]
    log: list[str] = field(default_factory=list)


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.5)


def prometheus_names(prometheus: LocalPrometheus) -> dict[str, set[str]]:
    """Series names per scrape job, from the query API."""
    found: dict[str, set[str]] = {}
    for series in prometheus.query('count by (__name__, job) ({__name__=~"(k3|rpc)_.+"})'):
        found.setdefault(series["metric"]["job"].removeprefix("k3-"), set()).add(series["metric"]["__name__"])
    return found


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> StackRun:
    receiver = OTLPReceiver(HOST).start()
    sections = {name: {"server": {"otlp_endpoint": receiver.endpoint}} for name in STACK}
    config = LaunchConfig(services=sections, preset="tiny", router_port=0, expert_pools=1, host=HOST,
                          startup_timeout=240, stop_grace=30)
    targets: dict[str, str | list[str]] = dict(assign_metrics_ports(config.services, WORKERS, HOST))
    targets[EXPERTS] = assign_pool_metrics_ports(config.services, 1, HOST)
    lines: list[str] = []
    launcher = Launcher(config, emit=lines.append)
    prometheus = None
    if prometheus_binary() is not None:
        prometheus = LocalPrometheus(ObserveConfig(host=HOST, port=0, scrape_interval_s=1.0,
                                                   data_dir=str(tmp_path_factory.mktemp("prometheus"))), targets)
    try:
        address = launcher.start()
        if prometheus is not None:
            prometheus.start()
        with grpc.insecure_channel(address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            for request_id in ("warm-up", "traced"):
                request = inference_pb2.GenerateRequest(
                    request_id=request_id, prompt=PROMPT,
                    sampling=inference_pb2.SamplingParams(max_tokens=6, temperature=0.0))
                responses = list(stub.Generate(request, timeout=180))
        addresses = {name: target if isinstance(target, str) else target[0] for name, target in targets.items()}
        scraped = {name: scrape(addresses[name]) for name in STACK}
        series = None
        if prometheus is not None:
            wanted = {name: expected_series(name) for name in STACK}

            def complete():
                found = prometheus_names(prometheus)
                return found if all(wanted[n] <= found.get(n, set()) for n in STACK) else None

            try:
                series = wait_for(complete, 90, "every k3 series in Prometheus")
            except AssertionError:
                series = prometheus_names(prometheus)  # the test names what is missing
    finally:
        if prometheus is not None:
            prometheus.stop()
        launcher.stop()  # SIGTERM: each service flushes its span and metric exporters on the way out
        receiver.stop()
    return StackRun(responses, scraped, series, list(receiver.spans), receiver.metric_names, lines)


def test_the_request_was_served(run):
    assert run.responses and run.responses[-1].finish_reason in ("stop", "length")
    generated = sum(len(r.token_ids) for r in run.responses)
    assert generated >= 2, "TPOT needs two tokens or more"
    assert run.responses[-1].usage.completion_tokens == generated
    assert run.responses[-1].usage.prompt_tokens == len(PROMPT)
    assert run.responses[-1].usage.cached_prompt_tokens == 1024  # the first request's blocks, restored


@pytest.mark.parametrize("service", STACK)
def test_every_declared_metric_is_on_the_service_metrics_endpoint(run, service):
    missing = expected_series(service) - run.scraped[service]
    assert not missing, f"{service} does not export {sorted(missing)}"


@pytest.mark.parametrize("service", STACK)
def test_prometheus_finds_every_declared_metric(run, service):
    if run.prometheus_series is None:
        pytest.skip("prometheus not installed")
    missing = expected_series(service) - run.prometheus_series.get(service, set())
    assert not missing, f"Prometheus has no {sorted(missing)} from job k3-{service}"


def test_every_emitted_entry_is_checked_somewhere():
    """Entries of services outside the stack are covered by their own tests; none may be left unchecked."""
    elsewhere = {"rollout": "test_rl_metrics.py", "trainer": "test_rl_metrics.py", "planner": "test_planner_kube.py"}
    for metric in mn.catalogue():
        if not metric.emitted:
            continue
        services = set(metric.service.split(","))
        assert metric.service == "all" or services & set(STACK) or services <= set(elsewhere), metric.name


def test_metrics_are_exported_over_otlp_too(run):
    assert {f"k3-{name}" for name in STACK} <= set(run.otlp_metrics)
    assert mn.TTFT.name in run.otlp_metrics["k3-router"]
    assert mn.KDA_STATE_MEMORY.name in run.otlp_metrics["k3-decode"]
    assert mn.EXPERT_LOAD.name in run.otlp_metrics["k3-experts"]


def test_one_trace_spans_every_service_with_correct_parents(run):
    roots = sorted((span for service, span in run.spans
                    if service == "k3-router" and span.kind == SERVER_KIND and span.name == "k3.v1.Inference/Generate"),
                   key=lambda span: span.start_time_unix_nano)
    assert len(roots) == 2, [span.name for _, span in run.spans]
    root = roots[1]  # the second request: it also restores from the cache store
    assert not root.parent_span_id  # the test's own channel is not traced: the router starts the trace
    trace = [(service, span) for service, span in run.spans if span.trace_id == root.trace_id]
    by_id = {span.span_id: (service, span) for service, span in trace}
    assert len(by_id) == len(trace)
    assert {service for service, _ in trace} == {f"k3-{name}" for name in STACK}

    for service, span in trace:
        if span is root:
            continue
        assert span.parent_span_id in by_id, f"{service} {span.name}: its parent is not in the trace"
        parent_service, parent = by_id[span.parent_span_id]
        if span.kind == SERVER_KIND:  # a hop: the caller's client span for the same method, in another process
            assert parent.kind == CLIENT_KIND and parent.name == span.name, (service, span.name, parent.name)
            assert parent_service != service
        else:  # client and internal spans are made inside their own process
            assert parent_service == service, (service, span.name, parent_service, parent.name)

    def hops(method: str) -> set[tuple[str, str]]:
        """(caller, callee) service pairs of the ``method`` calls in the trace."""
        return {(by_id[span.parent_span_id][0], service) for service, span in trace
                if span.kind == SERVER_KIND and span.name == method}

    assert hops("k3.v1.Prefill/Prefill") == {("k3-router", "k3-prefill")}
    assert hops("k3.v1.Decode/Stream") == {("k3-router", "k3-decode")}  # server-streaming
    assert hops("k3.v1.Decode/Handoff") == {("k3-prefill", "k3-decode")}  # the state hand-off (client stream)
    assert hops("k3.v1.ExpertPool/Compute") == {("k3-prefill", "k3-experts"), ("k3-decode", "k3-experts")}
    assert ("k3-decode", "k3-cache") in hops("k3.v1.CacheStore/Put")  # the end-of-turn checkpoint
    assert ("k3-prefill", "k3-cache") in hops("k3.v1.CacheStore/Put")  # the prompt's checkpoints
    assert ("k3-router", "k3-cache") in hops("k3.v1.CacheStore/Lookup")  # prefix-affinity routing
    assert hops("k3.v1.CacheStore/GetMany") == {("k3-prefill", "k3-cache")}  # server-streaming restore

    # Decode's expert calls hang under the engine's step span, itself under the Decode/Stream server span.
    steps = [span for service, span in trace if service == "k3-decode" and span.name == "k3.engine.decode_step"]
    assert steps
    for step in steps:
        assert by_id[step.parent_span_id][1].name == "k3.v1.Decode/Stream"
