"""The storage tiers behind the cache store: process memory, a local directory, Redis.

Every tier keeps its own byte budget and least-recently-used order and speaks one small interface
(``Tier``): ``put`` hands back the entries it had to evict, ``take`` removes and returns an entry (the
store moves an entry up on a hit), ``contains`` answers many keys at once (one Redis round trip for a
whole prefix lookup). The store (``store.py``) decides where entries go; tiers only store.

Design decisions:

- Budgets count value bytes only. The per-entry overhead (a 48-byte file header, Redis key names and
  index entries) is small next to a 512-token block and is left out so that one entry has the same size
  in every tier and can move between tiers without changing the accounting.
- Tiers are not thread-safe by themselves; the store serialises all calls under one lock, because a
  move between tiers is several steps that must not interleave with another request.
- A tier that cannot write an entry (disk error, Redis down) says so through ``PutOutcome.stored`` and
  the store passes the entry on to the next tier; failures are logged once per streak, not per call.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import logging
import os
import struct
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class Entry(NamedTuple):
    """One stored value, namespaced by its kind."""

    kind: str
    key: bytes
    value: bytes


class PutOutcome(NamedTuple):
    """What a tier did with a put: whether it kept the entry, and what it evicted to stay in budget."""

    stored: bool
    victims: list[Entry]


class Tier(ABC):
    """A byte-budgeted LRU store of ``(kind, key) -> value``."""

    name: str

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.hits = 0
        """Entries found here by ``get``/``take``."""
        self.evictions = 0
        """Entries pushed out to stay within the budget (explicit deletes are not evictions)."""

    @property
    def healthy(self) -> bool:
        return True

    def can_store(self, size: int) -> bool:
        """Whether a put of ``size`` bytes is worth trying now."""
        return size <= self.budget_bytes

    @abstractmethod
    def put(self, kind: str, key: bytes, value: bytes) -> PutOutcome:
        """Stores (or replaces) an entry as most recently used; evicts least recently used ones if over budget."""

    @abstractmethod
    def take(self, kind: str, key: bytes) -> bytes | None:
        """Removes an entry and returns its value, or ``None`` if absent."""

    @abstractmethod
    def contains(self, kind: str, keys: Sequence[bytes]) -> list[bool]:
        """Presence of each key, without touching the LRU order."""

    @abstractmethod
    def delete(self, kind: str, key: bytes) -> bool:
        """Removes an entry; returns whether it was present."""

    @abstractmethod
    def usage(self) -> tuple[int, int]:
        """``(blocks, bytes)`` currently stored."""

    def close(self) -> None:  # noqa: B027 - most tiers hold nothing to release
        """Releases what the tier holds open (the data itself stays where it is)."""


class MemoryTier(Tier):
    """Values in an ordered dict in this process; the dict's order is the LRU order (oldest first)."""

    name = "memory"

    def __init__(self, budget_bytes: int):
        super().__init__(budget_bytes)
        self._entries: OrderedDict[tuple[str, bytes], bytes] = OrderedDict()
        self._bytes = 0

    def get(self, kind: str, key: bytes) -> bytes | None:
        """Returns a value and marks it most recently used (a hit stays in memory)."""
        value = self._entries.get((kind, key))
        if value is not None:
            self._entries.move_to_end((kind, key))
            self.hits += 1
        return value

    def put(self, kind: str, key: bytes, value: bytes) -> PutOutcome:
        old = self._entries.pop((kind, key), None)
        if old is not None:
            self._bytes -= len(old)
        self._entries[(kind, key)] = value
        self._bytes += len(value)
        victims: list[Entry] = []
        # The new entry is the most recent, so it is only ever its own victim if it is alone: it never is,
        # because the store checks can_store first.
        while self._bytes > self.budget_bytes and len(self._entries) > 1:
            (vkind, vkey), vvalue = self._entries.popitem(last=False)
            self._bytes -= len(vvalue)
            self.evictions += 1
            victims.append(Entry(vkind, vkey, vvalue))
        return PutOutcome(True, victims)

    def take(self, kind: str, key: bytes) -> bytes | None:
        value = self._entries.pop((kind, key), None)
        if value is not None:
            self._bytes -= len(value)
            self.hits += 1
        return value

    def contains(self, kind: str, keys: Sequence[bytes]) -> list[bool]:
        return [(kind, key) in self._entries for key in keys]

    def delete(self, kind: str, key: bytes) -> bool:
        value = self._entries.pop((kind, key), None)
        if value is None:
            return False
        self._bytes -= len(value)
        return True

    def usage(self) -> tuple[int, int]:
        return len(self._entries), self._bytes


# --- disk -------------------------------------------------------------------------------------------------

