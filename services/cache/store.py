"""The cache store engine: values addressed by (kind, 32-byte chained block hash) over tiered storage.

Tiers are ordered memory -> disk -> Redis (disk and Redis are optional). Decisions:

- Exclusive tiers: an entry lives in exactly one tier. A put lands in memory (after removing any older
  copy below); when a tier goes over its budget its least recently used entries move down one tier, and
  the last tier drops them. A get that hits a lower tier moves the entry back up to memory. Moving
  instead of copying keeps every byte budget honest and makes ``lookup``'s answer (where each block
  lives) unambiguous; the price is a rewrite when a promoted entry is later demoted again.
- Redis is treated as belonging to this store (its ``redis_prefix``); several stores sharing one Redis
  should use distinct prefixes, since a promotion removes the entry from Redis.
- Lookups do not refresh recency: the router asks about many prefixes it may never fetch, and only the
  gets that follow (from prefill) say what is actually used.
- One lock serialises every call. A move between tiers is several steps that must not interleave with
  another request, and memory operations take microseconds; a dead Redis costs at most one short
  timeout per ``redis_retry_seconds`` because the Redis tier skips itself while marked down.
- Errors in caller input are raised as ``ValueError`` subclasses naming the field; failures of the disk
  or Redis tiers are never raised to callers: the store degrades and reports them in ``stats()``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from k3.services.cache.hashing import KEY_BYTES
from k3.services.cache.tiers import DiskTier, Entry, MemoryTier, RedisTier, Tier
from k3.services.common.config import ConfigError, documented

KINDS = ("mla_block", "kda_checkpoint", "vision_tokens")
"""What the store holds: MLA latent blocks, KDA state checkpoints, encoded visual tokens."""


class UnknownKindError(ValueError):
    """``kind`` is not one of ``KINDS``."""


class BadKeyError(ValueError):
    """A key is not a 32-byte block hash."""


class ValueTooLargeError(ValueError):
    """A value is larger than ``CacheStoreConfig.max_value_bytes``."""


class StoreClosedError(RuntimeError):
    """The store was used after ``close()``."""


_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


@dataclass
class CacheStoreConfig:
    """Budgets and locations of the cache store's tiers (the ``store`` section of ``k3 serve cache``)."""

    memory_bytes: int = documented(
        1 << 30, doc="Byte budget of the in-process memory tier (always present, always the first tier)."
    )
    disk_dir: str | None = documented(
        None, doc="Directory of the disk tier; None disables it. Its content survives restarts."
    )
    disk_bytes: int = documented(8 << 30, doc="Byte budget of the disk tier.")
    redis_url: str | None = documented(
        None, doc="redis://host:port/db of the Redis tier (the last tier); None disables it."
    )
    redis_bytes: int = documented(
        4 << 30, doc="Byte budget of the Redis tier, enforced by the store (independent of Redis' maxmemory)."
    )
    redis_prefix: str = documented(
        "k3:cache:",
        doc="Prefix of every Redis key the store writes; each store sharing a Redis needs its own.",
    )
    redis_retry_seconds: float = documented(
        5.0, doc="How long a failed Redis tier stays marked down before the store tries it again."
    )
    max_value_bytes: int = documented(
        256 << 20,
        doc="Largest value a put accepts; at most memory_bytes, so every value fits the first tier.",
    )

    def __post_init__(self) -> None:
        for name in ("memory_bytes", "disk_bytes", "redis_bytes", "max_value_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"must be positive, got {getattr(self, name)}", field=name)
        if self.max_value_bytes > self.memory_bytes:
            raise ConfigError(
                f"must not exceed memory_bytes ({self.memory_bytes}), got {self.max_value_bytes}",
                field="max_value_bytes",
            )
        if self.redis_retry_seconds < 0:
            raise ConfigError(f"must be >= 0, got {self.redis_retry_seconds}", field="redis_retry_seconds")
        if not self.redis_prefix:
            raise ConfigError("must not be empty", field="redis_prefix")
        if self.redis_url is not None and not self.redis_url.startswith(_REDIS_SCHEMES):
            raise ConfigError(
                f"must start with one of {', '.join(_REDIS_SCHEMES)}, got {self.redis_url!r}",
                field="redis_url",
            )


@dataclass
class TierStats:
    name: str
    blocks: int
    bytes: int
    budget_bytes: int
    hits: int
    """Gets answered from this tier."""
    evictions: int
    """Entries pushed out of this tier by its budget (moved down, or dropped by the last tier)."""
    healthy: bool


@dataclass
class StoreStats:
    tiers: list[TierStats] = field(default_factory=list)
    lookups: int = 0
    lookup_keys: int = 0
    lookup_hit_blocks: int = 0
    puts: int = 0
    gets: int = 0
    get_hits: int = 0

    def tier(self, name: str) -> TierStats:
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise KeyError(f"no tier named {name!r}; tiers are {[t.name for t in self.tiers]}")


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise UnknownKindError(f"kind must be one of {', '.join(KINDS)}; got {kind!r}")


def _check_key(key: bytes, field_name: str = "key") -> bytes:
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise BadKeyError(f"{field_name} must be bytes, got {type(key).__name__}")
    if len(key) != KEY_BYTES:
        raise BadKeyError(f"{field_name} must be a {KEY_BYTES}-byte block hash, got {len(key)} bytes")
    return bytes(key)


def _check_keys(keys: Sequence[bytes]) -> list[bytes]:
    return [_check_key(key, f"keys[{i}]") for i, key in enumerate(keys)]


class TieredStore:
    """Thread-safe tiered LRU cache of ``(kind, key) -> bytes``. See the module docstring."""

    def __init__(self, config: CacheStoreConfig):
        self.config = config
        self._lock = threading.Lock()
        self._closed = False
        self._memory = MemoryTier(config.memory_bytes)
        tiers: list[Tier] = [self._memory]
        try:
            if config.disk_dir is not None:
                tiers.append(DiskTier(config.disk_dir, config.disk_bytes, KINDS))
            if config.redis_url is not None:
                tiers.append(
                    RedisTier(
                        config.redis_url, config.redis_bytes, config.redis_prefix, config.redis_retry_seconds
                    )
                )
        except BaseException:
            for tier in tiers:
                tier.close()
            raise
        self._tiers: tuple[Tier, ...] = tuple(tiers)
        self._counters = StoreStats()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tier_names(self) -> list[str]:
        return [tier.name for tier in self._tiers]

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the cache store is closed")

    def _place(self, start: int, entry: Entry) -> str | None:
        """Stores ``entry`` in the first tier from ``start`` on that takes it; cascades evictions down.

        Returns the tier name, or ``None`` if no tier took it (it is dropped).
        """
        for i in range(start, len(self._tiers)):
            tier = self._tiers[i]
            if not tier.can_store(len(entry.value)):
                continue
            outcome = tier.put(entry.kind, entry.key, entry.value)
            for victim in outcome.victims:
                self._place(i + 1, victim)
            if outcome.stored:
                return tier.name
        return None

    def put(self, kind: str, key: bytes, value: bytes) -> str:
        """Stores ``value`` under ``(kind, key)``, replacing any previous value; returns the tier (memory)."""
        _check_kind(kind)
        key = _check_key(key)
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError(f"value must be bytes, got {type(value).__name__}")
        value = bytes(value)
        if len(value) > self.config.max_value_bytes:
            raise ValueTooLargeError(
                f"value is {len(value)} bytes, more than max_value_bytes={self.config.max_value_bytes}"
            )
        with self._lock:
            self._check_open()
            self._counters.puts += 1
            if not self._memory.contains(kind, [key])[0]:
                for tier in self._tiers[1:]:
                    tier.delete(kind, key)
            outcome = self._memory.put(kind, key, value)
            for victim in outcome.victims:
                self._place(1, victim)
            return self._memory.name

    def get(self, kind: str, key: bytes) -> tuple[bytes, str] | None:
        """``(value, tier it was found in)``, or ``None``. A hit below memory moves the entry to memory."""
        _check_kind(kind)
        key = _check_key(key)
        with self._lock:
            self._check_open()
            self._counters.gets += 1
            value = self._memory.get(kind, key)
            if value is not None:
                self._counters.get_hits += 1
                return value, self._memory.name
            for tier in self._tiers[1:]:
                value = tier.take(kind, key)
                if value is not None:
                    self._counters.get_hits += 1
                    self._place(0, Entry(kind, key, value))
                    return value, tier.name
            return None

    def lookup(self, kind: str, keys: list[bytes]) -> list[str]:
        """Tier of each block of the longest present prefix of ``keys`` (empty if the first is missing)."""
        _check_kind(kind)
        keys = _check_keys(keys)
        with self._lock:
            self._check_open()
            found: list[str | None] = [None] * len(keys)
            pending = list(range(len(keys)))
            for tier in self._tiers:
                if not pending:
                    break
                present = tier.contains(kind, [keys[i] for i in pending])
                for i, hit in zip(pending, present, strict=True):
                    if hit:
                        found[i] = tier.name
                pending = [i for i in pending if found[i] is None]
            tiers: list[str] = []
            for name in found:
                if name is None:
                    break
                tiers.append(name)
            self._counters.lookups += 1
            self._counters.lookup_keys += len(keys)
            self._counters.lookup_hit_blocks += len(tiers)
            return tiers

    def evict(self, kind: str, keys: list[bytes]) -> int:
        """Removes the given entries from every tier; returns how many were present.

        Entries in Redis cannot be removed while Redis is down; they are not counted.
        """
        _check_kind(kind)
        keys = _check_keys(keys)
        with self._lock:
            self._check_open()
            evicted = 0
            for key in dict.fromkeys(keys):
                # Every tier, not just the first hit: a put during a Redis outage may have left an older copy.
                removed = [tier.delete(kind, key) for tier in self._tiers]
                evicted += any(removed)
            return evicted

    def stats(self) -> StoreStats:
        with self._lock:
            self._check_open()
            tiers = []
            for tier in self._tiers:
                blocks, used = tier.usage()
                tiers.append(
                    TierStats(
                        name=tier.name,
                        blocks=blocks,
                        bytes=used,
                        budget_bytes=tier.budget_bytes,
                        hits=tier.hits,
                        evictions=tier.evictions,
                        healthy=tier.healthy,
                    )
                )
            c = self._counters
            return StoreStats(
                tiers=tiers,
                lookups=c.lookups,
                lookup_keys=c.lookup_keys,
                lookup_hit_blocks=c.lookup_hit_blocks,
                puts=c.puts,
                gets=c.gets,
                get_hits=c.get_hits,
            )

    def close(self) -> None:
        """Releases the disk directory and the Redis connections. Memory content is discarded; disk and
        Redis content stays for the next store. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for tier in self._tiers:
                tier.close()
