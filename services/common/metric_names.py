"""The metrics k3 services record: one catalogue for code, dashboards, alert rules and the planner.

Each ``MetricName`` is an OpenTelemetry instrument (name, kind, unit, labels) plus the name it gets in
Prometheus, which is what PromQL in ``ops/`` and in the planner refers to.

Design decisions:

- Names are ``k3.<component>.<what>`` (``rpc.server.*`` for the server interceptor, after the OpenTelemetry
  RPC conventions); units are UCUM as OpenTelemetry wants them: ``s``, ``By``, ``1``, or a ``{annotation}``
  for counts.
- The Prometheus name follows the OpenTelemetry-to-Prometheus rules of the in-process exporter
  (``k3.services.common.prometheus``, what Prometheus scrapes): dots become underscores, the unit is appended
  (``_seconds``, ``_bytes``; annotations and ``1`` add nothing), counters end in ``_total``. A test exports
  every entry through the real exporter and checks the name. Counts are annotated (``{request}``), never
  ``1``: the collector's Prometheus exporter appends ``_ratio`` to gauges of unit ``1``, so only true ratios
  (imbalance, busy fraction) carry it, and only those are named differently through the collector.
- Latency histograms carry explicit bucket boundaries in seconds (the SDK's defaults are sized for
  milliseconds); ``instrument`` passes them as advice.
- Every entry is recorded by the service named in ``service`` (``emitted`` True); a test runs the services,
  sends traffic and finds each one on their ``/metrics``. An entry may be declared ahead of its first
  recorder with ``emitted`` False (dashboards and rules can show it already); that recorder must use it.
- Services record through ``instrument`` (or the same name, kind and unit), so the Prometheus name here is
  the one they export.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum

from opentelemetry import metrics

_UNIT_SUFFIX = {"s": "seconds", "By": "bytes", "1": ""}
_ANNOTATION = re.compile(r"^\{[a-z_]+\}$")
_NAME = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+$")

#: latency buckets (seconds) from 5 ms to 2 minutes
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
#: per-token latency buckets (seconds) from 1 ms to 1 s
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.0)


class Kind(str, Enum):
    COUNTER = "counter"
    UP_DOWN_COUNTER = "up_down_counter"
    GAUGE = "gauge"  # an observable gauge, read when the meter collects
    HISTOGRAM = "histogram"


@dataclass(frozen=True)
class MetricName:
    name: str
    """OpenTelemetry instrument name."""
    kind: Kind
    unit: str
    """UCUM unit: ``s``, ``By``, ``1`` or a ``{annotation}``."""
    description: str
    service: str
    """The service recording it (``router``, ``decode``, ...; ``all`` for the server interceptor)."""
    labels: tuple[str, ...] = ()
    """Attribute keys as OpenTelemetry names them (Prometheus turns dots into underscores)."""
    buckets: tuple[float, ...] | None = None
    """Explicit histogram boundaries; histograms only."""
    emitted: bool = True
    """False while no service records it yet (the dashboards already show it)."""

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"name: {self.name!r} is not a dotted lower-case name")
        if self.unit not in _UNIT_SUFFIX and not _ANNOTATION.match(self.unit):
            raise ValueError(f"unit of {self.name}: {self.unit!r} is not s, By, 1 or a {{annotation}}")
        if (self.buckets is not None) != (self.kind is Kind.HISTOGRAM):
            raise ValueError(f"buckets of {self.name}: histograms need them, other kinds must not have them")
        if self.buckets is not None and list(self.buckets) != sorted(set(self.buckets)):
            raise ValueError(f"buckets of {self.name}: must be strictly increasing")

    @property
    def prometheus(self) -> str:
        """The Prometheus metric (family) name; histograms add ``_bucket``/``_sum``/``_count`` to it."""
        name = self.name.replace(".", "_")
        suffix = _UNIT_SUFFIX.get(self.unit, "")
        if suffix and not name.endswith(f"_{suffix}"):
            name = f"{name}_{suffix}"
        return f"{name}_total" if self.kind is Kind.COUNTER else name

    @property
    def series(self) -> tuple[str, ...]:
        """Every series name Prometheus stores for it."""
        if self.kind is Kind.HISTOGRAM:
            return tuple(f"{self.prometheus}_{part}" for part in ("bucket", "sum", "count"))
        return (self.prometheus,)

    def instrument(self, meter: metrics.Meter, callbacks=()):
        """Create this instrument on ``meter`` (``callbacks`` for gauges)."""
        if self.kind is Kind.COUNTER:
            return meter.create_counter(self.name, unit=self.unit, description=self.description)
        if self.kind is Kind.UP_DOWN_COUNTER:
            return meter.create_up_down_counter(self.name, unit=self.unit, description=self.description)
        if self.kind is Kind.GAUGE:
            return meter.create_observable_gauge(self.name, callbacks=list(callbacks), unit=self.unit,
                                                 description=self.description)
        return meter.create_histogram(self.name, unit=self.unit, description=self.description,
                                      explicit_bucket_boundaries_advisory=list(self.buckets or ()))


def _m(name, kind, unit, description, service, labels=(), buckets=None, emitted=True) -> MetricName:
    return MetricName(name, kind, unit, description, service, tuple(labels), buckets, emitted)


C, U, G, H = Kind.COUNTER, Kind.UP_DOWN_COUNTER, Kind.GAUGE, Kind.HISTOGRAM
RPC = ("rpc.service", "rpc.method")

# --- every gRPC server (k3.services.common.interceptors) ---------------------------------------------------
RPC_REQUESTS = _m("rpc.server.requests", C, "{request}", "RPCs handled, by final status", "all",
                  (*RPC, "rpc.grpc.status_code"))
RPC_DURATION = _m("rpc.server.duration", H, "s", "Time from the start of an RPC to its last message", "all",
                  (*RPC, "rpc.grpc.status_code"), LATENCY_BUCKETS)
RPC_ACTIVE = _m("rpc.server.active_requests", U, "{request}", "RPCs in flight", "all", RPC)

# --- router: latency seen by clients, usage and cache hits -----------------------------------------------
TTFT = _m("k3.router.ttft", H, "s", "Time to first token: request received to first token sent", "router",
          ("k3.request.kind",), LATENCY_BUCKETS)
TPOT = _m("k3.router.tpot", H, "s", "Time per output token after the first, per request", "router",
          ("k3.request.kind",), TOKEN_LATENCY_BUCKETS)
ROUTER_REQUESTS = _m("k3.router.requests", C, "{request}", "Finished requests", "router", ("k3.request.kind",))
PROMPT_TOKENS = _m("k3.router.prompt_tokens", C, "{token}", "Prompt tokens of finished requests", "router",
                   ("k3.request.kind",))
CACHED_PROMPT_TOKENS = _m("k3.router.cached_prompt_tokens", C, "{token}",
                          "Prompt tokens served from the cache store (hit ratio = cached / prompt)", "router",
                          ("k3.request.kind",))
COMPLETION_TOKENS = _m("k3.router.completion_tokens", C, "{token}", "Generated tokens", "router",
                       ("k3.request.kind",))

# --- prefill and decode engines (k3.services.engine.metrics) ----------------------------------------------
ENGINE_TOKENS = _m("k3.engine.tokens", C, "{token}", "Tokens run through the model (tokens/s = rate)",
                   "prefill,decode", ("phase",))
ENGINE_QUEUED = _m("k3.engine.queued", G, "{request}", "Requests waiting for a slot or pages (queue length)",
                   "prefill,decode")
ENGINE_RUNNING = _m("k3.engine.running", G, "{sequence}", "Sequences prefilling or decoding", "prefill,decode")
# The slot pool and the paged latent cache belong to the continuous-batching engine (decode); a prefill worker
# holds one state per running prompt and keeps no pools.
ENGINE_FREE_SLOTS = _m("k3.engine.free_slots", G, "{slot}", "Free KDA state slots", "decode")
ENGINE_FREE_PAGES = _m("k3.engine.free_pages", G, "{page}", "Free MLA latent pages", "decode")
KDA_STATE_MEMORY = _m("k3.engine.kda_state_memory", G, "By",
                      "Bytes of fixed-size KDA + conv state held by live sequences (slots in use)", "decode")
KV_LATENT_MEMORY = _m("k3.engine.kv_latent_memory", G, "By",
                      "Bytes of paged MLA latent cache in use (pages taken by live sequences)", "decode")

# --- cache store ----------------------------------------------------------------------------------------
CACHE_LOOKUP_BLOCKS = _m("k3.cache.lookup_blocks", C, "{block}", "Blocks asked for in lookups", "cache")
CACHE_HIT_BLOCKS = _m("k3.cache.hit_blocks", C, "{block}", "Blocks found by lookups (hit ratio = hit / lookup)",
                      "cache")

# --- expert pools (k3.services.experts) ---------------------------------------------------------------
EXPERT_ROWS = _m("k3.experts.pool.rows", C, "{row}", "Latent rows computed, by layer and replica flag "
                 "(per-pool expert load; tokens/s = rate)", "experts", ("layer", "replica", "shard"))
EXPERT_LOAD = _m("k3.experts.pool.expert_rows", C, "{row}", "Latent rows computed per expert over all layers "
                 "(per-expert load)", "experts", ("expert", "shard"))
EXPERT_POOL_LOAD = _m("k3.expert_pool.load", G, "1", "Compute calls in progress on average over the last "
                      "load_window_s (busy fraction; above 1 when calls overlap): the pool's autoscaling signal",
                      "experts", ("shard",))
EXPERT_IMBALANCE = _m("k3.experts.pool.imbalance", G, "1", "max/mean of rows over the pool's home experts",
                      "experts", ("shard",))
EXPERT_REPLICAS = _m("k3.experts.pool.replicas", G, "{replica}", "Foreign (layer, expert) replicas hosted", "experts",
                     ("shard",))
EXPERT_CLIENT_IMBALANCE = _m("k3.experts.client.imbalance", G, "1", "max/mean of rows sent across shards",
                             "prefill,decode")

# --- reinforcement learning ---------------------------------------------------------------------------
# (recorded through k3.services.common.rl_metrics)
RL_REWARD = _m("k3.rl.reward", H, "1", "Verifier reward per finished trajectory, in [0, 1]", "rollout", ("task",),
               (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0))
RL_STALENESS = _m("k3.rl.staleness", H, "{version}",
                  "Weight versions between generating a trajectory and learning from it", "trainer", (),
                  (0.0, 1.0, 2.0, 3.0, 4.0, 8.0, 16.0))

# --- planner ----------------------------------------------------------------------------------------
PLANNER_DESIRED = _m("k3.planner.desired_replicas", G, "{replica}", "Replicas the planner wants, by deployment",
                     "planner", ("deployment",))
PLANNER_SCALINGS = _m("k3.planner.scalings", C, "{change}", "Replica changes applied (or logged in dry run)",
                      "planner", ("deployment", "direction"))


def catalogue() -> Iterator[MetricName]:
    """Every ``MetricName`` defined in this module, in definition order."""
    for value in globals().values():
        if isinstance(value, MetricName):
            yield value


def by_prometheus_name() -> dict[str, MetricName]:
    """Every stored series name (histogram parts included) -> its entry."""
    return {series: metric for metric in catalogue() for series in metric.series}
