"""The cache store: KV/state blocks addressed by chained 512-token block hashes, kept in tiered storage.

``hashing`` computes the block keys, ``tiers`` holds the memory/disk/Redis tiers and ``store`` is the
engine that moves entries between them; the gRPC servicer sits on top of ``TieredStore``.
"""

from k3.services.cache.hashing import BLOCK_TOKENS, KEY_BYTES, block_hash, chain_block_hashes
from k3.services.cache.store import (
    KINDS,
    BadKeyError,
    CacheStoreConfig,
    StoreClosedError,
    StoreStats,
    TieredStore,
    TierStats,
    UnknownKindError,
    ValueTooLargeError,
)

__all__ = [
    "BLOCK_TOKENS",
    "KEY_BYTES",
    "KINDS",
    "BadKeyError",
    "CacheStoreConfig",
    "StoreClosedError",
    "StoreStats",
    "TierStats",
    "TieredStore",
    "UnknownKindError",
    "ValueTooLargeError",
    "block_hash",
    "chain_block_hashes",
]
