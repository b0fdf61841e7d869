"""TieredStore over memory and disk: LRU budgets, demotion/promotion, lookup, evict, stats, bad inputs."""

import threading

import pytest

from k3.services.cache import (
    BadKeyError,
    CacheStoreConfig,
    StoreClosedError,
    TieredStore,
    UnknownKindError,
    ValueTooLargeError,
    block_hash,
)
from k3.services.common.config import ConfigError, load_config


def key(i: int) -> bytes:
    return block_hash(None, [i])


def val(i: int, size: int = 100) -> bytes:
    return bytes([i % 251]) * size


@pytest.fixture
def memory_store():
    # Room for exactly three 100-byte values.
    store = TieredStore(CacheStoreConfig(memory_bytes=300, max_value_bytes=300))
    yield store
    store.close()


@pytest.fixture
def two_tier(tmp_path):
    # Memory holds two 100-byte values, disk two more.
    cfg = CacheStoreConfig(
        memory_bytes=200, max_value_bytes=200, disk_dir=str(tmp_path / "d"), disk_bytes=200
    )
    store = TieredStore(cfg)
    yield store
    store.close()


def test_put_get_roundtrip_and_counters(memory_store):
    assert memory_store.put("mla_block", key(1), val(1)) == "memory"
    assert memory_store.get("mla_block", key(1)) == (val(1), "memory")
    assert memory_store.get("mla_block", key(2)) is None
    stats = memory_store.stats()
    assert (stats.puts, stats.gets, stats.get_hits) == (1, 2, 1)
    mem = stats.tier("memory")
    assert (mem.blocks, mem.bytes, mem.budget_bytes, mem.hits, mem.healthy) == (1, 100, 300, 1, True)
    assert [t.name for t in stats.tiers] == ["memory"]


def test_memory_lru_evicts_least_recently_used(memory_store):
    for i in range(3):
        memory_store.put("mla_block", key(i), val(i))
    memory_store.get("mla_block", key(0))  # 0 becomes most recent; 1 is now the oldest
    memory_store.put("mla_block", key(3), val(3))
    assert memory_store.get("mla_block", key(1)) is None
    for i in (0, 2, 3):
        assert memory_store.get("mla_block", key(i)) == (val(i), "memory")
    mem = memory_store.stats().tier("memory")
    assert (mem.blocks, mem.bytes, mem.evictions) == (3, 300, 1)


def test_replacing_a_value_updates_bytes(memory_store):
    memory_store.put("mla_block", key(1), val(1, 100))
    memory_store.put("mla_block", key(1), val(2, 40))
    assert memory_store.get("mla_block", key(1)) == (val(2, 40), "memory")
    mem = memory_store.stats().tier("memory")
    assert (mem.blocks, mem.bytes) == (1, 40)


def test_demotion_to_disk_and_promotion_back(two_tier):
    for i in range(3):
        two_tier.put("mla_block", key(i), val(i))
    assert two_tier.lookup("mla_block", [key(0), key(1), key(2)]) == ["disk", "memory", "memory"]
    # A hit on disk moves the entry to memory, which pushes memory's oldest (1) down to disk.
    assert two_tier.get("mla_block", key(0)) == (val(0), "disk")
    assert two_tier.lookup("mla_block", [key(0), key(1), key(2)]) == ["memory", "disk", "memory"]
    assert two_tier.get("mla_block", key(0)) == (val(0), "memory")
    stats = two_tier.stats()
    assert (stats.tier("memory").blocks, stats.tier("disk").blocks) == (2, 1)
    assert (stats.tier("memory").hits, stats.tier("disk").hits) == (1, 1)
    assert (stats.tier("memory").evictions, stats.tier("disk").evictions) == (2, 0)


def test_overflow_cascades_and_last_tier_drops(two_tier):
    for i in range(5):
        two_tier.put("mla_block", key(i), val(i))
    keys = [key(i) for i in range(5)]
    assert two_tier.lookup("mla_block", keys) == []  # 0 was dropped by the last tier
    assert two_tier.lookup("mla_block", keys[1:]) == ["disk", "disk", "memory", "memory"]
    stats = two_tier.stats()
    assert (stats.tier("memory").evictions, stats.tier("disk").evictions) == (3, 1)
    assert (stats.tier("disk").blocks, stats.tier("disk").bytes) == (2, 200)


