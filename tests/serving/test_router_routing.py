"""Prefix-affinity routing against real cache stores: cached blocks attract, load repels."""

from __future__ import annotations

import grpc
import pytest

from k3.protos.v1 import cache_pb2, cache_pb2_grpc
from k3.services.cache.hashing import chain_block_hashes
from k3.services.cache.service import CacheServiceConfig
from k3.services.cache.service import build as build_cache
from k3.services.common.config import ServerConfig
from k3.services.common.server import start_server
from k3.services.router.routing import LOOKUP_KIND, PrefixIndex, Router, Worker, WorkerPool, affinity_score

pytestmark = pytest.mark.timeout(60)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def stores():
    handles = []
    for _ in range(2):
        config = CacheServiceConfig(server=ServerConfig(port=0, grace_seconds=0.1, metrics=False, tracing=False))
        handles.append(start_server(build_cache(config), config.server))
    channels = [grpc.insecure_channel(h.address) for h in handles]
    yield [(h.address, cache_pb2_grpc.CacheStoreStub(c)) for h, c in zip(handles, channels, strict=True)]
    for channel in channels:
        channel.close()
    for handle in handles:
        handle.stop(grace=0)


def _pool(n: int, clock: Clock) -> WorkerPool:
    workers = [Worker(i, f"127.0.0.1:{1000 + i}", stub=None) for i in range(n)]
    for w in workers:
        w.reported_at = clock()  # fresh: the pool never asks these (unreachable) workers for their Load
    return WorkerPool("prefill", workers, refresh_seconds=1e9, probe_timeout=1.0, retry_seconds=5.0, clock=clock)


def _put(stub, keys) -> None:
    for key in keys:
        stub.Put(cache_pb2.PutRequest(block=cache_pb2.Block(key=key, kind=LOOKUP_KIND)), timeout=10)


def test_score_formula():
    assert affinity_score(cached_blocks=4, load=1, weight=1.0) == 3
    assert affinity_score(cached_blocks=4, load=1, weight=0.5) == 1
    assert affinity_score(cached_blocks=0, load=2, weight=3.0) == -2


def test_cached_prefix_attracts_and_load_repels(stores):
    clock = Clock()
    (a_addr, a_stub), (b_addr, b_stub) = stores
    prompt = list(range(8, 8 + 512 * 3 + 7))
    keys = chain_block_hashes(prompt)
    _put(a_stub, keys[:3])  # worker 0's store holds the whole prompt's blocks
    _put(b_stub, keys[:1])  # worker 1's store only the first block
    prefill = _pool(2, clock)
    decode = WorkerPool("decode", [Worker(i, f"d{i}", None) for i in range(2)], 1e9, 1.0, 5.0, clock=clock)
    for w in decode.workers:
        w.reported_at = clock()
    index = PrefixIndex({a_addr: a_stub, b_addr: b_stub}, [a_addr, b_addr], probe_timeout=5.0)
    router = Router(prefill, decode, index, affinity_weight=1.0)

    assert index.cached_blocks(keys, prefill.workers) == {0: 3, 1: 1}
    choice = router.choose_prefill(keys)
    assert (choice.worker.index, choice.cached_blocks, choice.score) == (0, 3, 3.0)
    # Two more requests in flight on worker 0: 3 - 2 = 1 still ties 1 - 0, broken by fewer in flight.
    prefill.acquire(prefill.workers[0])
    prefill.acquire(prefill.workers[0])
    assert router.choose_prefill(keys).worker.index == 1
    # A reported load counts too (max of reported and in flight).
    prefill.release(prefill.workers[0])
    prefill.release(prefill.workers[0])
    prefill.workers[0].reported = 5
    assert router.choose_prefill(keys).worker.index == 1
    # A higher weight makes the cached prefix worth more than that load.
    router.weight = 3.0
    assert router.choose_prefill(keys).worker.index == 0
    # A prompt nobody has cached goes to the least loaded worker.
    assert router.choose_prefill(chain_block_hashes(list(range(100, 700)))).worker.index == 1
    # Decode: least load wins; a failed worker is skipped until its retry time.
    decode.workers[0].reported = 3
    assert router.choose_decode().index == 1
    decode.mark_failed(decode.workers[1])
    assert router.choose_decode().index == 0
    clock.now += 10
    assert router.choose_decode().index == 1


def test_unreachable_store_counts_zero_blocks(stores):
    clock = Clock()
    (a_addr, a_stub), _ = stores
    keys = chain_block_hashes(list(range(8, 8 + 1024)))
    _put(a_stub, keys)
    with grpc.insecure_channel("127.0.0.1:1") as dead:
        dead_stub = cache_pb2_grpc.CacheStoreStub(dead)
        index = PrefixIndex({a_addr: a_stub, "dead": dead_stub}, [a_addr, "dead"], probe_timeout=0.5)
        assert index.cached_blocks(keys, _pool(2, clock).workers) == {0: 2, 1: 0}
