"""Redis tier against a real redis-server: demotion/promotion, budget accounting, restarts, outages."""

import logging
import uuid

import pytest
import redis

from k3.services.cache import CacheStoreConfig, TieredStore, block_hash

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]

TIERS_LOGGER = "k3.services.cache.tiers"


def key(i: int) -> bytes:
    return block_hash(None, [i])


def val(i: int, size: int = 100) -> bytes:
    return bytes([i % 251]) * size


@pytest.fixture
def prefix(redis_url):
    """A key prefix of this test's own; its keys are deleted afterwards."""
    prefix = f"k3test:{uuid.uuid4().hex}:"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=f"{prefix}*"))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def client(redis_url):
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


def config(url: str, prefix: str, **overrides) -> CacheStoreConfig:
    # Memory holds two 100-byte values, Redis three.
    fields = dict(memory_bytes=200, max_value_bytes=200, redis_url=url, redis_bytes=300, redis_prefix=prefix)
    fields.update(overrides)
    return CacheStoreConfig(**fields)


def assert_accounting_consistent(client, prefix: str, store: TieredStore) -> None:
    sizes = {k: int(v) for k, v in client.hgetall(f"{prefix}index:sizes").items()}
    lru = client.zrange(f"{prefix}index:lru", 0, -1)
    assert sorted(lru) == sorted(sizes)
    assert all(client.strlen(k) == n for k, n in sizes.items())
    assert int(client.get(f"{prefix}index:bytes") or 0) == sum(sizes.values())
    tier = store.stats().tier("redis")
    assert (tier.blocks, tier.bytes) == (len(sizes), sum(sizes.values()))


def test_demotion_into_redis_and_promotion_back(redis_url, prefix, client):
    with TieredStore(config(redis_url, prefix)) as store:
        for i in range(3):
            store.put("mla_block", key(i), val(i))
        value_key = f"{prefix}mla_block:{key(0).hex()}".encode()
        assert client.get(value_key) == val(0)
        assert store.lookup("mla_block", [key(0), key(1), key(2)]) == ["redis", "memory", "memory"]
        assert_accounting_consistent(client, prefix, store)

        assert store.get("mla_block", key(0)) == (val(0), "redis")
        assert not client.exists(value_key)  # moved, not copied
        assert store.lookup("mla_block", [key(0), key(1), key(2)]) == ["memory", "redis", "memory"]
        stats = store.stats()
        assert (stats.tier("redis").hits, stats.tier("redis").blocks, stats.tier("redis").healthy) == (
            1,
            1,
            True,
        )
        assert_accounting_consistent(client, prefix, store)


def test_memory_disk_redis_cascade(redis_url, prefix, client, tmp_path):
    cfg = config(redis_url, prefix, disk_dir=str(tmp_path / "d"), disk_bytes=200)
    with TieredStore(cfg) as store:
        for i in range(6):
            store.put("kda_checkpoint", key(i), val(i))
        keys = [key(i) for i in range(6)]
        assert store.lookup("kda_checkpoint", keys) == ["redis", "redis", "disk", "disk", "memory", "memory"]
        assert store.get("kda_checkpoint", key(1)) == (val(1), "redis")
        assert store.lookup("kda_checkpoint", keys) == ["redis", "memory", "redis", "disk", "disk", "memory"]
        assert [t.name for t in store.stats().tiers] == ["memory", "disk", "redis"]
        assert_accounting_consistent(client, prefix, store)


def test_redis_budget_drops_least_recently_used(redis_url, prefix, client):
    with TieredStore(config(redis_url, prefix, redis_bytes=250)) as store:
        for i in range(5):  # 0, 1, 2 demoted; Redis fits two of them
            store.put("mla_block", key(i), val(i))
        assert store.lookup("mla_block", [key(0)]) == []
        assert store.lookup("mla_block", [key(1), key(2)]) == ["redis", "redis"]
        tier = store.stats().tier("redis")
        assert (tier.blocks, tier.bytes, tier.evictions) == (2, 200, 1)
        assert_accounting_consistent(client, prefix, store)


