"""``k3 serve planner``: scales expert pools and decode replicas from their load, through the Kubernetes API.

Every ``interval_s`` the planner, for each configured target (a Deployment): reads its replica count
(``scale`` subresource), reads its load signals from Prometheus (``source``), asks ``decisions.decide``, and
patches the replica count when the decision changes it. In ``dry_run`` it only logs what it would do (it
still reads replica counts, so the log shows real decisions).

Design decisions:

- One thread runs the loop; the gRPC server carries only health and reflection (the planner has no RPCs of
  its own), which is what the Deployment's probes need. Stopping the server stops the loop.
- One target failing (Prometheus down, Deployment missing, a 403) is logged and skipped for the interval;
  the others are still planned. The decision state of a target is kept across intervals (that is the
  hysteresis) and reset when a change is applied.
- The planner records ``k3.planner.desired_replicas`` and ``k3.planner.scalings`` itself.
- Targets are a list in the config file; each is validated like a config section, errors naming
  ``planner.targets[i].<field>``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.metrics import CallbackOptions, Observation

from k3.services.common import metric_names as mn
from k3.services.common.config import ConfigError, ServerConfig, documented, load_config
from k3.services.common.telemetry import Telemetry, setup_telemetry
from k3.services.planner.decisions import Decision, Policy, ScalerState, Signals, decide
from k3.services.planner.kube import DeploymentScaler, KubeError, api_client
from k3.services.planner.source import KINDS, PrometheusSource, SourceError, check_selector, signal_queries
from k3.services.registry import ServiceSpec

log = logging.getLogger(__name__)


@dataclass
class ScaleTarget:
    """One Deployment the planner scales."""

    deployment: str = documented("", doc="Deployment name in the planner's namespace.")
    kind: str = documented("decode", doc="experts (an expert pool) or decode: which signals to read.")
    selector: str = documented(
        "", doc='PromQL label matchers picking this Deployment\'s series, e.g. job="k3-experts-0".')
    policy: Policy = documented(default_factory=Policy, doc="Targets, bounds and hysteresis.")

    def __post_init__(self) -> None:
        if not self.deployment:
            raise ConfigError("is required", field="deployment")
        if self.kind not in KINDS:
            raise ConfigError(f"must be one of {', '.join(KINDS)}, got {self.kind!r}", field="kind")
        try:
            check_selector(self.selector)
        except ValueError as exc:
            raise ConfigError(str(exc), field="selector") from None
        p = self.policy
        used = ("target_tokens_per_s",) if self.kind == "experts" else (
            "target_tokens_per_s", "target_queue_length", "target_ttft_p95_s")
        if all(getattr(p, name) is None for name in used):
            raise ConfigError(f"needs at least one of {', '.join(used)} for kind {self.kind}", field="policy")


@dataclass
class PlannerConfig:
    """What the planner watches and how often."""

    interval_s: float = documented(15.0, doc="Seconds between planning rounds.")
    dry_run: bool = documented(True, doc="Only log decisions; never patch a Deployment.")
    prometheus_url: str = documented("http://127.0.0.1:9090", doc="Prometheus server the signals come from.")
    rate_window: str = documented("1m", doc="PromQL window for rates and quantiles (>= 2 scrape intervals).")
    query_timeout_s: float = documented(5.0, doc="Seconds one Prometheus or Kubernetes request may take.")
    namespace: str = documented("default", doc="Namespace of the target Deployments.")
    kubeconfig: str | None = documented(
        None, doc="Kubeconfig file; unset = the pod's service account (in-cluster).")
    kube_context: str | None = documented(None, doc="Context in the kubeconfig; unset = its current one.")
    targets: list[ScaleTarget] = documented(default_factory=list, doc="The Deployments to scale.")

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ConfigError(f"must be > 0, got {self.interval_s}", field="interval_s")
        if not self.query_timeout_s > 0:
            raise ConfigError(f"must be > 0, got {self.query_timeout_s}", field="query_timeout_s")
        if not self.namespace:
            raise ConfigError("must not be empty", field="namespace")
        try:
            signal_queries("decode", "", self.rate_window)
            PrometheusSource(self.prometheus_url)
        except ValueError as exc:
            field = "rate_window" if "window" in str(exc) else "prometheus_url"
            raise ConfigError(str(exc), field=field) from None
        self.targets = [self._target(i, t) for i, t in enumerate(self.targets)]
        names = [t.deployment for t in self.targets]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise ConfigError(f"deployment {name!r} is listed twice", field=f"targets[{i}].deployment")

    @staticmethod
    def _target(i: int, value: Any) -> ScaleTarget:
        if isinstance(value, ScaleTarget):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"must be a mapping, got {type(value).__name__}", field=f"targets[{i}]")
        try:
            # The file's mapping, validated by the same loader as any section (types, unknown keys).
            return load_config(ScaleTarget, env={}, overrides=value)
        except ConfigError as exc:
            field = f"targets[{i}].{exc.field}" if exc.field else f"targets[{i}]"
            raise ConfigError(exc.reason, field=field) from None


@dataclass
class PlannerServiceConfig:
    """Configuration of ``k3 serve planner``."""

    server: ServerConfig = documented(default_factory=ServerConfig, doc="How the gRPC server listens.")
    planner: PlannerConfig = documented(default_factory=PlannerConfig, doc="Targets and the planning loop.")


class Planner:
    """The planning loop over a replica reader/writer and a signal source (``run_once`` is one round)."""

    def __init__(self, config: PlannerConfig, scaler, source, telemetry: Telemetry | None = None,
                 clock=time.monotonic):
        self.config = config
        self._scaler = scaler
        self._source = source
        self._clock = clock
        self._queries = {t.deployment: signal_queries(t.kind, t.selector, config.rate_window)
                         for t in config.targets}
        self._states = {t.deployment: ScalerState() for t in config.targets}
        self._desired: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        meter = (telemetry or Telemetry()).meter()
        mn.PLANNER_DESIRED.instrument(meter, callbacks=[self._observe_desired])
        self._scalings = mn.PLANNER_SCALINGS.instrument(meter)

    def _observe_desired(self, options: CallbackOptions):
        with self._lock:
            return [Observation(v, {"deployment": k}) for k, v in self._desired.items()]

    def plan(self, target: ScaleTarget) -> Decision:
        """One decision for ``target`` (reads replicas and signals, applies the change unless dry run)."""
        current = self._scaler.replicas(target.deployment)
        signals: Signals = self._source.signals(self._queries[target.deployment])
        decision = decide(current, signals, target.policy, self._states[target.deployment], self._clock())
        self._states[target.deployment] = decision.state
        with self._lock:
            self._desired[target.deployment] = decision.desired
        if decision.changed:
            direction = "up" if decision.desired > decision.current else "down"
            if self.config.dry_run:
                log.info("dry run: would scale %s from %d to %d (%s)", target.deployment, decision.current,
                         decision.desired, decision.reason)
            else:
                stored = self._scaler.scale(target.deployment, decision.desired)
                log.info("scaled %s from %d to %d (%s)", target.deployment, decision.current, stored,
                         decision.reason)
            self._scalings.add(1, {"deployment": target.deployment, "direction": direction})
        else:
            log.debug("%s stays at %d (%s)", target.deployment, decision.current, decision.reason)
        return decision

    def run_once(self) -> dict[str, Decision | Exception]:
        """Plan every target; a failing one is logged and reported as its exception."""
        results: dict[str, Decision | Exception] = {}
        for target in self.config.targets:
            try:
                results[target.deployment] = self.plan(target)
            except (SourceError, KubeError) as exc:
                log.warning("skipping %s this round: %s", target.deployment, exc)
                results[target.deployment] = exc
        return results

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("planner already started")
        self._thread = threading.Thread(target=self._loop, name="k3-planner", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.run_once()
            self._stop.wait(self.config.interval_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.config.interval_s + 2 * self.config.query_timeout_s)


class PlannerService:
    """The planner as a ``Service``: health only over gRPC; the loop runs while the server does."""

    name = "planner"
    service_names = ()

    def __init__(self, config: PlannerServiceConfig, planner: Planner, telemetry: Telemetry,
                 owns_telemetry: bool = False, close=None):
        self.config = config
        self.planner = planner
        self.telemetry = telemetry
        self._owns_telemetry = owns_telemetry
        self._close = close

    def add_to_server(self, server: grpc.Server) -> None:
        self.planner.start()

    def close(self) -> None:
        self.planner.stop()
        if self._close is not None:
            self._close()
        if self._owns_telemetry:
            self.telemetry.shutdown()


def build(config: PlannerServiceConfig) -> PlannerService:
    pc = config.planner
    scaler = None
    if pc.targets:  # no targets, nothing to scale: do not require cluster credentials
        scaler = DeploymentScaler(api_client(pc.kubeconfig, pc.kube_context), pc.namespace, pc.query_timeout_s)
    try:
        telemetry = setup_telemetry("planner", config.server)
    except BaseException:
        if scaler is not None:
            scaler.close()
        raise
    source = PrometheusSource(pc.prometheus_url, pc.query_timeout_s)
    planner = Planner(pc, scaler, source, telemetry)
    log.info("planner: %d target(s) in namespace %s, every %gs%s", len(pc.targets), pc.namespace,
             pc.interval_s, " (dry run)" if pc.dry_run else "")
    return PlannerService(config, planner, telemetry, owns_telemetry=True,
                          close=scaler.close if scaler is not None else None)


SPEC = ServiceSpec(config_type=PlannerServiceConfig, build=build)
