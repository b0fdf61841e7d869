"""The ``k3.v1.ExpertPool`` service (``k3 serve experts --shard i/n``): one shard of the routed experts.

A pool hosts, for every MoE layer, the experts homed on its shard (E/n contiguous ids), loaded alone from the
model source (``weights``), plus temporary *replicas* of foreign experts that MoonEP placement sends it.

- ``Compute(layer, expert_ids, counts, tokens)``: ``tokens`` [Σcounts, latent] are the latent rows sorted by
  expert; each expert runs SiTU-GLU (latent -> inter -> latent) on its rows; the outputs come back in the same
  row order. Validation before any work: an unknown layer, an expert id out of range, a duplicate id, counts
  not matching the ids or the rows, a wrong dtype or width are INVALID_ARGUMENT naming the field; an expert
  that exists but is not hosted here is FAILED_PRECONDITION (``EXPERT_NOT_HOSTED``, naming layer and expert),
  which tells the client to replicate it here or go elsewhere.
- ``FetchExpert``: one hosted expert's weights, for a pool that replicates it.
- ``Replicate(add, drop)``: each added replica is fetched from its ``sources`` (pools, tried in order, each
  under ``fetch_timeout_s``) or, when none answers, read from this pool's own model source -- every pool has
  the checkpoint, so a dead home pool never makes an expert unreachable. Home experts cannot be dropped.
- ``PoolStats``: rows per (layer, expert), requests, replicas, imbalance over the home experts.

Design decisions:

- Weights live in a dict keyed by (layer, expert) under a lock; Compute takes references under the lock and
  computes outside it, so a replica dropped mid-call only goes away after that call.
- Telemetry: OpenTelemetry counters of rows and requests, and gauges of replicas, imbalance and load, from the
  process's ``Telemetry`` (no-op unless an OTLP endpoint, ``server.metrics_port`` or a test reader is
  configured). The load gauge ``k3.expert_pool.load`` (Prometheus ``k3_expert_pool_load``) is the average
  number of Compute calls in progress over ``load_window_s`` (``stats.BusyMeter``): the metric the expert
  pools' HPAs in ``charts/k3`` scale on.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import grpc
import torch
from opentelemetry.metrics import Observation

from k3.model.situ import situ_glu
from k3.protos.v1 import experts_pb2, experts_pb2_grpc
from k3.services.common import metric_names as mn
from k3.services.common import tensors
from k3.services.common.client import make_channel
from k3.services.common.config import ConfigError, ServerConfig, documented
from k3.services.common.errors import FailedPrecondition, InvalidArgument
from k3.services.common.telemetry import Telemetry, setup_telemetry
from k3.services.engine.model_source import ModelSourceConfig
from k3.services.experts.placement import home_experts, parse_shard
from k3.services.experts.stats import BusyMeter, imbalance
from k3.services.experts.weights import ExpertKey, ExpertWeights
from k3.services.registry import ServiceSpec

log = logging.getLogger(__name__)

SERVICE_NAME = experts_pb2.DESCRIPTOR.services_by_name["ExpertPool"].full_name


@dataclass
class ExpertsServiceConfig:
    """Configuration of ``k3 serve experts``."""

    server: ServerConfig = documented(default_factory=ServerConfig, doc="How the gRPC server listens.")
    model: ModelSourceConfig = documented(
        default_factory=ModelSourceConfig,
        doc="The model whose routed experts are served (checkpoint, or preset + seed, as prefill/decode).",
    )
    shard: str = documented("0/1", doc="i/n: host the experts homed on shard i of n (E/n contiguous ids).")
    fetch_timeout_s: float = documented(10.0, doc="Time limit of each FetchExpert call made to replicate.")
    load_window_s: float = documented(
        60.0, doc="Window of the load gauge k3.expert_pool.load (Compute calls in progress on average), which "
        "the expert pools' autoscalers target.")

    def __post_init__(self) -> None:
        try:
            parse_shard(self.shard)
        except ValueError as exc:
            raise ConfigError(str(exc), field="shard") from None
        for name in ("fetch_timeout_s", "load_window_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"must be > 0, got {getattr(self, name)}", field=name)
        if self.model.expert_pools:
            raise ConfigError("an expert pool computes its experts itself; leave it empty",
                              field="model.expert_pools")


class ExpertPool:
    """The experts one pool hosts, their statistics, and the compute (thread-safe)."""

    def __init__(self, config: ExpertsServiceConfig, weights: ExpertWeights | None = None,
                 telemetry: Telemetry | None = None):
        self.config = config
        self.shard_index, self.shard_count = parse_shard(config.shard)
        self.source = weights or ExpertWeights(config.model)
        cfg = self.source.cfg
        self.cfg = cfg
        self.home = home_experts(self.shard_index, self.shard_count, cfg.num_experts)
        self.layers = self.source.moe_layers
        self._lock = threading.Lock()
        self._weights: dict[ExpertKey, tuple[torch.Tensor, torch.Tensor]] = self.source.load(
            (layer, e) for layer in self.layers for e in self.home
        )
        self._replicas: set[ExpertKey] = set()
        self._rows: dict[ExpertKey, int] = {}
        self._requests = 0
        self.busy = BusyMeter(config.load_window_s)
        meter = (telemetry or Telemetry()).meter()
        self._rows_counter = mn.EXPERT_ROWS.instrument(meter)
        self._expert_rows_counter = mn.EXPERT_LOAD.instrument(meter)  # the per-expert load
        self._requests_counter = meter.create_counter(
            "k3.experts.pool.requests", unit="{request}", description="Compute calls served.")
        mn.EXPERT_REPLICAS.instrument(meter, callbacks=[self._observe_replicas])
        mn.EXPERT_IMBALANCE.instrument(meter, callbacks=[self._observe_imbalance])
        # Prometheus: k3_expert_pool_load, the Pods metric of the expert pools' HPAs (charts/k3).
        mn.EXPERT_POOL_LOAD.instrument(meter, callbacks=[self._observe_load])

    # -- validation ------------------------------------------------------------------------------------------
    def check_layer(self, layer: int, field: str = "layer") -> int:
        if layer not in self.layers:
            raise InvalidArgument(field, f"layer {layer} is not an MoE layer of the model (MoE layers: "
                                  f"{list(self.layers)})", reason="UNKNOWN_LAYER")
        return layer

    def check_expert(self, expert: int, field: str) -> int:
        if not 0 <= expert < self.cfg.num_experts:
            raise InvalidArgument(field, f"expert {expert} does not exist (the model has "
                                  f"{self.cfg.num_experts} experts)", reason="UNKNOWN_EXPERT")
        return expert

    def _hosted(self, keys: list[ExpertKey], fields: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        with self._lock:
            found = [self._weights.get(key) for key in keys]
        for (layer, expert), weights, field in zip(keys, found, fields, strict=True):
            if weights is None:
                raise FailedPrecondition(
                    f"expert {expert} of layer {layer} is not hosted by pool shard {self.config.shard} "
                    f"(home experts {self.home.start}..{self.home.stop - 1}; no replica)",
                    field=field, reason="EXPERT_NOT_HOSTED")
        return found

    # -- compute ---------------------------------------------------------------------------------------------
    def compute(self, request: experts_pb2.ExpertComputeRequest) -> torch.Tensor:
        self.busy.enter()
        try:
            return self._compute(request)
        finally:
            self.busy.exit()

    def _compute(self, request: experts_pb2.ExpertComputeRequest) -> torch.Tensor:
        layer = self.check_layer(request.layer)
        ids, counts = list(request.expert_ids), list(request.counts)
        if len(counts) != len(ids):
            raise InvalidArgument("counts", f"has {len(counts)} entries for {len(ids)} expert_ids (one count "
                                  "per expert)", reason="COUNTS_MISMATCH")
        seen: set[int] = set()
        for i, (expert, count) in enumerate(zip(ids, counts, strict=True)):
            self.check_expert(expert, f"expert_ids[{i}]")
            if expert in seen:
                raise InvalidArgument(f"expert_ids[{i}]", f"expert {expert} is listed twice",
                                      reason="DUPLICATE_EXPERT")
            seen.add(expert)
            if count < 0:
                raise InvalidArgument(f"counts[{i}]", f"must be >= 0, got {count}", reason="BAD_COUNT")
        if not request.HasField("tokens"):
            raise InvalidArgument("tokens", "is required", reason="MISSING_FIELD")
        x = tensors.from_proto(request.tokens, "tokens", copy=False)
        expected_dtype = tensors.dtype_name(self.source.dtype)
        if request.tokens.dtype != expected_dtype:
            raise InvalidArgument("tokens.dtype", f"must be {expected_dtype} (the pool's model dtype), got "
                                  f"{request.tokens.dtype}", reason="BAD_DTYPE")
        latent = self.cfg.latent_size
        if x.dim() != 2 or x.shape[1] != latent:
            raise InvalidArgument("tokens.shape", f"must be [rows, {latent}], got {list(x.shape)}",
                                  reason="BAD_SHAPE")
        if x.shape[0] != sum(counts):
            raise InvalidArgument("tokens.shape", f"has {x.shape[0]} rows but counts sum to {sum(counts)}",
                                  reason="BAD_SHAPE")
        weights = self._hosted([(layer, e) for e in ids], [f"expert_ids[{i}]" for i in range(len(ids))])
        x = x.to(self.source.device)
        out = torch.empty_like(x)
        inter = self.cfg.expert_intermediate_size
        start = 0
        with torch.no_grad():
            for count, (w_in, w_out) in zip(counts, weights, strict=True):
                if count:
                    rows = x[start:start + count]
                    gate, linear = (rows @ w_in.t()).split(inter, dim=-1)
                    out[start:start + count] = situ_glu(gate, linear, self.cfg.situ_beta1,
                                                        self.cfg.situ_beta2) @ w_out.t()
                start += count
        self._record(layer, ids, counts)
        return out

    def _record(self, layer: int, ids: list[int], counts: list[int]) -> None:
        with self._lock:
            self._requests += 1
            replica_rows = home_rows = 0
            for expert, count in zip(ids, counts, strict=True):
                key = (layer, expert)
                self._rows[key] = self._rows.get(key, 0) + count
                if expert in self.home:
                    home_rows += count
                else:
                    replica_rows += count
        attrs = {"layer": layer, "shard": self.config.shard}
        self._requests_counter.add(1, {"shard": self.config.shard})
        for expert, count in zip(ids, counts, strict=True):
            if count:
                self._expert_rows_counter.add(count, {"expert": expert, "shard": self.config.shard})
        if home_rows:
            self._rows_counter.add(home_rows, {**attrs, "replica": False})
        if replica_rows:
            self._rows_counter.add(replica_rows, {**attrs, "replica": True})

    # -- replicas --------------------------------------------------------------------------------------------
    def fetch(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.check_layer(layer)
        self.check_expert(expert, "expert")
        return self._hosted([(layer, expert)], ["expert"])[0]

    def replicate(self, request: experts_pb2.ReplicateRequest) -> experts_pb2.ReplicateResponse:
        adds: list[tuple[ExpertKey, list[str]]] = []
        for i, spec in enumerate(request.add):
            self.check_layer(spec.layer, f"add[{i}].layer")
            self.check_expert(spec.expert, f"add[{i}].expert")
            adds.append(((spec.layer, spec.expert), list(spec.sources)))
        drops: list[ExpertKey] = []
        for i, ref in enumerate(request.drop):
            self.check_layer(ref.layer, f"drop[{i}].layer")
            self.check_expert(ref.expert, f"drop[{i}].expert")
            if ref.expert in self.home:
                raise FailedPrecondition(f"expert {ref.expert} is a home expert of shard {self.config.shard}; "
                                         "only replicas can be dropped", field=f"drop[{i}].expert",
                                         reason="HOME_EXPERT")
            drops.append((ref.layer, ref.expert))
        with self._lock:
            wanted = [(key, sources) for key, sources in adds if key not in self._weights]
        fetched: dict[ExpertKey, tuple[torch.Tensor, torch.Tensor]] = {}
        for key, sources in wanted:
            got = self._fetch_from(key, sources)
            if got is not None:
                fetched[key] = got
        missing = [key for key, _ in wanted if key not in fetched]
        loaded = self.source.load(missing) if missing else {}
        with self._lock:
            for key, weights in {**fetched, **loaded}.items():
                if key not in self._weights:
                    self._weights[key] = weights
                    self._replicas.add(key)
            dropped = 0
            for key in drops:
                if key in self._replicas:
                    self._replicas.discard(key)
                    del self._weights[key]
                    dropped += 1
            replicas = sorted(self._replicas)
        if wanted or dropped:
            log.info("shard %s: %d replica(s) fetched, %d loaded from the model source, %d dropped",
                     self.config.shard, len(fetched), len(loaded), dropped)
        return experts_pb2.ReplicateResponse(
            fetched=len(fetched), loaded=len(loaded), dropped=dropped,
            replicas=[experts_pb2.ExpertRef(layer=layer, expert=e) for layer, e in replicas])

    def _fetch_from(self, key: ExpertKey, sources: list[str]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The expert's weights from the first source that answers correctly, or None."""
        layer, expert = key
        inter, latent = self.cfg.expert_intermediate_size, self.cfg.latent_size
        for address in sources:
            try:
                with make_channel(address, self.config.server) as channel:
                    reply = experts_pb2_grpc.ExpertPoolStub(channel).FetchExpert(
                        experts_pb2.FetchExpertRequest(layer=layer, expert=expert),
                        timeout=self.config.fetch_timeout_s)
                w_in = tensors.from_proto(reply.w_in, "w_in")
                w_out = tensors.from_proto(reply.w_out, "w_out")
            except (grpc.RpcError, InvalidArgument) as exc:
                log.warning("fetching expert %d of layer %d from %s failed: %s", expert, layer, address, exc)
                continue
            if tuple(w_in.shape) != (2 * inter, latent) or tuple(w_out.shape) != (latent, inter):
                log.warning("pool %s sent expert %d of layer %d with shapes %s, %s; ignored", address, expert,
                            layer, list(w_in.shape), list(w_out.shape))
                continue
            device, dtype = self.source.device, self.source.dtype
            return w_in.to(device, dtype).contiguous(), w_out.to(device, dtype).contiguous()
        return None

    # -- statistics ------------------------------------------------------------------------------------------
    def stats(self) -> experts_pb2.PoolStatsResponse:
        with self._lock:
            hosted = sorted(self._weights)
            rows = dict(self._rows)
            replicas = len(self._replicas)
            requests = self._requests
        per_home = [sum(rows.get((layer, e), 0) for layer in self.layers) for e in self.home]
        return experts_pb2.PoolStatsResponse(
            shard=self.config.shard, experts=list(self.home), tokens_per_expert=per_home, replicas=replicas,
            shard_index=self.shard_index, shard_count=self.shard_count, num_experts=self.cfg.num_experts,
            layers=list(self.layers), config_hash=self.cfg.config_hash(), rows=sum(rows.values()),
            requests=requests, imbalance=imbalance(per_home),
            loads=[experts_pb2.ExpertLoad(layer=layer, expert=e, rows=rows.get((layer, e), 0),
                                          replica=e not in self.home) for layer, e in hosted])

    def _observe_replicas(self, options):
        with self._lock:
            count = len(self._replicas)
        yield Observation(count, {"shard": self.config.shard})

    def _observe_load(self, options):
        yield Observation(self.busy.load(), {"shard": self.config.shard})

    def _observe_imbalance(self, options):
        with self._lock:
            per_home = [sum(self._rows.get((layer, e), 0) for layer in self.layers) for e in self.home]
        yield Observation(imbalance(per_home), {"shard": self.config.shard})


