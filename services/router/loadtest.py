"""Concurrent streaming load against a router (``k3 bench serve``): latency percentiles and throughput.

``concurrency`` client threads send ``requests`` streaming Generate calls in total, each as soon as its
previous one ended (a closed loop, so the offered load adapts to the server and never overruns it). Prompts
are text: a prefix shared by every request (as a common system prompt would be, so the prefix cache works)
followed by words unique to the request, drawn from a seeded generator.

Measured per request: TTFT (send -> first message carrying tokens), TPOT (first -> last token, divided by
the tokens after the first), tokens and the ``Usage`` of the last message. Reported: p50/p90/p99/mean of
TTFT and TPOT in milliseconds, requests and output tokens per second over the wall time, the cached share
of prompt tokens, cost, and the error count per gRPC status (a failed request counts only there).
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from k3.protos.v1 import inference_pb2, inference_pb2_grpc

WORDS = (
    "state block cache prefix token stream decode prefill router expert layer delta memory latent gate "
    "query value batch slot page chunk kernel shard replica queue budget deadline"
).split()


@dataclass
class LoadConfig:
    router: str
    concurrency: int = 8
    requests: int = 32
    prompt_chars: int = 2000
    shared_prefix_chars: int = 1000
    max_tokens: int = 64
    temperature: float = 0.0
    seed: int = 0
    timeout_seconds: float = 300.0

    def __post_init__(self) -> None:
        for name in ("concurrency", "requests", "prompt_chars", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.shared_prefix_chars <= self.prompt_chars:
            raise ValueError(f"shared_prefix_chars must be in [0, prompt_chars={self.prompt_chars}], "
                             f"got {self.shared_prefix_chars}")
        if self.temperature < 0 or self.timeout_seconds <= 0:
            raise ValueError("temperature must be >= 0 and timeout_seconds > 0")


def _text(rng: random.Random, chars: int) -> str:
    """Exactly ``chars`` characters of space-separated words."""
    text = ""
    while len(text) < chars:
        text += (" " if text else "") + rng.choice(WORDS)
    return text[:chars]


def make_prompts(config: LoadConfig) -> list[str]:
    rng = random.Random(config.seed)
    shared = _text(rng, config.shared_prefix_chars)
    return [shared + _text(rng, config.prompt_chars - len(shared)) for _ in range(config.requests)]


@dataclass
class _Result:
    ttft: float | None = None
    tpot: float | None = None
    tokens: int = 0
    usage: object = None
    error: str | None = None


def _one(stub, prompt: str, config: LoadConfig) -> _Result:
    sampling = inference_pb2.SamplingParams(max_tokens=config.max_tokens, temperature=config.temperature)
    result = _Result()
    start = time.perf_counter()
    first = last = None
    try:
        for response in stub.Generate(inference_pb2.GenerateRequest(prompt=prompt, sampling=sampling),
                                      timeout=config.timeout_seconds):
            if response.token_ids:
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
                result.tokens += len(response.token_ids)
            if response.HasField("usage"):
                result.usage = response.usage
    except grpc.RpcError as exc:
        result.error = exc.code().name
        return result
    if first is not None:
        result.ttft = first - start
        if result.tokens > 1:
            result.tpot = (last - first) / (result.tokens - 1)
    return result


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50/p90/p99 (nearest rank) and mean, in milliseconds; None when there are no values."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    ordered = sorted(values)

    def rank(q: float) -> float:
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)] * 1000

    return {"p50": rank(0.50), "p90": rank(0.90), "p99": rank(0.99), "mean": sum(ordered) / len(ordered) * 1000}


def run_load(config: LoadConfig) -> dict:
    prompts = make_prompts(config)
    results: list[_Result] = [None] * config.requests  # type: ignore[list-item]
    next_index = iter(range(config.requests))
    lock = threading.Lock()
    channel = grpc.insecure_channel(config.router)
    stub = inference_pb2_grpc.InferenceStub(channel)

    def worker() -> None:
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            results[i] = _one(stub, prompts[i], config)

    started = time.perf_counter()
    try:
        with ThreadPoolExecutor(config.concurrency) as pool:
            for future in [pool.submit(worker) for _ in range(config.concurrency)]:
                future.result()
    finally:
        channel.close()
    wall = time.perf_counter() - started
    ok = [r for r in results if r.error is None]
    usages = [r.usage for r in ok if r.usage is not None]
    prompt_tokens = sum(u.prompt_tokens for u in usages)
    cached = sum(u.cached_prompt_tokens for u in usages)
    tokens = sum(r.tokens for r in ok)
    return {
        "requests": config.requests,
        "completed": len(ok),
        "errors": dict(Counter(r.error for r in results if r.error is not None)),
        "concurrency": config.concurrency,
        "wall_seconds": wall,
        "requests_per_second": len(ok) / wall if wall else 0.0,
        "output_tokens": tokens,
        "output_tokens_per_second": tokens / wall if wall else 0.0,
        "ttft_ms": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": percentiles([r.tpot for r in ok if r.tpot is not None]),
        "prompt_tokens": prompt_tokens,
        "cached_prompt_tokens": cached,
        "cached_fraction": cached / prompt_tokens if prompt_tokens else 0.0,
        "cost_usd": sum(u.cost_usd for u in usages),
        "cost_without_cache_usd": sum(u.cost_without_cache_usd for u in usages),
    }
