"""The CacheStore gRPC service in-process over loopback: semantics and validation of every request."""

from __future__ import annotations

import hashlib

import grpc
import pytest
import torch
from servicekit import rpc_error

from k3.protos.v1 import cache_pb2, cache_pb2_grpc, common_pb2
from k3.services.cache.service import CacheService, CacheServiceConfig, build
from k3.services.cache.store import CacheStoreConfig
from k3.services.common import tensors
from k3.services.common.client import error_detail, make_channel

pytestmark = pytest.mark.timeout(60)


def key(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=32).digest()


def block(i: int, kind: str = "mla_block", n: int = 8) -> cache_pb2.Block:
    latent = torch.arange(n, dtype=torch.float32).reshape(2, n // 2) + i
    return cache_pb2.Block(
        key=key(i),
        kind=kind,
        tensors=[tensors.to_proto(latent), tensors.to_proto(latent.to(torch.bfloat16))],
        names=["latent", "latent_bf16"],
        metadata={"block": str(i)},
    )


@pytest.fixture
def cache(serve, tmp_path):
    config = CacheServiceConfig(
        store=CacheStoreConfig(memory_bytes=64 * 1024, max_value_bytes=16 * 1024, disk_dir=str(tmp_path / "disk"))
    )
    service = build(config)
    handle = serve(service)
    with make_channel(handle.address) as channel:
        yield cache_pb2_grpc.CacheStoreStub(channel), service


def test_put_get_round_trip(cache):
    stub, _ = cache
    put = stub.Put(cache_pb2.PutRequest(block=block(1)))
    assert put.tier == "memory" and put.stored_bytes == block(1).ByteSize()
    got = stub.Get(cache_pb2.GetRequest(key=key(1), kind="mla_block"))
    assert got.found and got.tier == "memory" and got.block == block(1)
    latent = tensors.from_proto(got.block.tensors[0], "latent")
    assert torch.equal(latent, torch.arange(8, dtype=torch.float32).reshape(2, 4) + 1)
    # Kinds are separate namespaces.
    assert not stub.Get(cache_pb2.GetRequest(key=key(1), kind="kda_checkpoint")).found
    assert not stub.Get(cache_pb2.GetRequest(key=key(2), kind="mla_block")).found


def test_get_many_lookup_evict_stats(cache):
    stub, _ = cache
    for i in range(4):
        stub.Put(cache_pb2.PutRequest(block=block(i)))
    keys = [key(0), key(1), key(2), key(9), key(3)]
    streamed = list(stub.GetMany(cache_pb2.GetManyRequest(keys=keys, kind="mla_block")))
    assert [r.block.metadata["block"] for r in streamed] == ["0", "1", "2"]  # ends at the first miss
    assert all(r.found for r in streamed)
    lookup = stub.Lookup(cache_pb2.LookupRequest(keys=keys, kind="mla_block"))
    assert lookup.hit_blocks == 3 and list(lookup.tiers) == ["memory"] * 3
    assert stub.Evict(cache_pb2.EvictRequest(keys=[key(1), key(9)], kind="mla_block")).evicted == 1
    assert stub.Lookup(cache_pb2.LookupRequest(keys=keys, kind="mla_block")).hit_blocks == 1
    assert list(stub.GetMany(cache_pb2.GetManyRequest(keys=[], kind="mla_block"))) == []
    stats = stub.Stats(cache_pb2.StatsRequest())
    assert [t.name for t in stats.tiers] == ["memory", "disk"]
    memory = stats.tiers[0]
    assert memory.blocks == 3 and memory.budget_bytes == 64 * 1024 and memory.healthy
    assert memory.bytes == 3 * block(0).ByteSize()
    assert (stats.puts, stats.lookups, stats.lookup_keys, stats.lookup_hit_blocks) == (4, 2, 10, 4)
    assert stats.gets == 4 and stats.get_hits == 3


def test_blocks_spill_to_disk_and_come_back(cache):
    stub, _ = cache
    big = [block(i, n=1024) for i in range(12)]  # ~6 KiB each, 64 KiB of memory
    for b in big:
        stub.Put(cache_pb2.PutRequest(block=b))
    lookup = stub.Lookup(cache_pb2.LookupRequest(keys=[b.key for b in big], kind="mla_block"))
    assert lookup.hit_blocks == 12 and lookup.tiers[0] == "disk" and lookup.tiers[-1] == "memory"
    got = stub.Get(cache_pb2.GetRequest(key=big[0].key, kind="mla_block"))
    assert got.found and got.tier == "disk" and got.block == big[0]


def _invalid(fn, field: str, message: str, reason: str) -> None:
    err = rpc_error(fn)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == f"{field}: {message}"
    detail = error_detail(err)
    assert (detail.field, detail.reason) == (field, reason)


def test_put_validation(cache):
    stub, _ = cache

    def put(b: cache_pb2.Block | None):
        return stub.Put(cache_pb2.PutRequest(block=b) if b is not None else cache_pb2.PutRequest())

    _invalid(lambda: put(None), "block", "is required", "MISSING_FIELD")
    bad = block(1, kind="foo")
    _invalid(
        lambda: put(bad),
        "block.kind",
        "unknown kind 'foo' (expected one of mla_block, kda_checkpoint, vision_tokens)",
        "UNKNOWN_KIND",
    )
    bad = block(1)
    bad.key = b"short"
    _invalid(lambda: put(bad), "block.key", "must be a 32-byte block hash, got 5 bytes", "BAD_KEY_LENGTH")
    bad = block(1)
    bad.names.append("extra")
    _invalid(lambda: put(bad), "block.names", "has 3 names for 2 tensors (one name per tensor)", "NAMES_MISMATCH")
    bad = block(1)
    bad.names[1] = "latent"
    _invalid(lambda: put(bad), "block.names[1]", "duplicate name 'latent'", "DUPLICATE_NAME")
    bad = block(1)
    bad.tensors[1].data = bad.tensors[1].data[:-1]
    _invalid(
        lambda: put(bad),
        "block.tensors[1].data",
        "has 15 bytes, expected 16 for shape [2, 4] of dtype bfloat16",
        "BAD_LENGTH",
    )
    bad = block(1)
    bad.tensors[0].dtype = "float128"
    err = rpc_error(lambda: put(bad))
    assert error_detail(err).field == "block.tensors[0].dtype"
    too_big = block(1, n=4096)  # 24 KiB serialized, over max_value_bytes=16 KiB
    _invalid(
        lambda: put(too_big),
        "block",
        f"is {too_big.ByteSize()} bytes serialized, more than the store's limit of 16384",
        "VALUE_TOO_LARGE",
    )
    # Nothing was stored by the rejected requests.
    assert stub.Stats(cache_pb2.StatsRequest()).puts == 0


def test_key_and_kind_validation_of_reads(cache):
    stub, _ = cache
    _invalid(
        lambda: stub.Get(cache_pb2.GetRequest(key=key(1), kind="")),
        "kind",
        "unknown kind '' (expected one of mla_block, kda_checkpoint, vision_tokens)",
        "UNKNOWN_KIND",
    )
    _invalid(
        lambda: stub.Get(cache_pb2.GetRequest(key=b"", kind="mla_block")),
        "key",
        "must be a 32-byte block hash, got 0 bytes",
        "BAD_KEY_LENGTH",
    )
    keys = [key(0), key(1) + b"!"]
    for call in (stub.Lookup, stub.Evict):
        request_type = cache_pb2.LookupRequest if call is stub.Lookup else cache_pb2.EvictRequest
        _invalid(
            lambda call=call, request_type=request_type: call(request_type(keys=keys, kind="vision_tokens")),
            "keys[1]",
            "must be a 32-byte block hash, got 33 bytes",
            "BAD_KEY_LENGTH",
        )
    _invalid(
        lambda: stub.GetMany(cache_pb2.GetManyRequest(keys=keys, kind="vision_tokens")),
        "keys[1]",
        "must be a 32-byte block hash, got 33 bytes",
        "BAD_KEY_LENGTH",
    )


def test_closed_store_is_unavailable(serve):
    service = CacheService(build(CacheServiceConfig()).store)
    handle = serve(service)
    service.store.close()
    with make_channel(handle.address) as channel:
        err = rpc_error(lambda: cache_pb2_grpc.CacheStoreStub(channel).Stats(cache_pb2.StatsRequest()))
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert err.details() == "the cache store is closed"


def test_tensor_message_types_match_common_proto():
    # The cache contract reuses the shared Tensor message rather than a copy of it.
    assert cache_pb2.Block.DESCRIPTOR.fields_by_name["tensors"].message_type is common_pb2.Tensor.DESCRIPTOR
