"""Per-request token usage and its cost, and the router's running totals.

Cost model (DESIGN.md §2.2, prices configurable): prompt tokens restored from the cache store are billed at
the cache-hit price, the other prompt tokens at the cache-miss price, generated tokens at the output price.
``cost_without_cache_usd`` bills every prompt token at the miss price, so the difference is what the cache
saved. Totals are kept as exact integer token counts (costs are derived from them, never summed as floats)
and exported as OpenTelemetry counters.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from k3.protos.v1 import common_pb2
from k3.services.router.config import PricesConfig

PER_MILLION = 1_000_000


def cost_usd(prices: PricesConfig, hit_tokens: int, miss_tokens: int, output_tokens: int) -> float:
    return (
        hit_tokens * prices.cache_hit_input + miss_tokens * prices.cache_miss_input + output_tokens * prices.output
    ) / PER_MILLION


def make_usage(prices: PricesConfig, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> common_pb2.Usage:
    """The ``Usage`` of one request; ``cached_tokens`` is clamped to the prompt (a worker cannot restore more)."""
    cached = max(0, min(cached_tokens, prompt_tokens))
    return common_pb2.Usage(
        prompt_tokens=prompt_tokens,
        cached_prompt_tokens=cached,
        completion_tokens=completion_tokens,
        cost_usd=cost_usd(prices, cached, prompt_tokens - cached, completion_tokens),
        cost_without_cache_usd=cost_usd(prices, 0, prompt_tokens, completion_tokens),
    )


@dataclass(frozen=True)
class UsageSnapshot:
    requests: int
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    cost_usd: float
    cost_without_cache_usd: float

    @property
    def saved_usd(self) -> float:
        return self.cost_without_cache_usd - self.cost_usd


class UsageTotals:
    """Thread-safe running totals over finished requests, mirrored into OpenTelemetry counters."""

    def __init__(self, prices: PricesConfig, meter=None):
        self._prices = prices
        self._lock = threading.Lock()
        self._requests = self._prompt = self._cached = self._completion = 0
        self._counters = None
        if meter is not None:
            self._counters = {
                "requests": meter.create_counter("k3.router.requests", description="Finished requests"),
                "prompt": meter.create_counter("k3.router.prompt_tokens", unit="{token}"),
                "cached": meter.create_counter("k3.router.cached_prompt_tokens", unit="{token}"),
                "completion": meter.create_counter("k3.router.completion_tokens", unit="{token}"),
                "cost": meter.create_counter("k3.router.cost", unit="USD"),
                "saved": meter.create_counter("k3.router.cache_savings", unit="USD"),
            }

    def add(self, usage: common_pb2.Usage, kind: str) -> None:
        with self._lock:
            self._requests += 1
            self._prompt += usage.prompt_tokens
            self._cached += usage.cached_prompt_tokens
            self._completion += usage.completion_tokens
        if self._counters is not None:
            attributes = {"k3.request.kind": kind}
            self._counters["requests"].add(1, attributes)
            self._counters["prompt"].add(usage.prompt_tokens, attributes)
            self._counters["cached"].add(usage.cached_prompt_tokens, attributes)
            self._counters["completion"].add(usage.completion_tokens, attributes)
            self._counters["cost"].add(usage.cost_usd, attributes)
            self._counters["saved"].add(usage.cost_without_cache_usd - usage.cost_usd, attributes)

    def snapshot(self) -> UsageSnapshot:
        with self._lock:
            requests, prompt, cached, completion = self._requests, self._prompt, self._cached, self._completion
        return UsageSnapshot(
            requests=requests,
            prompt_tokens=prompt,
            cached_prompt_tokens=cached,
            completion_tokens=completion,
            cost_usd=cost_usd(self._prices, cached, prompt - cached, completion),
            cost_without_cache_usd=cost_usd(self._prices, 0, prompt, completion),
        )