def test_put_removes_older_copy_from_lower_tier(two_tier):
    for i in range(3):
        two_tier.put("mla_block", key(i), val(i))  # 0 now on disk
    two_tier.put("mla_block", key(0), val(9, 50))
    stats = two_tier.stats()
    assert stats.tier("disk").blocks == 1  # 0 left the disk, 1 was demoted in its place
    assert two_tier.lookup("mla_block", [key(0)]) == ["memory"]
    assert two_tier.get("mla_block", key(0)) == (val(9, 50), "memory")


def test_lookup_stops_at_first_miss_and_does_not_refresh_recency(memory_store):
    for i in (0, 1, 3):
        memory_store.put("kda_checkpoint", key(i), val(i))
    keys = [key(i) for i in range(4)]
    assert memory_store.lookup("kda_checkpoint", keys) == ["memory", "memory"]
    assert memory_store.lookup("kda_checkpoint", keys[2:]) == []
    assert memory_store.lookup("kda_checkpoint", []) == []
    stats = memory_store.stats()
    assert (stats.lookups, stats.lookup_keys, stats.lookup_hit_blocks) == (3, 6, 2)
    # 0 was looked up but not fetched, so it is still the least recently used entry.
    memory_store.put("kda_checkpoint", key(4), val(4))
    assert memory_store.lookup("kda_checkpoint", [key(0)]) == []
    assert memory_store.lookup("kda_checkpoint", [key(1)]) == ["memory"]


def test_evict_removes_from_every_tier(two_tier):
    for i in range(4):
        two_tier.put("mla_block", key(i), val(i))  # 0, 1 on disk; 2, 3 in memory
    assert two_tier.evict("mla_block", [key(0), key(3), key(0), key(42)]) == 2
    assert two_tier.get("mla_block", key(0)) is None
    assert two_tier.get("mla_block", key(3)) is None
    assert two_tier.evict("mla_block", [key(0)]) == 0
    stats = two_tier.stats()
    assert (stats.tier("memory").blocks, stats.tier("disk").blocks) == (1, 1)
    # Explicit removal is not a budget eviction.
    assert (stats.tier("memory").evictions, stats.tier("disk").evictions) == (2, 0)


def test_kinds_are_separate_namespaces(two_tier):
    two_tier.put("mla_block", key(1), val(1))
    assert two_tier.get("kda_checkpoint", key(1)) is None
    assert two_tier.lookup("vision_tokens", [key(1)]) == []
    two_tier.put("kda_checkpoint", key(1), val(2))
    two_tier.put("vision_tokens", key(7), val(7))  # pushes mla_block/1 to disk
    assert two_tier.get("mla_block", key(1)) == (val(1), "disk")
    assert two_tier.get("kda_checkpoint", key(1)) == (val(2), "disk")
    assert two_tier.evict("vision_tokens", [key(1)]) == 0


def test_bad_inputs_raise_precise_errors(memory_store):
    with pytest.raises(
        UnknownKindError, match=r"kind must be one of mla_block, kda_checkpoint, vision_tokens; got 'kv'"
    ):
        memory_store.put("kv", key(1), b"x")
    with pytest.raises(UnknownKindError, match="got 'nope'"):
        memory_store.lookup("nope", [key(1)])
    with pytest.raises(BadKeyError, match=r"key must be a 32-byte block hash, got 31 bytes"):
        memory_store.get("mla_block", key(1)[:31])
    with pytest.raises(BadKeyError, match=r"key must be bytes, got str"):
        memory_store.put("mla_block", "a" * 32, b"x")
    with pytest.raises(BadKeyError, match=r"keys\[1\] must be a 32-byte block hash, got 0 bytes"):
        memory_store.lookup("mla_block", [key(1), b""])
    with pytest.raises(BadKeyError, match=r"keys\[0\] must be bytes, got int"):
        memory_store.evict("mla_block", key(1))  # a single key instead of a list
    with pytest.raises(ValueTooLargeError, match=r"value is 301 bytes, more than max_value_bytes=300"):
        memory_store.put("mla_block", key(1), b"x" * 301)
    with pytest.raises(TypeError, match=r"value must be bytes, got str"):
        memory_store.put("mla_block", key(1), "text")
    stats = memory_store.stats()
    assert (stats.puts, stats.gets, stats.lookups, stats.tier("memory").blocks) == (0, 0, 0, 0)
    # Bytes-like inputs are accepted.
    assert memory_store.put("mla_block", bytearray(key(1)), memoryview(b"abc")) == "memory"
    assert memory_store.get("mla_block", key(1)) == (b"abc", "memory")