def test_redis_content_survives_store_restart_and_evict(redis_url, prefix, client):
    with TieredStore(config(redis_url, prefix)) as store:
        for i in range(4):
            store.put("vision_tokens", key(i), val(i))
    with TieredStore(config(redis_url, prefix)) as store:
        assert store.lookup("vision_tokens", [key(0), key(1), key(2)]) == ["redis", "redis"]
        assert store.lookup("mla_block", [key(0)]) == []  # kinds stay separate in Redis too
        assert store.evict("vision_tokens", [key(0), key(3)]) == 1
        assert store.lookup("vision_tokens", [key(0)]) == []
        assert_accounting_consistent(client, prefix, store)


def test_put_replaces_older_copy_in_redis(redis_url, prefix, client):
    with TieredStore(config(redis_url, prefix)) as store:
        for i in range(3):
            store.put("mla_block", key(i), val(i))
        store.put("mla_block", key(0), val(7, 20))
        assert not client.exists(f"{prefix}mla_block:{key(0).hex()}")
        assert store.get("mla_block", key(0)) == (val(7, 20), "memory")
        assert_accounting_consistent(client, prefix, store)


def redis_warnings(caplog) -> int:
    return sum(
        r.levelno == logging.WARNING and "redis tier unavailable" in r.getMessage() for r in caplog.records
    )


def test_redis_outage_degrades_and_recovers(redis_server_factory, tmp_path, caplog):
    server = redis_server_factory()
    cfg = config(server.url, "k3test:", disk_dir=str(tmp_path / "d"), disk_bytes=200, redis_retry_seconds=0)
    store = TieredStore(cfg)
    caplog.set_level(logging.INFO, logger=TIERS_LOGGER)
    for i in range(5):
        store.put("mla_block", key(i), val(i))  # 0 in Redis, 1-2 on disk, 3-4 in memory
    assert store.lookup("mla_block", [key(0)]) == ["redis"]

    server.stop()
    assert store.get("mla_block", key(4)) == (val(4), "memory")
    assert store.get("mla_block", key(1)) == (val(1), "disk")
    assert store.get("mla_block", key(0)) is None  # unreachable, reported as a miss
    assert store.lookup("mla_block", [key(2), key(4)]) == ["disk", "memory"]
    store.put("mla_block", key(5), val(5))  # demotes into the dead tier: dropped, not raised
    assert store.evict("mla_block", [key(0)]) == 0
    stats = store.stats()
    assert stats.tier("redis").healthy is False
    assert stats.tier("memory").healthy and stats.tier("disk").healthy
    assert redis_warnings(caplog) == 1  # once per outage, not per call

    server.start()  # same port, empty (no persistence)
    assert store.stats().tier("redis").healthy is True
    assert any("reachable again" in r.getMessage() for r in caplog.records)
    for i in range(6, 9):
        store.put("mla_block", key(i), val(i))
    assert store.stats().tier("redis").blocks > 0

    server.stop()  # a second outage warns again
    assert store.get("mla_block", key(99)) is None
    assert redis_warnings(caplog) == 2
    store.close()


def test_marked_down_tier_waits_for_retry_window(redis_server_factory, caplog):
    server = redis_server_factory()
    server.stop()
    cfg = config(server.url, "k3test:", redis_retry_seconds=3600)
    with TieredStore(cfg) as store, caplog.at_level(logging.WARNING, logger=TIERS_LOGGER):
        assert store.stats().tier("redis").healthy is False
        server.start()
        # Redis is back, but the tier is not retried before redis_retry_seconds have passed.
        for i in range(4):
            store.put("mla_block", key(i), val(i))
        assert store.stats().tier("redis").healthy is False
        client = redis.Redis.from_url(server.url)
        assert client.dbsize() == 0
        client.close()
    assert redis_warnings(caplog) == 1


def test_unreachable_redis_at_start_still_serves(redis_server_factory):
    server = redis_server_factory()
    server.stop()  # a port nothing listens on
    with TieredStore(config(server.url, "k3test:")) as store:
        assert store.put("mla_block", key(0), val(0)) == "memory"
        assert store.lookup("mla_block", [key(0), key(1)]) == ["memory"]
        assert store.get("mla_block", key(0)) == (val(0), "memory")
        assert store.get("mla_block", key(1)) is None
        tier = store.stats().tier("redis")
        assert (tier.healthy, tier.blocks, tier.budget_bytes) == (False, 0, 300)
