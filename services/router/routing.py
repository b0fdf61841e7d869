"""Choosing workers: prefix affinity for prefill, least load for decode.

Prefill worker ``i`` gets the score

    score_i = affinity_weight * cached_blocks_i - load_i

and the highest score wins (ties: fewer requests in flight from this router, then round robin).

- ``cached_blocks_i`` is the length of the longest prefix of the prompt's chained 512-token block hashes
  (``k3.services.cache.hashing``) that worker ``i``'s cache store holds as ``kda_checkpoint`` blocks, the
  unit prefill restores from (``CacheStore.Lookup``). Workers sharing one store get the same value; one
  Lookup is sent per distinct store.
- ``load_i = max(reported_i, in_flight_i)``: ``reported`` is ``running + queued`` from the worker's own
  ``Load`` (it sees every router's traffic, but is refreshed only every ``load_refresh_seconds``);
  ``in_flight`` is this router's count of requests sent to it and not yet finished (exact and current).
  Taking the larger of the two never under-counts either source.
- ``affinity_weight`` (default 1.0) is how many load units one cached block is worth: restoring a block
  saves a 512-token prefill chunk, about the cost one more queued request adds on a loaded worker.

Decode workers have no prefix to reuse (prefill hands the state over), so the decode worker with the least
``load`` wins. A worker whose call failed is skipped for ``retry_unavailable_seconds`` unless every worker
failed (then all are tried again: a transient outage must not black-hole traffic). If a cache store cannot
be asked, its workers count 0 cached blocks for this request (logged): routing degrades to least load, the
request itself is unaffected because prefill does its own lookup.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from k3.protos.v1 import cache_pb2, engine_pb2

log = logging.getLogger(__name__)

LOOKUP_KIND = "kda_checkpoint"


def affinity_score(cached_blocks: int, load: int, weight: float) -> float:
    """The prefill routing score (module docstring)."""
    return cached_blocks * weight - load


class Worker:
    """One prefill or decode worker as the router sees it."""

    def __init__(self, index: int, address: str, stub):
        self.index = index
        self.address = address
        self.stub = stub
        self.in_flight = 0
        self.reported = 0
        self.reported_at = float("-inf")
        self.refreshing = False
        self.failed_until = float("-inf")

    @property
    def load(self) -> int:
        return max(self.reported, self.in_flight)


class WorkerPool:
    """Workers of one kind with their load (reported by ``Load`` and counted locally)."""

    def __init__(self, kind: str, workers: Sequence[Worker], refresh_seconds: float, probe_timeout: float,
                 retry_seconds: float, clock: Callable[[], float] = time.monotonic):
        self.kind = kind
        self.workers = list(workers)
        self._refresh = refresh_seconds
        self._timeout = probe_timeout
        self._retry = retry_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._rotation = itertools.count()

    def candidates(self) -> list[Worker]:
        """Workers not marked failed (all of them if every one is)."""
        now = self._clock()
        with self._lock:
            healthy = [w for w in self.workers if w.failed_until <= now]
        return healthy or list(self.workers)

    def refresh_loads(self, workers: Sequence[Worker]) -> None:
        """Ask stale workers for their ``Load`` (one thread per worker at a time; others use the last value)."""
        now = self._clock()
        stale: list[Worker] = []
        with self._lock:
            for w in workers:
                if not w.refreshing and now - w.reported_at >= self._refresh:
                    w.refreshing = True
                    stale.append(w)
        futures = [(w, w.stub.Load.future(engine_pb2.LoadRequest(), timeout=self._timeout)) for w in stale]
        for w, future in futures:
            try:
                response = future.result()
            except grpc.RpcError as exc:
                log.warning("%s worker %s: Load failed (%s)", self.kind, w.address, exc.code())
                self.mark_failed(w)
                with self._lock:
                    w.refreshing = False
                continue
            with self._lock:
                w.reported = response.running + response.queued
                w.reported_at = self._clock()
                w.refreshing = False

    def mark_failed(self, worker: Worker) -> None:
        with self._lock:
            worker.failed_until = self._clock() + self._retry

    def tie_break(self) -> int:
        return next(self._rotation)

    def acquire(self, worker: Worker) -> None:
        with self._lock:
            worker.in_flight += 1

    def release(self, worker: Worker) -> None:
        with self._lock:
            worker.in_flight -= 1


@dataclass(frozen=True)
class PrefillChoice:
    worker: Worker
    cached_blocks: int
    score: float


class PrefixIndex:
    """Cached-prefix lengths per prefill worker from the cache store(s)."""

    def __init__(self, stores: dict[str, object], store_of: Sequence[str | None], probe_timeout: float):
        self._stores = stores  # address -> CacheStore stub
        self._store_of = list(store_of)  # prefill worker index -> store address (None: no lookups)
        self._timeout = probe_timeout

    def cached_blocks(self, keys: Sequence[bytes], workers: Sequence[Worker]) -> dict[int, int]:
        """Worker index -> hit blocks (the longest present prefix of ``keys``)."""
        if not keys:
            return {w.index: 0 for w in workers}
        addresses = {self._store_of[w.index] for w in workers} - {None}
        request = cache_pb2.LookupRequest(keys=list(keys), kind=LOOKUP_KIND)
        futures = {a: self._stores[a].Lookup.future(request, timeout=self._timeout) for a in addresses}
        hits: dict[str | None, int] = {None: 0}
        for address, future in futures.items():
            try:
                hits[address] = future.result().hit_blocks
            except grpc.RpcError as exc:
                log.warning("cache store %s: Lookup failed (%s); routing by load only", address, exc.code())
                hits[address] = 0
        return {w.index: hits[self._store_of[w.index]] for w in workers}


class Router:
    """Picks a prefill worker (prefix affinity) and a decode worker (least load) for one request."""

    def __init__(self, prefill: WorkerPool, decode: WorkerPool, index: PrefixIndex, affinity_weight: float):
        self.prefill = prefill
        self.decode = decode
        self.index = index
        self.weight = affinity_weight

    def choose_prefill(self, block_keys: Sequence[bytes]) -> PrefillChoice:
        workers = self.prefill.candidates()
        self.prefill.refresh_loads(workers)
        cached = self.index.cached_blocks(block_keys, workers)
        offset = self.prefill.tie_break()
        n = len(workers)

        def key(item: tuple[int, Worker]):
            position, w = item
            score = affinity_score(cached.get(w.index, 0), w.load, self.weight)
            return (score, -w.in_flight, -((position - offset) % n))

        _, best = max(enumerate(workers), key=key)
        blocks = cached.get(best.index, 0)
        return PrefillChoice(best, blocks, affinity_score(blocks, best.load, self.weight))

    def choose_decode(self) -> Worker:
        workers = self.decode.candidates()
        self.decode.refresh_loads(workers)
        offset = self.decode.tie_break()
        n = len(workers)
        _, best = min(enumerate(workers), key=lambda item: (item[1].load, item[1].in_flight,
                                                              (item[0] - offset) % n))
        return best
