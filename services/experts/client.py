"""The expert-pool client: a LatentMoE's routed experts computed on expert pools over gRPC.

``attach_pools(model, addresses)`` sets every MoE layer's ``routed_compute`` hook to one
:class:`ExpertPoolClient`. For each layer call the client

1. sorts the (token, slot) entries by expert, exactly as the local expert loop does;
2. cuts each expert's rows into pieces per shard following the layer's placement (``placement``: the home
   plan at first, then MoonEP over the load observed since the previous plan, recomputed every
   ``replan_interval_s``; shards are MoonEP's ranks);
3. sends one ``Compute`` per (pool, shard) concurrently (gRPC futures, each under ``call_timeout_s``), after
   making sure the pool hosts every expert it gets (a ``Replicate`` call when it does not: the weights come
   from a live home pool, else from the pool's own model source);
4. puts the outputs back in entry order and combines them weighted by the router probabilities, expert by
   expert in the same order as the local loop, so the result equals the local layer's.

This is the CPU/network path used by serving workers. The GPU path -- experts sharded over the ranks of one
job, dispatch and combine as ``all_to_all`` collectives -- is ``k3.model.expert_parallel``.

Pool membership and failures:

- ``set_pools(addresses)`` may run while traffic flows; with a ``pool_file`` (``pool_set``), a thread reads the
  file every ``watch_interval_s`` and applies a changed list the same way. New pools are probed (``PoolStats``) and join when
  they answer; an unreachable one is kept *down* and probed again at the next replan. A removed pool takes no
  new work; a pool already picked for a call, probe or replication keeps its channel until that work returns,
  and the channel is closed then (if the pool itself goes away first, those calls fail and are retried like
  any other failure).
- A call that fails with UNAVAILABLE, DEADLINE_EXCEEDED or CANCELLED marks its pool down and its pieces are
  retried on another pool: the pools of the same shard, else the *adopting* shard (the next shard with a live
  pool), which replicates the experts first. EXPERT_NOT_HOSTED (a replica dropped meanwhile) re-replicates.
  After ``max_attempts`` rounds, or when no pool is live, the call raises ``Unavailable`` listing what failed.
  Every RPC has a deadline, so nothing waits forever. Any other error (INVALID_ARGUMENT, ...) is a mismatch
  between client and pool and raises ``Internal`` at once, without retries.
- Pools must serve the same model: the configuration hash, E and the MoE layers are checked when a pool
  joins (weights are not compared: use the same checkpoint, or the same preset and seed).

Statistics (``stats()``, and OpenTelemetry metrics when a ``Telemetry`` is given): rows sent per pool,
per-expert load per layer, imbalance (max/mean) across shards, replicas in the current placements, retries.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch
from opentelemetry.metrics import Observation
from torch import Tensor

from k3.protos.v1 import experts_pb2, experts_pb2_grpc
from k3.services.common import tensors
from k3.services.common.client import error_detail, make_channel
from k3.services.common.config import ConfigError, ServerConfig, documented
from k3.services.common.errors import Internal, InvalidArgument, Unavailable
from k3.services.common.telemetry import Telemetry
from k3.services.experts.placement import LayerPlacement, adopters, home_experts, plan_placement
from k3.services.experts.pool_set import PoolSetError, read_pool_set
from k3.services.experts.stats import imbalance

log = logging.getLogger(__name__)

_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


@dataclass
class PoolClientConfig:
    """Deadlines, retries and the replanning interval of an :class:`ExpertPoolClient`."""

    call_timeout_s: float = documented(10.0, doc="Deadline of each Compute call.")
    probe_timeout_s: float = documented(5.0, doc="Deadline of each PoolStats probe (joining, re-probing).")
    replicate_timeout_s: float = documented(60.0, doc="Deadline of each Replicate call (may read weights).")
    replan_interval_s: float = documented(
        5.0, doc="Seconds between MoonEP placements from the observed load; 0 = only on replan().")
    max_attempts: int = documented(4, doc="Rounds of retries of one layer call before it fails.")
    watch_interval_s: float = documented(
        1.0, doc="Seconds between reads of the pool set file (model.expert_pools_file), when there is one.")

    def __post_init__(self) -> None:
        for name in ("call_timeout_s", "probe_timeout_s", "replicate_timeout_s", "watch_interval_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"must be > 0, got {getattr(self, name)!r}", field=name)
        if not self.replan_interval_s >= 0:
            raise ConfigError(f"must be >= 0, got {self.replan_interval_s!r}", field="replan_interval_s")
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ConfigError(f"must be a positive integer, got {self.max_attempts!r}", field="max_attempts")


@dataclass(eq=False)
class _Pool:
    """One pool as the client sees it. Mutable fields are guarded by the client's lock."""

    address: str
    channel: grpc.Channel
    stub: experts_pb2_grpc.ExpertPoolStub
    shard: int = -1
    shard_count: int = 0
    live: bool = False
    retired: bool = False
    in_flight: int = 0  # holders: calls, probes and replications picked under the lock (see _reserve)
    error: str = ""
    rows: int = 0
    hosted: dict[int, set[int]] = field(default_factory=dict)
    """Experts known to be hosted, per layer (home experts plus replicas)."""