_MAGIC = b"K3CBLK01"
_HEADER = struct.Struct("<8sQ32s")  # magic, value length, BLAKE2b-256 of key || value
_TMP_PREFIX = ".tmp-"
_SUFFIX = ".blk"


def _checksum(key: bytes, value: bytes) -> bytes:
    # The key is part of the checksum so that a file copied or renamed onto another key reads as corrupt.
    h = hashlib.blake2b(key, digest_size=32)
    h.update(value)
    return h.digest()


def _parse_name(name: str) -> bytes | None:
    """The key encoded in an entry's file name, or ``None`` for a name the tier did not write."""
    if not name.endswith(_SUFFIX) or len(name) != 64 + len(_SUFFIX):
        return None
    try:
        return bytes.fromhex(name[:64])
    except ValueError:
        return None


class DiskTier(Tier):
    """One file per entry under ``root/<kind>/<hex key>.blk``.

    File layout: ``magic "K3CBLK01" (8 bytes) | value length (uint64 LE) | BLAKE2b-256(key || value)
    (32 bytes) | value``. A file is written under a temporary name and renamed into place, so a reader
    (or a restart) never sees a half-written entry under a real name. Data is not fsynced: the store is a
    cache, and the checksum catches what a power loss could leave behind.

    On start the tier rebuilds its index by scanning the directory, oldest modification time first (the
    tier stamps strictly increasing mtimes on its writes, so the order survives restarts exactly).
    Leftover temporary files and files whose header or length is wrong are removed then; the full
    checksum is verified on every read rather than at start, so a large directory opens quickly, and a
    corrupt file found at read time is removed and reported as a miss.

    One store owns a directory at a time, enforced with an exclusive ``flock`` on ``root/.lock``.
    """

    name = "disk"

    def __init__(self, root: str | os.PathLike[str], budget_bytes: int, kinds: Sequence[str]):
        super().__init__(budget_bytes)
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(self.root / ".lock", "a+b")  # held open: the flock lives with it
        try:
            fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise RuntimeError(f"disk_dir {str(self.root)!r} is in use by another cache store") from None
        self._index: OrderedDict[tuple[str, bytes], int] = OrderedDict()  # -> value bytes, LRU order
        self._bytes = 0
        self._last_mtime_ns = 0
        self._tmp_names = itertools.count()
        self._healthy = True
        for kind in kinds:
            (self.root / kind).mkdir(exist_ok=True)
        self._load(kinds)

    @property
    def healthy(self) -> bool:
        return self._healthy

    def _path(self, kind: str, key: bytes) -> Path:
        return self.root / kind / (key.hex() + _SUFFIX)

    def _load(self, kinds: Sequence[str]) -> None:
        found: list[tuple[int, str, str, bytes, int]] = []
        for kind in kinds:
            with os.scandir(self.root / kind) as it:
                for dirent in it:
                    path = Path(dirent.path)
                    if dirent.name.startswith(_TMP_PREFIX):
                        path.unlink(missing_ok=True)  # an interrupted write
                        continue
                    key = _parse_name(dirent.name)
                    if key is None or not dirent.is_file():
                        continue  # not ours: leave it alone
                    stat = dirent.stat()
                    size = self._valid_size(path, stat.st_size)
                    if size is None:
                        log.warning("cache disk tier: removing corrupt entry %s", path)
                        path.unlink(missing_ok=True)
                        continue
                    found.append((stat.st_mtime_ns, dirent.name, kind, key, size))
        found.sort()
        for mtime_ns, _, kind, key, size in found:
            self._index[(kind, key)] = size
            self._bytes += size
            self._last_mtime_ns = max(self._last_mtime_ns, mtime_ns)
        dropped = 0
        while self._bytes > self.budget_bytes:  # the budget may have shrunk since the files were written
            (kind, key), size = self._index.popitem(last=False)
            self._bytes -= size
            self._path(kind, key).unlink(missing_ok=True)
            dropped += 1
        if dropped:
            log.info(
                "cache disk tier: dropped %d oldest entries over disk_bytes=%d", dropped, self.budget_bytes
            )

    @staticmethod
    def _valid_size(path: Path, file_size: int) -> int | None:
        """The value length recorded in the header, or ``None`` if the header or file length is wrong."""
        if file_size < _HEADER.size:
            return None
        with open(path, "rb") as f:
            magic, length, _ = _HEADER.unpack(f.read(_HEADER.size))
        if magic != _MAGIC or file_size != _HEADER.size + length:
            return None
        return length

    def _next_mtime_ns(self) -> int:
        self._last_mtime_ns = max(time.time_ns(), self._last_mtime_ns + 1)
        return self._last_mtime_ns

    def _failed(self, what: str, error: OSError) -> None:
        if self._healthy:
            log.warning(
                "cache disk tier: %s failed (%s); entries go to the next tier until it recovers", what, error
            )
        self._healthy = False

    def _succeeded(self) -> None:
        if not self._healthy:
            log.info("cache disk tier: writes succeed again")
        self._healthy = True

    def put(self, kind: str, key: bytes, value: bytes) -> PutOutcome:
        path = self._path(kind, key)
        tmp = path.with_name(f"{_TMP_PREFIX}{key.hex()}.{os.getpid()}.{next(self._tmp_names)}")
        try:
            with open(tmp, "wb") as f:
                f.write(_HEADER.pack(_MAGIC, len(value), _checksum(key, value)))
                f.write(value)
            mtime = self._next_mtime_ns()
            os.utime(tmp, ns=(mtime, mtime))
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            self._failed(f"writing {path}", e)
            return PutOutcome(False, [])
        self._succeeded()
        old = self._index.pop((kind, key), None)
        if old is not None:
            self._bytes -= old
        self._index[(kind, key)] = len(value)
        self._bytes += len(value)
        victims: list[Entry] = []
        while self._bytes > self.budget_bytes and len(self._index) > 1:
            (vkind, vkey), size = self._index.popitem(last=False)
            self._bytes -= size
            self.evictions += 1
            vvalue = self._read_and_remove(vkind, vkey)
            if vvalue is not None:
                victims.append(Entry(vkind, vkey, vvalue))
        return PutOutcome(True, victims)

    def _read_and_remove(self, kind: str, key: bytes) -> bytes | None:
        """Reads and verifies an entry already dropped from the index, then deletes its file."""
        path = self._path(kind, key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            log.warning("cache disk tier: entry %s vanished from disk", path)
            return None
        except OSError as e:
            self._failed(f"reading {path}", e)
            return None
        path.unlink(missing_ok=True)
        if len(data) >= _HEADER.size:
            magic, length, checksum = _HEADER.unpack_from(data)
            value = data[_HEADER.size :]
            if magic == _MAGIC and length == len(value) and checksum == _checksum(key, value):
                return value
        log.warning("cache disk tier: removed corrupt entry %s (checksum or length mismatch)", path)
        return None

    def take(self, kind: str, key: bytes) -> bytes | None:
        size = self._index.pop((kind, key), None)
        if size is None:
            return None
        self._bytes -= size
        value = self._read_and_remove(kind, key)
        if value is not None:
            self.hits += 1
        return value

    def contains(self, kind: str, keys: Sequence[bytes]) -> list[bool]:
        return [(kind, key) in self._index for key in keys]

    def delete(self, kind: str, key: bytes) -> bool:
        size = self._index.pop((kind, key), None)
        if size is None:
            return False
        self._bytes -= size
        self._path(kind, key).unlink(missing_ok=True)
        return True

    def usage(self) -> tuple[int, int]:
        return len(self._index), self._bytes

    def close(self) -> None:
        if not self._lock_file.closed:
            fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_UN)
            self._lock_file.close()