def test_config_validation_names_the_field():
    with pytest.raises(
        ConfigError, match=r"^max_value_bytes: must not exceed memory_bytes \(1024\), got 2048$"
    ):
        CacheStoreConfig(memory_bytes=1024, max_value_bytes=2048)
    with pytest.raises(ConfigError, match=r"^disk_bytes: must be positive, got 0$"):
        CacheStoreConfig(disk_bytes=0)
    with pytest.raises(ConfigError, match=r"^redis_retry_seconds: must be >= 0, got -1$"):
        CacheStoreConfig(redis_retry_seconds=-1)
    with pytest.raises(ConfigError, match=r"^redis_prefix: must not be empty$"):
        CacheStoreConfig(redis_prefix="")
    with pytest.raises(
        ConfigError,
        match=r"^redis_url: must start with one of redis://, rediss://, unix://, got 'localhost:6379'$",
    ):
        CacheStoreConfig(redis_url="localhost:6379")


def test_config_loads_from_file_and_environment(tmp_path):
    path = tmp_path / "cache.yaml"
    path.write_text("memory_bytes: 4096\nmax_value_bytes: 1024\ndisk_dir: /var/cache/k3\n")
    cfg = load_config(CacheStoreConfig, path, env={"K3_REDIS_URL": "redis://r:6379/0"})
    assert (cfg.memory_bytes, cfg.disk_dir, cfg.redis_url) == (4096, "/var/cache/k3", "redis://r:6379/0")
    with pytest.raises(ConfigError, match="max_value_bytes"):
        load_config(CacheStoreConfig, env={"K3_MEMORY_BYTES": "1024"})


def test_closed_store_refuses_calls():
    store = TieredStore(CacheStoreConfig(memory_bytes=1000, max_value_bytes=100))
    store.put("mla_block", key(1), b"x")
    store.close()
    store.close()  # idempotent
    with pytest.raises(StoreClosedError, match="the cache store is closed"):
        store.get("mla_block", key(1))
    with pytest.raises(StoreClosedError):
        store.stats()


@pytest.mark.timeout(60)
def test_concurrent_calls_keep_accounting_consistent(tmp_path):
    cfg = CacheStoreConfig(
        memory_bytes=1000, max_value_bytes=100, disk_dir=str(tmp_path / "d"), disk_bytes=1500
    )
    store = TieredStore(cfg)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            for step in range(150):
                i = (seed * 7 + step * 13) % 40
                op = step % 3
                if op == 0:
                    store.put("mla_block", key(i), val(i, 50 + i))
                elif op == 1:
                    hit = store.get("mla_block", key(i))
                    if hit is not None:
                        assert hit[0] == val(i, 50 + i)  # never a torn or foreign value
                else:
                    store.lookup("mla_block", [key(j) for j in range(i, i + 4)])
        except BaseException as e:  # surfaced in the main thread below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    stats = store.stats()
    total_blocks = 0
    total_bytes = 0
    for i in range(40):
        where = store.lookup("mla_block", [key(i)])
        if where:
            total_blocks += 1
            total_bytes += 50 + i
    assert sum(t.blocks for t in stats.tiers) == total_blocks
    assert sum(t.bytes for t in stats.tiers) == total_bytes
    assert stats.tier("memory").bytes <= 1000 and stats.tier("disk").bytes <= 1500
    assert stats.puts == 4 * 50 and stats.gets == 4 * 50
    store.close()