@dataclass
class _Piece:
    shard: int
    expert: int
    start: int
    """First row of the piece in the sorted entry order."""
    count: int


class ExpertPoolClient:
    """Computes routed experts on a changing set of expert pools (thread-safe; see the module docstring)."""

    def __init__(self, addresses: Sequence[str], config: PoolClientConfig | None = None, *,
                 config_hash: str | None = None, server_config: ServerConfig | None = None,
                 telemetry: Telemetry | None = None, pool_file: str | None = None):
        self.config = config or PoolClientConfig()
        self._config_hash = config_hash
        self._server_config = server_config
        self._telemetry = telemetry
        self._lock = threading.Lock()
        self._pools: dict[str, _Pool] = {}
        self._num_experts = 0
        self._layers: tuple[int, ...] = ()
        self._shard_count = 0
        self._placements: dict[int, LayerPlacement] = {}
        self._window: dict[int, np.ndarray] = {}  # load since the last plan, per layer
        self._load: dict[int, np.ndarray] = {}  # load since the start, per layer
        self._next_plan = time.monotonic() + self.config.replan_interval_s
        self._planning = False
        self._turn = 0
        self._retries = 0
        self._closed = False
        meter = (telemetry or Telemetry()).meter()
        self._rows_counter = meter.create_counter(
            "k3.experts.client.rows", unit="{row}", description="Latent rows sent to expert pools, by pool.")
        self._retry_counter = meter.create_counter(
            "k3.experts.client.retries", unit="{piece}", description="Pieces retried, by failure reason.")
        for name, callback, doc in (
            ("k3.experts.client.imbalance", self._observe_imbalance, "max/mean of rows sent across shards."),
            ("k3.experts.client.replicas", self._observe_replicas, "Foreign experts in the current placements."),
            ("k3.experts.client.live_pools", self._observe_live, "Pools taking work."),
        ):
            meter.create_observable_gauge(name, callbacks=[callback], description=doc)
        self.set_pools(addresses)
        self._pool_file = pool_file
        self._applied = list(dict.fromkeys(addresses))
        self._watch_stop = threading.Event()
        self._watcher: threading.Thread | None = None
        if pool_file is not None:
            self._watcher = threading.Thread(target=self._watch, name="k3-expert-pool-set", daemon=True)
            self._watcher.start()

    def _watch(self) -> None:
        """Apply the pool set file's changes until closed; a bad file or a refused pool keeps the current set."""
        last_error = ""
        while not self._watch_stop.wait(self.config.watch_interval_s):
            try:
                addresses = read_pool_set(self._pool_file)
                if addresses != self._applied:
                    self.set_pools(addresses)
                    self._applied = addresses
                last_error = ""
            except (PoolSetError, ValueError) as exc:
                if str(exc) != last_error:  # once per distinct problem, not every interval
                    log.error("pool set file %s not applied: %s", self._pool_file, exc)
                last_error = str(exc)
            except RuntimeError:  # closed meanwhile
                return

    # -- membership ------------------------------------------------------------------------------------------
    def set_pools(self, addresses: Sequence[str]) -> None:
        """Make ``addresses`` the pool set: new ones are probed and join, missing ones are retired.

        ``ValueError`` (and no change) if a pool that answers serves another model or another shard count
        than the others.
        """
        addresses = list(dict.fromkeys(addresses))
        for i, address in enumerate(addresses):
            if not isinstance(address, str) or not address.strip():
                raise ValueError(f"expert pool address [{i}] must be a non-empty host:port, got {address!r}")
        with self._lock:
            if self._closed:
                raise RuntimeError("the expert pool client is closed")
            known = dict(self._pools)
        joining = {a: self._new_pool(a) for a in addresses if a not in known}
        probes = {a: self._probe(p) for a, p in joining.items()}
        try:
            with self._lock:
                self._admit(addresses, joining, probes)
        except BaseException:
            for pool in joining.values():
                pool.channel.close()
            raise

    def _new_pool(self, address: str) -> _Pool:
        channel = make_channel(address, self._server_config, telemetry=self._telemetry)
        return _Pool(address=address, channel=channel, stub=experts_pb2_grpc.ExpertPoolStub(channel))

    def _probe(self, pool: _Pool) -> experts_pb2.PoolStatsResponse | str:
        """The pool's stats, or why it did not answer."""
        try:
            return pool.stub.PoolStats(experts_pb2.PoolStatsRequest(), timeout=self.config.probe_timeout_s)
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"

    def _check_model(self, address: str, stats: experts_pb2.PoolStatsResponse, shard_count: int) -> None:
        if self._config_hash is not None and stats.config_hash != self._config_hash:
            raise ValueError(f"expert pool {address} serves another model (config hash {stats.config_hash[:12]}, "
                             f"expected {self._config_hash[:12]})")
        if shard_count and stats.shard_count != shard_count:
            raise ValueError(f"expert pool {address} is shard {stats.shard}, but the other pools split the "
                             f"experts into {shard_count} shards")
        if self._num_experts and (stats.num_experts != self._num_experts or tuple(stats.layers) != self._layers):
            raise ValueError(f"expert pool {address} serves {stats.num_experts} experts in layers "
                             f"{list(stats.layers)}, the other pools {self._num_experts} in {list(self._layers)}")

    def _admit(self, addresses: list[str], joining: dict[str, _Pool],
               probes: dict[str, experts_pb2.PoolStatsResponse | str]) -> None:
        """Validate, then apply (under the lock): all or nothing."""
        staying = [self._pools[a] for a in addresses if a in self._pools]
        shard_count = next((p.shard_count for p in staying if p.shard_count), 0)
        num_experts, layers = self._num_experts, self._layers
        if not any(p.shard_count for p in staying):
            self._num_experts, self._layers = 0, ()  # every known pool leaves: a new model may come in
        try:
            for address, stats in probes.items():
                if isinstance(stats, str):
                    continue
                self._check_model(address, stats, shard_count)
                shard_count = stats.shard_count
                self._num_experts, self._layers = stats.num_experts, tuple(stats.layers)
        except ValueError:
            self._num_experts, self._layers = num_experts, layers
            raise
        for address, pool in joining.items():
            stats = probes[address]
            if isinstance(stats, str):
                pool.error = stats
                log.warning("expert pool %s did not answer (%s); it is probed again at the next replan",
                            address, stats)
            else:
                self._join(pool, stats)
            self._pools[address] = pool
        for address in [a for a in self._pools if a not in addresses]:
            pool = self._pools.pop(address)
            pool.retired, pool.live = True, False
            if pool.in_flight == 0:
                pool.channel.close()
        if shard_count and shard_count != self._shard_count:
            self._shard_count = shard_count
            self._placements.clear()  # plans over another number of ranks are meaningless now
        log.info("expert pools: %s", ", ".join(f"{p.address} (shard {p.shard}/{p.shard_count}"
                                                f"{'' if p.live else ', down'})" for p in self._pools.values()))

    def _join(self, pool: _Pool, stats: experts_pb2.PoolStatsResponse) -> None:
        pool.shard, pool.shard_count, pool.live, pool.error = stats.shard_index, stats.shard_count, True, ""
        pool.hosted = {}
        for load in stats.loads:
            pool.hosted.setdefault(load.layer, set()).add(load.expert)

    def _probe_down(self) -> None:
        """Probe every down pool once; those that answer (and still match) take work again."""
        with self._lock:
            down = [p for p in self._pools.values() if not p.live]
            self._reserve(down)
        try:
            for pool in down:
                self._probe_down_one(pool)
        finally:
            for pool in down:
                self._release(pool)

    def _probe_down_one(self, pool: _Pool) -> None:
        """Probe one down pool (held by the caller); it takes work again if it answers and still matches."""
        stats = self._probe(pool)
        with self._lock:
            if pool.retired:
                return
            if isinstance(stats, str):
                pool.error = stats
                return
            try:
                self._check_model(pool.address, stats, self._shard_count)
            except ValueError as exc:
                pool.error = str(exc)
                log.warning("%s", exc)
                return
            if not self._num_experts:
                self._num_experts, self._layers = stats.num_experts, tuple(stats.layers)
            if not self._shard_count:
                self._shard_count = stats.shard_count
            self._join(pool, stats)
            log.info("expert pool %s is back (shard %s)", pool.address, stats.shard)

    def _mark_down(self, pool: _Pool, reason: str) -> None:
        with self._lock:
            if pool.live:
                log.warning("expert pool %s is down: %s", pool.address, reason)
            pool.live, pool.error = False, reason

    def _reserve(self, pools) -> None:
        """With the lock held: keep each pool's channel open until the matching :meth:`_release`. ``set_pools``
        may retire a pool at any moment, but only closes its channel once nothing holds it."""
        for pool in pools:
            pool.in_flight += 1

    def _release(self, pool: _Pool) -> None:
        with self._lock:
            pool.in_flight -= 1
            close = pool.retired and pool.in_flight == 0
        if close:
            pool.channel.close()

    # -- placement -------------------------------------------------------------------------------------------
    def replan(self) -> None:
        """Recompute every layer's MoonEP placement from the load observed since the last plan, then add and
        drop replicas on the live pools to match it (a pool that fails to answer is marked down)."""
        self._probe_down()
        with self._lock:
            n = self._shard_count
            if n:
                for layer, window in self._window.items():
                    self._placements[layer] = plan_placement(window, n)
                    window[:] = 0
            self._next_plan = time.monotonic() + self.config.replan_interval_s
            work = self._replica_changes()
            self._reserve(pool for pool, _, _ in work)
        try:
            for pool, add, drop in work:
                try:
                    self._replicate(pool, add, drop)
                except grpc.RpcError as exc:
                    self._mark_down(pool, f"Replicate failed: {exc.code().name}: {exc.details()}")
        finally:
            for pool, _, _ in work:
                self._release(pool)

    def _replica_changes(self) -> list[tuple[_Pool, list[tuple[int, int]], list[tuple[int, int]]]]:
        """Per live pool, the replicas the current placements want added and the ones no longer needed."""
        live = [p for p in self._pools.values() if p.live]
        adopt = adopters([any(p.shard == d for p in live) for d in range(self._shard_count)])
        changes = []
        for pool in live:
            served = [d for d, a in enumerate(adopt) if a == pool.shard]
            home = set(home_experts(pool.shard, self._shard_count, self._num_experts)) if self._num_experts else set()
            add, drop = [], []
            for layer, placement in self._placements.items():
                wanted = set()
                for d in served:
                    wanted |= {e for e in np.flatnonzero(placement.shares[:, d] > 0).tolist()}
                wanted -= home
                hosted = pool.hosted.get(layer, set()) - home
                add += [(layer, e) for e in sorted(wanted - hosted)]
                drop += [(layer, e) for e in sorted(hosted - wanted)]
            if add or drop:
                changes.append((pool, add, drop))
        return changes

    def _replicate(self, pool: _Pool, add: list[tuple[int, int]], drop: list[tuple[int, int]]) -> None:
        with self._lock:
            live = [p for p in self._pools.values() if p.live and p is not pool]
            per = self._num_experts // self._shard_count
            specs = [experts_pb2.ReplicaSpec(layer=layer, expert=e, sources=[
                p.address for p in live if p.shard == e // per]) for layer, e in add]
        reply = pool.stub.Replicate(
            experts_pb2.ReplicateRequest(add=specs, drop=[experts_pb2.ExpertRef(layer=layer, expert=e)
                                                          for layer, e in drop]),
            timeout=self.config.replicate_timeout_s)
        home = home_experts(pool.shard, self._shard_count, self._num_experts)
        with self._lock:
            hosted: dict[int, set[int]] = {layer: set(home) for layer in self._layers}
            for ref in reply.replicas:
                hosted.setdefault(ref.layer, set()).add(ref.expert)
            pool.hosted = hosted

    def _maybe_replan(self) -> None:
        if self.config.replan_interval_s <= 0:
            return
        with self._lock:
            if self._planning or time.monotonic() < self._next_plan:
                return
            self._planning = True
        try:
            self.replan()
        finally:
            with self._lock:
                self._planning = False

    # -- compute ---------------------------------------------------------------------------------------------
    def __call__(self, moe, z: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        return self.compute(moe, z, ids, weights)

    def compute(self, moe, z: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """The ``routed_compute`` hook of ``LatentMoE`` (inference only): u [N, latent] fp32."""
        layer, num_experts, top_k = moe.layer_idx, moe.num_experts, moe.top_k
        self._check_routing(layer, num_experts, top_k, z, ids, weights)
        self._maybe_replan()
        flat_ids = ids.flatten()
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
        token_of = order // top_k
        weight_of = weights.flatten()[order]
        rows = z.detach()[token_of]
        out = self._run(layer, num_experts, counts, rows)
        u = torch.zeros(z.shape[0], z.shape[-1], dtype=torch.float32, device=z.device)
        start = 0
        for count in counts:
            if count:
                u.index_add_(0, token_of[start:start + count],
                             out[start:start + count].float() * weight_of[start:start + count, None])
                start += count
        return u

    @staticmethod
    def _check_routing(layer: int, num_experts: int, top_k: int, z: Tensor, ids: Tensor, weights: Tensor) -> None:
        """A routing that cannot be split over the pools is refused before anything is sent."""
        if z.dim() != 2 or tuple(ids.shape) != (z.shape[0], top_k) or tuple(weights.shape) != tuple(ids.shape):
            raise InvalidArgument("ids", f"layer {layer}: latents {list(z.shape)}, expert ids {list(ids.shape)} and "
                                  f"weights {list(weights.shape)} must be [N, latent], [N, {top_k}], [N, {top_k}]",
                                  reason="BAD_SHAPE")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise InvalidArgument("ids", f"layer {layer} routes to expert {bad}, which does not exist (the layer "
                                  f"has {num_experts} experts)", reason="UNKNOWN_EXPERT")

    def _run(self, layer: int, num_experts: int, counts: list[int], rows: Tensor) -> Tensor:
        """Outputs of every entry row (sorted by expert), computed on the pools."""
        with self._lock:
            ready = bool(self._shard_count)
        if not ready:  # no pool has answered yet: try the down ones once before giving up
            self._probe_down()
        with self._lock:
            if not self._shard_count:
                raise Unavailable(f"no expert pool is reachable: {self._describe_pools()}")
            if self._num_experts != num_experts:
                raise ValueError(f"layer {layer} has {num_experts} experts but the pools serve {self._num_experts}")
            if layer not in self._placements:
                self._placements[layer] = plan_placement([0] * num_experts, self._shard_count)
            placement = self._placements[layer]
            load = np.asarray(counts, dtype=np.int64)
            self._window[layer] = self._window.get(layer, 0) + load
            self._load[layer] = self._load.get(layer, 0) + load
        offsets = np.concatenate([[0], np.cumsum(counts)]).tolist()
        todo = [_Piece(shard, e, offsets[e] + start, n)
                for shard, pieces in enumerate(placement.split(counts)) for e, start, n in pieces]
        out = torch.empty_like(rows)
        failures: list[str] = []
        for attempt in range(self.config.max_attempts):
            if not todo:
                break
            if attempt:
                self._count_retries(len(todo), failures[-1] if failures else "retry")
            todo = self._round(layer, todo, rows, out, failures)
        if todo:
            raise Unavailable(f"layer {layer}: experts {sorted({p.expert for p in todo})} could not be computed "
                              f"after {self.config.max_attempts} attempts: {'; '.join(failures[-4:])}")
        return out

    def _round(self, layer: int, todo: list[_Piece], rows: Tensor, out: Tensor, failures: list[str]) -> list[_Piece]:
        """One attempt: assign, replicate where needed, call concurrently; returns the pieces to retry."""
        groups = self._assign(todo, failures)
        if groups is None:
            self._probe_down()
            groups = self._assign(todo, failures)
            if groups is None:
                raise Unavailable(f"layer {layer}: no live expert pool ({self._describe_pools()}); "
                                  f"{'; '.join(failures[-4:])}")
        calls: list = []
        try:
            return self._call(layer, groups, rows, out, failures, calls)
        finally:
            for _, _, future in calls:
                future.cancel()  # only those an error left unread; a finished call ignores it
            for pool, _ in groups:
                self._release(pool)

    def _call(self, layer: int, groups: list[tuple[_Pool, list[_Piece]]], rows: Tensor, out: Tensor,
              failures: list[str], calls: list) -> list[_Piece]:
        """The calls of one round on pools ``_assign`` holds; the futures go to ``calls`` as they are sent."""
        retry: list[_Piece] = []
        for pool, pieces in groups:
            missing = self._missing(pool, layer, pieces)
            if missing:
                try:
                    self._replicate(pool, [(layer, e) for e in missing], [])
                except grpc.RpcError as exc:
                    reason = f"{pool.address}: Replicate {exc.code().name}: {exc.details()}"
                    failures.append(reason)
                    if exc.code() in _RETRYABLE:
                        self._mark_down(pool, reason)
                    retry += pieces
                    continue
            request = experts_pb2.ExpertComputeRequest(
                layer=layer, expert_ids=[p.expert for p in pieces], counts=[p.count for p in pieces],
                tokens=tensors.to_proto(torch.cat([rows[p.start:p.start + p.count] for p in pieces])))
            calls.append((pool, pieces, pool.stub.Compute.future(request, timeout=self.config.call_timeout_s)))
        for pool, pieces, future in calls:
            try:
                reply = future.result()
            except grpc.RpcError as exc:
                retry += self._failed(pool, layer, pieces, exc, failures)
                continue
            result = tensors.from_proto(reply.outputs, "outputs")
            expected = (sum(p.count for p in pieces), rows.shape[1])
            if tuple(result.shape) != expected:
                raise Internal(f"expert pool {pool.address} returned outputs of shape {list(result.shape)}, "
                               f"expected {list(expected)}")
            at = 0
            for p in pieces:
                out[p.start:p.start + p.count] = result[at:at + p.count].to(out.device, out.dtype)
                at += p.count
            self._rows_counter.add(expected[0], {"pool": pool.address})
            with self._lock:
                pool.rows += expected[0]
        return retry

    def _failed(self, pool: _Pool, layer: int, pieces: list[_Piece], exc: grpc.RpcError,
                failures: list[str]) -> list[_Piece]:
        code = exc.code()
        reason = f"{pool.address}: {code.name}: {exc.details()}"
        detail = error_detail(exc)
        if code in _RETRYABLE:
            failures.append(reason)
            self._mark_down(pool, reason)
            return pieces
        if code == grpc.StatusCode.FAILED_PRECONDITION and detail is not None \
                and detail.reason == "EXPERT_NOT_HOSTED":
            failures.append(reason)
            with self._lock:  # forget what we believed it hosts: the next round replicates again
                pool.hosted[layer] = set(home_experts(pool.shard, self._shard_count, self._num_experts))
            return pieces
        raise Internal(f"expert pool {pool.address} rejected layer {layer}: {code.name}: {exc.details()}")

    def _assign(self, todo: list[_Piece], failures: list[str]) -> list[tuple[_Pool, list[_Piece]]] | None:
        """Group pieces by (pool, shard): one request each, so no expert appears twice in a request. Each
        group's pool is held (``_reserve``) until the caller releases it. None when no pool is live."""
        with self._lock:
            live = [p for p in self._pools.values() if p.live]
            by_shard = {d: [p for p in live if p.shard == d] for d in range(self._shard_count)}
            adopt = adopters([bool(by_shard[d]) for d in range(self._shard_count)])
            if not live:
                return None
            self._turn += 1
            groups: dict[tuple[str, int], tuple[_Pool, list[_Piece]]] = {}
            per = self._num_experts // self._shard_count
            for piece in todo:
                # A piece planned before the shard count changed goes to its expert's home under the new one.
                shard = piece.shard if piece.shard < self._shard_count else piece.expert // per
                target = by_shard[adopt[shard]]
                pool = target[self._turn % len(target)]  # rotate among a shard's pools, call by call
                groups.setdefault((pool.address, shard), (pool, []))[1].append(piece)
            self._reserve(pool for pool, _ in groups.values())
            return list(groups.values())

    def _missing(self, pool: _Pool, layer: int, pieces: list[_Piece]) -> list[int]:
        with self._lock:
            hosted = pool.hosted.get(layer, set())
            return sorted({p.expert for p in pieces if p.expert not in hosted})

    def _count_retries(self, pieces: int, reason: str) -> None:
        with self._lock:
            self._retries += pieces
        self._retry_counter.add(pieces, {"reason": reason.split(": ")[1] if ": " in reason else reason})

    def _describe_pools(self) -> str:
        pools = list(self._pools.values())
        if not pools:
            return "no pools configured"
        return ", ".join(f"{p.address} down ({p.error or 'not probed'})" if not p.live else p.address
                         for p in pools)

    # -- statistics ------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """JSON-ready: pools (shard, live, rows sent), per-layer expert load, imbalances, replicas, retries."""
        with self._lock:
            pools = [{"address": p.address, "shard": f"{p.shard}/{p.shard_count}" if p.shard_count else "?",
                      "live": p.live, "rows": p.rows, "error": p.error} for p in self._pools.values()]
            load = {layer: counts.tolist() for layer, counts in self._load.items()}
            replicas = {layer: {d: placement.replicas(d) for d in range(placement.num_shards)
                                if placement.replicas(d)} for layer, placement in self._placements.items()}
            shard_rows = self._shard_rows()
            retries = self._retries
        expert_total = [sum(per_layer) for per_layer in zip(*load.values(), strict=True)] if load else []
        return {
            "pools": pools,
            "expert_load": load,
            "expert_imbalance": imbalance(expert_total),
            "shard_imbalance": imbalance(shard_rows),
            "replicas": replicas,
            "retries": retries,
        }

    def _shard_rows(self) -> list[int]:
        rows = [0] * self._shard_count
        for p in self._pools.values():
            if p.shard_count == self._shard_count and 0 <= p.shard < self._shard_count:
                rows[p.shard] += p.rows
        return rows

    def _observe_imbalance(self, options):
        with self._lock:
            value = imbalance(self._shard_rows())
        yield Observation(value)

    def _observe_replicas(self, options):
        with self._lock:
            value = sum(len(p.replicas(d)) for p in self._placements.values() for d in range(p.num_shards))
        yield Observation(value)

    def _observe_live(self, options):
        with self._lock:
            value = sum(p.live for p in self._pools.values())
        yield Observation(value)

    def close(self) -> None:
        """Stop watching the pool set file and close every channel (calls still running on them fail)."""
        self._watch_stop.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=self.config.probe_timeout_s + 1)
        with self._lock:
            self._closed = True
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.channel.close()


def attach_pools(model, addresses: Sequence[str], config: PoolClientConfig | None = None, *,
                 server_config: ServerConfig | None = None, telemetry: Telemetry | None = None,
                 pool_file: str | None = None) -> ExpertPoolClient:
    """Route every MoE layer of ``model`` (a ``K3Model``) through one client of ``addresses`` (or of the pools
    listed in ``pool_file``, followed as it changes); the client is also kept as ``model.expert_pool_client``.
    Undo with :func:`detach_pools`."""
    from k3.model.moe import LatentMoE

    if pool_file is not None:
        addresses = read_pool_set(pool_file)
    client = ExpertPoolClient(addresses, config, config_hash=model.cfg.config_hash(),
                              server_config=server_config, telemetry=telemetry, pool_file=pool_file)
    for module in model.modules():
        if isinstance(module, LatentMoE):
            module.routed_compute = client.compute
    model.expert_pool_client = client
    return client


def detach_pools(model) -> None:
    """Back to local experts; closes the client ``attach_pools`` made."""
    from k3.model.moe import LatentMoE

    for module in model.modules():
        if isinstance(module, LatentMoE):
            module.routed_compute = None
    client = getattr(model, "expert_pool_client", None)
    if client is not None:
        client.close()
        model.expert_pool_client = None
