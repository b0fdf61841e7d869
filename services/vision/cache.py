"""Where encoded visual tokens are cached: the cache store over gRPC, or an in-process LRU.

Both hold ``k3.v1.Block`` values of kind ``vision_tokens`` under the 32-byte content hash, so an entry looks
the same wherever it lives (and shows in the cache store's Stats like any other block). The in-process cache
is the cache store's own engine (``TieredStore`` with only its memory tier), not a second LRU.

Design decisions:

- A cache store that cannot be reached fails the request with UNAVAILABLE naming the address: the caller
  retries, and a cache outage is visible instead of silently turning every request into a full encode.
- A value too large for the store is not cached; the tokens are still returned, and the service logs it.
  (A 3584 x 3584 image at the released widths is 16 384 tokens x 7168 values.)
"""

from __future__ import annotations

from typing import Protocol

import grpc

from k3.protos.v1 import cache_pb2, cache_pb2_grpc
from k3.services.cache.store import CacheStoreConfig, TieredStore, ValueTooLargeError
from k3.services.common.client import error_detail, make_channel
from k3.services.common.config import ServerConfig
from k3.services.common.errors import Internal, Unavailable

KIND = "vision_tokens"


class TokenCache(Protocol):
    """Get/put of ``vision_tokens`` blocks by content hash."""

    where: str

    def get(self, key: bytes) -> cache_pb2.Block | None: ...

    def put(self, block: cache_pb2.Block) -> bool:
        """Store ``block``; False if it is too large to be cached."""

    def close(self) -> None: ...


class LocalTokenCache:
    """An in-process LRU (the cache store's memory tier) of ``memory_bytes``."""

    def __init__(self, memory_bytes: int):
        self.where = "in-process"
        self.store = TieredStore(CacheStoreConfig(memory_bytes=memory_bytes, max_value_bytes=memory_bytes))

    def get(self, key: bytes) -> cache_pb2.Block | None:
        hit = self.store.get(KIND, key)
        return None if hit is None else cache_pb2.Block.FromString(hit[0])

    def put(self, block: cache_pb2.Block) -> bool:
        try:
            self.store.put(KIND, block.key, block.SerializeToString())
        except ValueTooLargeError:
            return False
        return True

    def close(self) -> None:
        self.store.close()


class RemoteTokenCache:
    """The cache store service at ``address``."""

    def __init__(self, address: str, server: ServerConfig, timeout_s: float):
        self.where = address
        self._timeout = timeout_s
        self._channel = make_channel(address, server)
        self._stub = cache_pb2_grpc.CacheStoreStub(self._channel)

    def _unavailable(self, method: str, error: grpc.RpcError) -> Unavailable:
        return Unavailable(f"cache store at {self.where}: {method} failed with {error.code().name}: "
                           f"{error.details()}", reason="CACHE_UNAVAILABLE")

    def get(self, key: bytes) -> cache_pb2.Block | None:
        try:
            response = self._stub.Get(cache_pb2.GetRequest(key=key, kind=KIND), timeout=self._timeout)
        except grpc.RpcError as error:
            raise self._unavailable("Get", error) from None
        return response.block if response.found else None

    def put(self, block: cache_pb2.Block) -> bool:
        try:
            self._stub.Put(cache_pb2.PutRequest(block=block), timeout=self._timeout)
        except grpc.RpcError as error:
            code, detail = error.code(), error_detail(error)
            too_large = detail is not None and detail.reason == "VALUE_TOO_LARGE"
            # RESOURCE_EXHAUSTED: the block is larger than a gRPC message may be, so the store never saw it.
            if too_large or code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                return False
            if code == grpc.StatusCode.INVALID_ARGUMENT:  # a block we built is malformed: our bug, not theirs
                raise Internal(f"cache store at {self.where} rejected a vision_tokens block: "
                               f"{error.details()}") from None
            raise self._unavailable("Put", error) from None
        return True

    def close(self) -> None:
        self._channel.close()
