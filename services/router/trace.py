"""Replay a Mooncake-format request trace against a prefix-cache index (``k3 bench trace``).

Trace format (Mooncake's public traces): one JSON object per line with ``timestamp`` (ms), ``input_length``
and ``output_length`` (tokens) and ``hash_ids``, one id per 512-token block of the prompt, the last block
possibly partial; equal leading ids mean a shared prefix. So ``len(hash_ids) == ceil(input_length / 512)``
and a line that breaks this is an error, as is anything else malformed (the error names the line).

The index models the cache store as the router sees it:

- a request's blocks are looked up as a prefix: hits are counted from the first block and stop at the
  first block that is not cached (a later block is useless without the state before it);
- then every block of the request is inserted, or touched if present, in order;
- without a capacity the index keeps everything; with ``capacity_blocks`` it is an LRU over that many
  blocks (the least recently inserted or touched block goes first).

Requests are replayed in file order. Cost is the input cost at the configured prices: hit blocks' tokens at
the cache-hit price, the rest at the miss price (every block holds 512 tokens except the last, which holds
``input_length - 512 * (n - 1)``), compared with every input token at the miss price.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from k3.services.router.config import PricesConfig
from k3.services.router.usage import PER_MILLION

TRACE_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A malformed trace line (the message starts with ``line N:``)."""


@dataclass(frozen=True)
class TraceRequest:
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def block_tokens(self, i: int, block_tokens: int = TRACE_BLOCK_TOKENS) -> int:
        """Tokens in block ``i`` (the last block may be partial)."""
        if i == len(self.hash_ids) - 1:
            return self.input_length - block_tokens * i
        return block_tokens


def _int(value, line: int, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceError(f"line {line}: {name} must be an integer >= {minimum}, got {value!r}")
    return value


def parse_line(text: str, line: int, block_tokens: int = TRACE_BLOCK_TOKENS) -> TraceRequest:
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"line {line}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(record, dict):
        raise TraceError(f"line {line}: expected a JSON object, got {type(record).__name__}")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in record]
    if missing:
        raise TraceError(f"line {line}: missing field(s) {', '.join(missing)}")
    timestamp = record["timestamp"]
    if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)) or not math.isfinite(timestamp) \
            or timestamp < 0:
        raise TraceError(f"line {line}: timestamp must be a number >= 0, got {timestamp!r}")
    input_length = _int(record["input_length"], line, "input_length", 1)
    output_length = _int(record["output_length"], line, "output_length", 0)
    hash_ids = record["hash_ids"]
    if not isinstance(hash_ids, list):
        raise TraceError(f"line {line}: hash_ids must be a list of integers, got {type(hash_ids).__name__}")
    for i, h in enumerate(hash_ids):
        if isinstance(h, bool) or not isinstance(h, int):
            raise TraceError(f"line {line}: hash_ids[{i}] must be an integer, got {h!r}")
    expected = -(-input_length // block_tokens)
    if len(hash_ids) != expected:
        raise TraceError(
            f"line {line}: {len(hash_ids)} hash_ids for input_length {input_length}; blocks of {block_tokens} "
            f"tokens need exactly {expected}"
        )
    return TraceRequest(float(timestamp), input_length, output_length, tuple(hash_ids))


def read_trace(lines: Iterable[str], block_tokens: int = TRACE_BLOCK_TOKENS) -> Iterator[TraceRequest]:
    """Parse trace lines (blank lines are skipped; line numbers count from 1)."""
    for number, text in enumerate(lines, start=1):
        if text.strip():
            yield parse_line(text, number, block_tokens)


class PrefixCacheIndex:
    """Block ids with prefix lookup and optional LRU capacity (module docstring)."""

    def __init__(self, capacity_blocks: int | None = None):
        if capacity_blocks is not None and capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def lookup(self, hash_ids: tuple[int, ...]) -> int:
        """How many leading blocks are cached."""
        hits = 0
        for h in hash_ids:
            if h not in self._blocks:
                break
            hits += 1
        return hits

    def insert(self, hash_ids: tuple[int, ...]) -> None:
        """Insert or touch every block in order, evicting the least recently used beyond the capacity."""
        for h in hash_ids:
            if h in self._blocks:
                self._blocks.move_to_end(h)
            else:
                self._blocks[h] = None
                if self.capacity is not None and len(self._blocks) > self.capacity:
                    self._blocks.popitem(last=False)
                    self.evictions += 1


@dataclass
class ReplayResult:
    requests: int = 0
    blocks: int = 0
    hit_blocks: int = 0
    input_tokens: int = 0
    hit_tokens: int = 0
    output_tokens: int = 0
    evictions: int = 0
    capacity_blocks: int | None = None
    unique_blocks: int = 0

    def report(self, prices: PricesConfig) -> dict:
        miss_tokens = self.input_tokens - self.hit_tokens
        with_cache = (self.hit_tokens * prices.cache_hit_input + miss_tokens * prices.cache_miss_input) / PER_MILLION
        without = self.input_tokens * prices.cache_miss_input / PER_MILLION
        return {
            "requests": self.requests,
            "blocks": self.blocks,
            "hit_blocks": self.hit_blocks,
            "hit_ratio": self.hit_blocks / self.blocks if self.blocks else 0.0,
            "input_tokens": self.input_tokens,
            "hit_tokens": self.hit_tokens,
            "token_hit_ratio": self.hit_tokens / self.input_tokens if self.input_tokens else 0.0,
            "output_tokens": self.output_tokens,
            "input_cost_usd": with_cache,
            "input_cost_without_cache_usd": without,
            "input_cost_saved_fraction": 1 - with_cache / without if without else 0.0,
            "output_cost_usd": self.output_tokens * prices.output / PER_MILLION,
            "capacity_blocks": self.capacity_blocks,
            "unique_blocks": self.unique_blocks,
            "evictions": self.evictions,
            "prices_per_million": {
                "cache_hit_input": prices.cache_hit_input,
                "cache_miss_input": prices.cache_miss_input,
                "output": prices.output,
            },
        }


def replay(requests: Iterable[TraceRequest], capacity_blocks: int | None = None,
           block_tokens: int = TRACE_BLOCK_TOKENS) -> ReplayResult:
    index = PrefixCacheIndex(capacity_blocks)
    result = ReplayResult(capacity_blocks=capacity_blocks)
    seen: set[int] = set()
    for request in requests:
        hits = index.lookup(request.hash_ids)
        index.insert(request.hash_ids)
        seen.update(request.hash_ids)
        result.requests += 1
        result.blocks += len(request.hash_ids)
        result.hit_blocks += hits
        result.input_tokens += request.input_length
        result.hit_tokens += sum(request.block_tokens(i, block_tokens) for i in range(hits))
        result.output_tokens += request.output_length
    result.evictions = index.evictions
    result.unique_blocks = len(seen)
    return result