# --- redis ------------------------------------------------------------------------------------------------

# KEYS: value key, LRU sorted set, sizes hash, byte counter, access clock. ARGV: value, budget.
# Stores the value, stamps it with the next clock tick and drops the oldest entries until the byte total
# fits the budget, all in one atomic script so that concurrent stores sharing a prefix keep the byte
# counter equal to the sum of the sizes hash.
_PUT_LUA = """
local size = string.len(ARGV[1])
local old = tonumber(redis.call('HGET', KEYS[3], KEYS[1]) or '0')
redis.call('SET', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[3], KEYS[1], size)
local total = redis.call('INCRBY', KEYS[4], size - old)
redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[5]), KEYS[1])
local budget = tonumber(ARGV[2])
local evicted = 0
while total > budget do
  local victim = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if (not victim) or victim == KEYS[1] then break end
  local vsize = tonumber(redis.call('HGET', KEYS[3], victim) or '0')
  redis.call('DEL', victim)
  redis.call('HDEL', KEYS[3], victim)
  redis.call('ZREM', KEYS[2], victim)
  total = redis.call('DECRBY', KEYS[4], vsize)
  evicted = evicted + 1
end
return evicted
"""

# KEYS: value key, LRU sorted set, sizes hash, byte counter. ARGV[1]: '1' to return the value (take),
# '0' to return whether the entry existed (delete).
_REMOVE_LUA = """
local value = false
if ARGV[1] == '1' then value = redis.call('GET', KEYS[1]) end
local existed = redis.call('DEL', KEYS[1])
local size = redis.call('HGET', KEYS[3], KEYS[1])
if size then
  redis.call('HDEL', KEYS[3], KEYS[1])
  redis.call('DECRBY', KEYS[4], size)
end
redis.call('ZREM', KEYS[2], KEYS[1])
if ARGV[1] == '1' then return value end
return existed
"""


