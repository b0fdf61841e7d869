"""The ``k3.v1.CacheStore`` gRPC service over ``TieredStore``.

Design decisions:

- Every request is validated here, at the edge, before the store sees it: kind, 32-byte keys, tensor
  dtype/shape/byte length, ``names`` matching ``tensors``, value size. Failures are INVALID_ARGUMENT with an
  ``ErrorDetail`` naming the field (``block.kind``, ``keys[3]``, ``block.tensors[1].data``). The store's own
  ``ValueError``s are still mapped, in case its rules are stricter than the checks here.
- The stored value is the serialized ``Block``; tensors are validated but never decoded, so this service
  does not need torch.
- GetMany validates all keys first, then streams found blocks in order and ends at the first miss (the
  stream carries only ``found`` responses; fewer messages than keys means the prefix ended there).
  Each block is fetched just before it is sent, so a long stream holds no more than one block in memory
  and stops working as soon as the client goes away.
- Lookups count the blocks asked for and found (``k3.cache.lookup_blocks`` / ``k3.cache.hit_blocks``: the hit
  ratio) on the service's own ``Telemetry``, which the server shares.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc

from k3.protos.v1 import cache_pb2, cache_pb2_grpc
from k3.services.cache.hashing import KEY_BYTES
from k3.services.cache.store import (
    KINDS,
    BadKeyError,
    CacheStoreConfig,
    StoreClosedError,
    TieredStore,
    UnknownKindError,
    ValueTooLargeError,
)
from k3.services.common import metric_names as mn
from k3.services.common import tensors
from k3.services.common.config import ServerConfig, documented
from k3.services.common.errors import InvalidArgument, Unavailable
from k3.services.common.telemetry import Telemetry, setup_telemetry
from k3.services.registry import ServiceSpec

SERVICE_NAME = cache_pb2.DESCRIPTOR.services_by_name["CacheStore"].full_name


@dataclass
class CacheServiceConfig:
    """Configuration of ``k3 serve cache``."""

    server: ServerConfig = documented(default_factory=ServerConfig, doc="How the gRPC server listens.")
    store: CacheStoreConfig = documented(default_factory=CacheStoreConfig, doc="Tiers and their budgets.")


def check_kind(kind: str, field: str) -> str:
    if kind not in KINDS:
        raise InvalidArgument(
            field, f"unknown kind {kind!r} (expected one of {', '.join(KINDS)})", reason="UNKNOWN_KIND"
        )
    return kind


def check_key(key: bytes, field: str) -> bytes:
    if len(key) != KEY_BYTES:
        raise InvalidArgument(
            field, f"must be a {KEY_BYTES}-byte block hash, got {len(key)} bytes", reason="BAD_KEY_LENGTH"
        )
    return key


def check_keys(keys: Sequence[bytes], field: str = "keys") -> list[bytes]:
    return [check_key(key, f"{field}[{i}]") for i, key in enumerate(keys)]


def check_block(block: cache_pb2.Block, field: str = "block") -> None:
    """Validate a block for storage (everything but its size, which the store's limit decides)."""
    check_key(block.key, f"{field}.key")
    check_kind(block.kind, f"{field}.kind")
    if len(block.names) != len(block.tensors):
        raise InvalidArgument(
            f"{field}.names",
            f"has {len(block.names)} names for {len(block.tensors)} tensors (one name per tensor)",
            reason="NAMES_MISMATCH",
        )
    seen: set[str] = set()
    for i, name in enumerate(block.names):
        if not name:
            raise InvalidArgument(f"{field}.names[{i}]", "must not be empty", reason="EMPTY_NAME")
        if name in seen:
            raise InvalidArgument(f"{field}.names[{i}]", f"duplicate name {name!r}", reason="DUPLICATE_NAME")
        seen.add(name)
    for i, tensor in enumerate(block.tensors):
        tensors.validate(tensor, f"{field}.tensors[{i}]")


class CacheStoreServicer(cache_pb2_grpc.CacheStoreServicer):
    """Put/Get/GetMany/Lookup/Evict/Stats over a ``TieredStore`` (validated; see the module docstring)."""

    def __init__(self, store: TieredStore, telemetry: Telemetry | None = None):
        self._store = store
        meter = (telemetry or Telemetry()).meter()
        self._lookup_blocks = mn.CACHE_LOOKUP_BLOCKS.instrument(meter)
        self._hit_blocks = mn.CACHE_HIT_BLOCKS.instrument(meter)

    def _call(self, fn, *args, kind_field: str = "kind", key_field: str = "keys", value_field: str = "block"):
        """Run a store call, turning its input errors into InvalidArgument on the request's fields."""
        try:
            return fn(*args)
        except UnknownKindError as exc:
            raise InvalidArgument(kind_field, str(exc), reason="UNKNOWN_KIND") from None
        except BadKeyError as exc:
            raise InvalidArgument(key_field, str(exc), reason="BAD_KEY_LENGTH") from None
        except ValueTooLargeError as exc:
            raise InvalidArgument(value_field, str(exc), reason="VALUE_TOO_LARGE") from None
        except StoreClosedError as exc:
            raise Unavailable(str(exc)) from None

    def Put(self, request: cache_pb2.PutRequest, context) -> cache_pb2.PutResponse:
        if not request.HasField("block"):
            raise InvalidArgument("block", "is required", reason="MISSING_FIELD")
        block = request.block
        check_block(block)
        value = block.SerializeToString()
        limit = self._store.config.max_value_bytes
        if len(value) > limit:
            raise InvalidArgument(
                "block", f"is {len(value)} bytes serialized, more than the store's limit of {limit}",
                reason="VALUE_TOO_LARGE",
            )
        tier = self._call(self._store.put, block.kind, block.key, value, kind_field="block.kind", key_field="block.key")
        return cache_pb2.PutResponse(tier=tier, stored_bytes=len(value))

    def _get(self, kind: str, key: bytes, key_field: str) -> cache_pb2.GetResponse:
        hit = self._call(self._store.get, kind, key, key_field=key_field)
        if hit is None:
            return cache_pb2.GetResponse(found=False)
        value, tier = hit
        return cache_pb2.GetResponse(found=True, block=cache_pb2.Block.FromString(value), tier=tier)

    def Get(self, request: cache_pb2.GetRequest, context) -> cache_pb2.GetResponse:
        check_kind(request.kind, "kind")
        check_key(request.key, "key")
        return self._get(request.kind, request.key, "key")

    def GetMany(self, request: cache_pb2.GetManyRequest, context) -> Iterator[cache_pb2.GetResponse]:
        check_kind(request.kind, "kind")
        keys = check_keys(request.keys)
        for i, key in enumerate(keys):
            response = self._get(request.kind, key, f"keys[{i}]")
            if not response.found:
                return
            yield response

    def Lookup(self, request: cache_pb2.LookupRequest, context) -> cache_pb2.LookupResponse:
        check_kind(request.kind, "kind")
        keys = check_keys(request.keys)
        tiers = self._call(self._store.lookup, request.kind, keys)
        self._lookup_blocks.add(len(keys))
        self._hit_blocks.add(len(tiers))
        return cache_pb2.LookupResponse(hit_blocks=len(tiers), tiers=tiers)

    def Evict(self, request: cache_pb2.EvictRequest, context) -> cache_pb2.EvictResponse:
        check_kind(request.kind, "kind")
        keys = check_keys(request.keys)
        return cache_pb2.EvictResponse(evicted=self._call(self._store.evict, request.kind, keys))

    def Stats(self, request: cache_pb2.StatsRequest, context) -> cache_pb2.StatsResponse:
        stats = self._call(self._store.stats)
        return cache_pb2.StatsResponse(
            tiers=[
                cache_pb2.TierStats(
                    name=t.name,
                    blocks=t.blocks,
                    bytes=t.bytes,
                    budget_bytes=t.budget_bytes,
                    hits=t.hits,
                    evictions=t.evictions,
                    healthy=t.healthy,
                )
                for t in stats.tiers
            ],
            lookups=stats.lookups,
            lookup_keys=stats.lookup_keys,
            lookup_hit_blocks=stats.lookup_hit_blocks,
            puts=stats.puts,
            gets=stats.gets,
            get_hits=stats.get_hits,
        )


class CacheService:
    """The cache store as a ``Service`` for ``k3.services.common.server``; owns (and closes) the store."""

    name = "cache"
    service_names = (SERVICE_NAME,)

    def __init__(self, store: TieredStore, telemetry: Telemetry | None = None, owns_telemetry: bool = False):
        self.store = store
        # None: the server builds providers from its config (and the lookup counters record nothing).
        self.telemetry = telemetry
        self._owns_telemetry = owns_telemetry

    def add_to_server(self, server: grpc.Server) -> None:
        cache_pb2_grpc.add_CacheStoreServicer_to_server(CacheStoreServicer(self.store, self.telemetry), server)

    def close(self) -> None:
        try:
            self.store.close()
        finally:
            if self._owns_telemetry and self.telemetry is not None:
                self.telemetry.shutdown()


def build(config: CacheServiceConfig) -> CacheService:
    telemetry = setup_telemetry("cache", config.server)
    try:
        return CacheService(TieredStore(config.store), telemetry, owns_telemetry=True)
    except BaseException:
        telemetry.shutdown()
        raise


SPEC = ServiceSpec(config_type=CacheServiceConfig, build=build)