class ExpertPoolServicer(experts_pb2_grpc.ExpertPoolServicer):
    def __init__(self, pool: ExpertPool):
        self.pool = pool

    def Compute(self, request, context) -> experts_pb2.ExpertComputeResponse:
        return experts_pb2.ExpertComputeResponse(outputs=tensors.to_proto(self.pool.compute(request)))

    def PoolStats(self, request, context) -> experts_pb2.PoolStatsResponse:
        return self.pool.stats()

    def FetchExpert(self, request, context) -> experts_pb2.FetchExpertResponse:
        w_in, w_out = self.pool.fetch(request.layer, request.expert)
        return experts_pb2.FetchExpertResponse(layer=request.layer, expert=request.expert,
                                               w_in=tensors.to_proto(w_in), w_out=tensors.to_proto(w_out))

    def Replicate(self, request, context) -> experts_pb2.ReplicateResponse:
        return self.pool.replicate(request)


class ExpertsService:
    """``k3 serve experts`` as a ``Service``: owns the pool (and its telemetry when it built it)."""

    name = "experts"
    service_names = (SERVICE_NAME,)

    def __init__(self, config: ExpertsServiceConfig, telemetry: Telemetry | None = None,
                 owns_telemetry: bool = False, weights: ExpertWeights | None = None):
        self.config = config
        self.telemetry = telemetry or Telemetry()
        self._owns_telemetry = owns_telemetry
        self.pool = ExpertPool(config, weights=weights, telemetry=self.telemetry)

    def add_to_server(self, server: grpc.Server) -> None:
        experts_pb2_grpc.add_ExpertPoolServicer_to_server(ExpertPoolServicer(self.pool), server)

    def close(self) -> None:
        if self._owns_telemetry:
            self.telemetry.shutdown()


def build(config: ExpertsServiceConfig) -> ExpertsService:
    telemetry = setup_telemetry("experts", config.server)
    return ExpertsService(config, telemetry=telemetry, owns_telemetry=True)


SPEC = ServiceSpec(config_type=ExpertsServiceConfig, build=build)