class RedisTier(Tier):
    """Values in Redis under ``prefix + kind + ':' + hex(key)``.

    Bookkeeping lives next to the values, under ``prefix + 'index:'`` (a name no kind can take): a sorted
    set ``index:lru`` of value keys scored by an access clock (``index:clock``, a counter rather than wall
    time so that clients with skewed clocks still agree on the order), a hash ``index:sizes`` of value
    sizes and a counter ``index:bytes``. Every change goes through a Lua script, so the counter always
    equals the sum of the sizes. The eviction loop touches keys it did not declare, which standalone
    Redis allows; a Redis Cluster would need all keys in one slot (a ``{hash tag}`` in the prefix) and is
    not supported here. Size Redis' ``maxmemory`` above the budget (or use ``noeviction``): keys Redis
    drops on its own show up as misses but still count against the budget until evicted here.

    Outages: every call goes through ``_guarded``. The client has short socket timeouts and no retries
    of its own; on any Redis error the tier logs one warning, reports itself unhealthy and skips Redis
    entirely (puts drop, lookups and gets miss) until ``retry_seconds`` have passed, then tries again.
    """

    name = "redis"

    def __init__(
        self,
        url: str,
        budget_bytes: int,
        prefix: str,
        retry_seconds: float,
        timeout_seconds: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ):
        super().__init__(budget_bytes)
        self.prefix = prefix
        self.retry_seconds = retry_seconds
        self._clock = clock
        # Options in the URL's query string (e.g. ?socket_timeout=2) take precedence over these defaults.
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_seconds,
            socket_connect_timeout=timeout_seconds,
            retry=Retry(NoBackoff(), 0),
        )
        self._index_keys = [f"{prefix}index:lru", f"{prefix}index:sizes", f"{prefix}index:bytes"]
        self._clock_key = f"{prefix}index:clock"
        self._put_script = self._client.register_script(_PUT_LUA)
        self._remove_script = self._client.register_script(_REMOVE_LUA)
        self._healthy = True
        self._retry_at = 0.0
        self._last_usage = (0, 0)

    @property
    def healthy(self) -> bool:
        return self._healthy

    def can_store(self, size: int) -> bool:
        return size <= self.budget_bytes and (self._healthy or self._clock() >= self._retry_at)

    def _value_key(self, kind: str, key: bytes) -> str:
        return f"{self.prefix}{kind}:{key.hex()}"

    def _guarded(self, what: str, call: Callable[[], _T], default: _T) -> _T:
        if not self._healthy and self._clock() < self._retry_at:
            return default
        try:
            result = call()
        except redis.RedisError as e:
            if self._healthy:
                log.warning(
                    "cache redis tier unavailable (%s: %s: %s); serving from the other tiers, retrying every %gs",
                    what,
                    type(e).__name__,
                    e,
                    self.retry_seconds,
                )
            self._healthy = False
            self._retry_at = self._clock() + self.retry_seconds
            return default
        if not self._healthy:
            log.info("cache redis tier is reachable again")
            self._healthy = True
        return result

    def put(self, kind: str, key: bytes, value: bytes) -> PutOutcome:
        keys = [self._value_key(kind, key), *self._index_keys, self._clock_key]
        evicted = self._guarded(
            "put", lambda: int(self._put_script(keys=keys, args=[value, self.budget_bytes])), None
        )
        if evicted is None:
            return PutOutcome(False, [])
        self.evictions += evicted
        return PutOutcome(True, [])  # the last tier: its victims are dropped inside the script

    def take(self, kind: str, key: bytes) -> bytes | None:
        keys = [self._value_key(kind, key), *self._index_keys]
        value = self._guarded("take", lambda: self._remove_script(keys=keys, args=["1"]), None)
        if value is not None:
            self.hits += 1
        return value

    def contains(self, kind: str, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []

        def exists() -> list[bool]:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._value_key(kind, key))
            return [bool(n) for n in pipe.execute()]

        return self._guarded("lookup", exists, [False] * len(keys))

    def delete(self, kind: str, key: bytes) -> bool:
        keys = [self._value_key(kind, key), *self._index_keys]
        return bool(self._guarded("delete", lambda: self._remove_script(keys=keys, args=["0"]), 0))

    def usage(self) -> tuple[int, int]:
        """Blocks and bytes as Redis reports them; the last known values while Redis is down."""

        def read() -> tuple[int, int]:
            pipe = self._client.pipeline(transaction=True)
            pipe.zcard(self._index_keys[0])
            pipe.get(self._index_keys[2])
            blocks, total = pipe.execute()
            return int(blocks), int(total or 0)

        self._last_usage = self._guarded("stats", read, self._last_usage)
        return self._last_usage

    def close(self) -> None:
        self._client.close()
