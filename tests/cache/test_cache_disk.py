"""Disk tier: restarts keep content and LRU order, corrupt and partial files are dropped, writes are atomic."""

import logging
import os
from pathlib import Path

import pytest

from k3.services.cache import CacheStoreConfig, TieredStore, block_hash

TIERS_LOGGER = "k3.services.cache.tiers"


def key(i: int) -> bytes:
    return block_hash(None, [i])


def val(i: int, size: int = 100) -> bytes:
    return bytes([i % 251]) * size


def config(root: Path, disk_bytes: int = 400) -> CacheStoreConfig:
    # Memory holds one 100-byte value, so every earlier put lands on disk.
    return CacheStoreConfig(memory_bytes=100, max_value_bytes=100, disk_dir=str(root), disk_bytes=disk_bytes)


def fill(root: Path, n: int, kind: str = "mla_block") -> None:
    with TieredStore(config(root)) as store:
        for i in range(n):
            store.put(kind, key(i), val(i))


def entry_file(root: Path, i: int, kind: str = "mla_block") -> Path:
    return root / kind / (key(i).hex() + ".blk")


def test_restart_keeps_disk_content(tmp_path):
    fill(tmp_path, 4)  # 0..2 on disk, 3 in memory (lost on close)
    with TieredStore(config(tmp_path)) as store:
        stats = store.stats()
        assert (stats.tier("disk").blocks, stats.tier("disk").bytes) == (3, 300)
        assert store.lookup("mla_block", [key(i) for i in range(4)]) == ["disk", "disk", "disk"]
        assert store.get("mla_block", key(1)) == (val(1), "disk")


def test_restart_keeps_lru_order(tmp_path):
    fill(tmp_path, 5)  # disk: 0, 1, 2, 3 (oldest first); memory: 4
    with TieredStore(config(tmp_path)) as store:
        store.put("mla_block", key(10), val(10))
        store.put("mla_block", key(11), val(11))  # 10 goes to disk, which drops its oldest entry: 0
        assert store.lookup("mla_block", [key(0)]) == []
        assert store.lookup("mla_block", [key(i) for i in (1, 2, 3, 10)]) == ["disk"] * 4
        assert store.stats().tier("disk").evictions == 1


def test_smaller_budget_at_restart_drops_oldest(tmp_path):
    fill(tmp_path, 5)
    with TieredStore(config(tmp_path, disk_bytes=200)) as store:
        assert store.lookup("mla_block", [key(2), key(3)]) == ["disk", "disk"]
        assert store.lookup("mla_block", [key(1)]) == []
    assert not entry_file(tmp_path, 0).exists() and not entry_file(tmp_path, 1).exists()


def test_truncated_file_is_removed_at_start(tmp_path, caplog):
    fill(tmp_path, 3)
    path = entry_file(tmp_path, 1)
    path.write_bytes(path.read_bytes()[:70])  # a partial write
    with caplog.at_level(logging.WARNING, logger=TIERS_LOGGER), TieredStore(config(tmp_path)) as store:
        assert not path.exists()
        assert store.stats().tier("disk").blocks == 1
        assert store.lookup("mla_block", [key(0)]) == ["disk"]
        assert store.lookup("mla_block", [key(1)]) == []
    assert any("removing corrupt entry" in r.getMessage() for r in caplog.records)


def test_corrupt_content_is_a_miss_and_removed(tmp_path, caplog):
    fill(tmp_path, 3)
    path = entry_file(tmp_path, 0)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # bit rot inside the value: header and length still look right
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger=TIERS_LOGGER), TieredStore(config(tmp_path)) as store:
        assert store.get("mla_block", key(0)) is None
        assert not path.exists()
        assert store.stats().tier("disk").blocks == 1
        assert store.get("mla_block", key(1)) == (val(1), "disk")
    assert any("checksum or length mismatch" in r.getMessage() for r in caplog.records)


def test_file_moved_onto_another_key_is_detected(tmp_path):
    fill(tmp_path, 3)
    os.replace(entry_file(tmp_path, 0), entry_file(tmp_path, 1))  # right format, wrong key
    with TieredStore(config(tmp_path)) as store:
        assert store.get("mla_block", key(1)) is None
        assert store.get("mla_block", key(0)) is None


def test_leftover_temp_files_are_removed_and_foreign_files_kept(tmp_path):
    fill(tmp_path, 2)
    kind_dir = tmp_path / "mla_block"
    leftover = kind_dir / f".tmp-{key(9).hex()}.123.0"
    leftover.write_bytes(b"K3CBLK01 half of a")  # what a crash during a write leaves
    foreign = kind_dir / "README.txt"
    foreign.write_text("not a cache entry")
    with TieredStore(config(tmp_path)) as store:
        assert not leftover.exists()
        assert foreign.exists()
        assert store.stats().tier("disk").blocks == 1


def test_writes_leave_only_complete_files(tmp_path):
    fill(tmp_path, 4)
    names = sorted(p.name for p in (tmp_path / "mla_block").iterdir())
    assert names == sorted(key(i).hex() + ".blk" for i in range(3))
    for i in range(3):
        assert entry_file(tmp_path, i).stat().st_size == 48 + 100


def test_failed_write_leaves_nothing_and_marks_disk_unhealthy(tmp_path, monkeypatch, caplog):
    store = TieredStore(config(tmp_path))
    store.put("mla_block", key(0), val(0))
    real_replace = os.replace

    def failing_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", failing_replace)
    with caplog.at_level(logging.WARNING, logger=TIERS_LOGGER):
        store.put("mla_block", key(1), val(1))  # demoting 0 fails: it has no further tier and is dropped
        store.put("mla_block", key(2), val(2))  # and again: still one warning for the streak
    assert list((tmp_path / "mla_block").iterdir()) == []  # neither a real entry nor a temp file
    disk = store.stats().tier("disk")
    assert (disk.blocks, disk.healthy) == (0, False)
    assert store.get("mla_block", key(0)) is None
    assert sum("failed" in r.getMessage() for r in caplog.records) == 1
    monkeypatch.setattr(os, "replace", real_replace)
    store.put("mla_block", key(3), val(3))
    disk = store.stats().tier("disk")
    assert (disk.blocks, disk.healthy) == (1, True)
    store.close()


def test_directory_is_owned_by_one_store(tmp_path):
    first = TieredStore(config(tmp_path))
    with pytest.raises(RuntimeError, match=r"disk_dir .* is in use by another cache store"):
        TieredStore(config(tmp_path))
    first.close()
    TieredStore(config(tmp_path)).close()
