"""Configuration of ``k3 serve router``: where the workers are, what model they serve, budgets and prices.

Design decisions:

- The router never loads weights; from the model it only needs the tokenizer (to render and tokenise) and
  the context length (to refuse requests that cannot fit). Both come from a trained checkpoint folder, or,
  for a preset served with random weights, from the preset with the byte-level tokenizer.
- Cache stores are given either as one shared store or one per prefill worker (same order): with separate
  stores the prefix-affinity score of each worker uses its own store's index.
- Every limit is a documented field with a default that suits one machine; nothing is hard-coded in handlers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3.services.common.config import ConfigError, ServerConfig, documented

DEFAULT_ROUTER_PORT = 50051


@dataclass
class UpstreamConfig:
    """The workers the router sends requests to."""

    prefill: list[str] = documented(
        default_factory=lambda: ["127.0.0.1:50061"], doc="host:port of every prefill worker."
    )
    decode: list[str] = documented(
        default_factory=lambda: ["127.0.0.1:50071"], doc="host:port of every decode worker."
    )
    cache: list[str] = documented(
        default_factory=lambda: ["127.0.0.1:50081"],
        doc="Cache store(s) queried for cached prefixes: one shared store, or one per prefill worker "
        "in the same order; empty = no prefix-affinity lookups (routing by load only).",
    )
    load_refresh_seconds: float = documented(
        0.5, doc="A worker's reported Load is reused for this long before it is asked again."
    )
    probe_timeout_seconds: float = documented(
        1.0, doc="Deadline of Load, Lookup and Cancel calls (they must never hold a request up for long)."
    )
    retry_unavailable_seconds: float = documented(
        2.0, doc="A worker that failed a call is skipped for this long unless every worker failed."
    )
    vision: str | None = documented(
        None, doc="host:port of the vision service that encodes images; None = requests with images are "
        "refused with FAILED_PRECONDITION."
    )
    vision_timeout_seconds: float = documented(
        60.0, doc="Longest wait for the vision service to encode a request's images (within its deadline)."
    )

    def __post_init__(self) -> None:
        for name in ("prefill", "decode"):
            addresses = getattr(self, name)
            if not addresses:
                raise ConfigError("needs at least one host:port", field=name)
            _check_addresses(addresses, name)
        _check_addresses(self.cache, "cache")
        if self.vision is not None:
            _check_addresses([self.vision], "vision")
        if len(self.cache) not in (0, 1, len(self.prefill)):
            raise ConfigError(
                f"give one shared store or one per prefill worker ({len(self.prefill)}), got {len(self.cache)}",
                field="cache",
            )
        for name in ("load_refresh_seconds", "probe_timeout_seconds", "retry_unavailable_seconds",
                     "vision_timeout_seconds"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"must be > 0, got {getattr(self, name)}", field=name)

    def cache_for(self, prefill_index: int) -> str | None:
        """The cache store holding prefill worker ``prefill_index``'s checkpoints (None: no lookups)."""
        if not self.cache:
            return None
        return self.cache[prefill_index] if len(self.cache) > 1 else self.cache[0]


def _check_addresses(addresses: list[str], field: str) -> None:
    for i, address in enumerate(addresses):
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ConfigError(f"expected host:port, got {address!r}", field=f"{field}[{i}]")


@dataclass
class ModelConfig:
    """What the router knows of the served model (no weights: tokenizer and context length)."""

    checkpoint: str | None = documented(
        None, doc="Trained checkpoint or run folder (k3 train --out): its tokenizer and max_seq_len are used."
    )
    preset: str | None = documented(
        None, doc="Preset served with random weights (no checkpoint): its max_seq_len, byte-level tokenizer."
    )
    tokenizer: str | None = documented(
        None, doc="'byte', or the folder of a saved tokenizer, overriding the checkpoint's (None: the "
        "checkpoint's own, byte-level for a preset)."
    )
    max_context: int | None = documented(
        None, doc="Longest prompt + generation accepted; None = the model's max_seq_len."
    )

    def __post_init__(self) -> None:
        if self.checkpoint is not None and self.preset is not None:
            raise ConfigError("give a checkpoint or a preset, not both", field="preset")
        if self.max_context is not None and self.max_context < 2:
            raise ConfigError(f"must be >= 2, got {self.max_context}", field="max_context")


@dataclass
class AdmissionConfig:
    """Separate budgets for long and short prompts, so a burst of long prompts cannot starve short ones.

    A request runs when its class has a free concurrency slot; otherwise it waits in its class's queue if the
    prompt tokens already waiting plus its own fit the class's queued-token budget, and is refused with
    RESOURCE_EXHAUSTED if not.
    """

    long_threshold_tokens: int = documented(4096, doc="A prompt of at least this many tokens is long.")
    short_max_concurrency: int = documented(
        12, doc="Short requests running at once. With long_max_concurrency, keep the sum within the decode "
        "workers' slots (engine.max_slots, 16 by default): past that, hand-offs are refused."
    )
    short_max_queued_tokens: int = documented(262144, doc="Prompt tokens of short requests allowed to wait.")
    long_max_concurrency: int = documented(4, doc="Long requests running at once.")
    long_max_queued_tokens: int = documented(262144, doc="Prompt tokens of long requests allowed to wait.")

    def __post_init__(self) -> None:
        for name in ("long_threshold_tokens", "short_max_concurrency", "long_max_concurrency"):
            if getattr(self, name) < 1:
                raise ConfigError(f"must be >= 1, got {getattr(self, name)}", field=name)
        for name in ("short_max_queued_tokens", "long_max_queued_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(f"must be >= 0, got {getattr(self, name)}", field=name)


@dataclass
class RoutingConfig:
    """Prefix-affinity routing: score = cached_blocks * affinity_weight - load (see ``routing``)."""

    affinity_weight: float = documented(
        1.0,
        doc="Load units one cached 512-token block is worth. At 1.0 a worker holding the prompt's first "
        "block wins against an equally loaded one, and a worker holding 4 more blocks is still chosen "
        "with up to 4 more requests in flight.",
    )

    def __post_init__(self) -> None:
        if not self.affinity_weight >= 0:
            raise ConfigError(f"must be >= 0, got {self.affinity_weight}", field="affinity_weight")


@dataclass
class PricesConfig:
    """USD per million tokens, for the cost in ``Usage`` (K3's launch prices by default)."""

    cache_hit_input: float = documented(0.30, doc="Prompt tokens restored from the cache store.")
    cache_miss_input: float = documented(3.00, doc="Prompt tokens computed by prefill.")
    output: float = documented(15.00, doc="Generated tokens.")

    def __post_init__(self) -> None:
        for name in ("cache_hit_input", "cache_miss_input", "output"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"must be >= 0, got {getattr(self, name)}", field=name)


@dataclass
class LimitsConfig:
    """Request limits checked before any work is done (violations are INVALID_ARGUMENT)."""

    max_prompt_bytes: int = documented(4 << 20, doc="Largest prompt text (all message texts together), bytes.")
    max_prompt_tokens: int = documented(1 << 20, doc="Largest tokenised prompt (also bounded by max_context).")
    default_max_tokens: int = documented(512, doc="Generation limit when a request leaves max_tokens at 0.")
    max_stop_strings: int = documented(8, doc="Most stop strings per request.")
    max_stop_chars: int = documented(256, doc="Longest stop string, characters.")
    max_logprobs: int = documented(20, doc="Most top logprobs per generated token.")
    max_messages: int = documented(4096, doc="Most messages per Chat request.")
    max_request_id_chars: int = documented(128, doc="Longest client-chosen request id.")

    def __post_init__(self) -> None:
        for name in ("max_prompt_bytes", "max_prompt_tokens", "default_max_tokens", "max_messages",
                     "max_request_id_chars", "max_stop_chars"):
            if getattr(self, name) < 1:
                raise ConfigError(f"must be >= 1, got {getattr(self, name)}", field=name)
        for name in ("max_stop_strings", "max_logprobs"):
            if getattr(self, name) < 0:
                raise ConfigError(f"must be >= 0, got {getattr(self, name)}", field=name)


@dataclass
class RouterServiceConfig:
    """Configuration of ``k3 serve router``."""

    server: ServerConfig = documented(
        default_factory=lambda: ServerConfig(port=DEFAULT_ROUTER_PORT, max_workers=128),
        doc="How the gRPC server listens; each open stream holds one worker thread.",
    )
    upstream: UpstreamConfig = documented(default_factory=UpstreamConfig, doc="Prefill, decode, cache addresses.")
    model: ModelConfig = documented(default_factory=ModelConfig, doc="Tokenizer and context length source.")
    admission: AdmissionConfig = documented(default_factory=AdmissionConfig, doc="Long/short budgets.")
    routing: RoutingConfig = documented(default_factory=RoutingConfig, doc="Prefix-affinity weight.")
    prices: PricesConfig = documented(default_factory=PricesConfig, doc="Prices for cost accounting.")
    limits: LimitsConfig = documented(default_factory=LimitsConfig, doc="Request limits.")


@dataclass(frozen=True)
class ModelInfo:
    """What the router resolved from ``ModelConfig``: the tokenizer and the context limit."""

    tokenizer: Any
    max_context: int
    vocab_size: int


def resolve_model(config: ModelConfig) -> ModelInfo:
    """Load the tokenizer and context length named by ``config`` (``ValueError`` naming the field otherwise)."""
    from k3.model.config import K3Config
    from k3.model.presets import get_preset
    from k3.model.tokenizer import ByteTokenizer, load_tokenizer

    tokenizer_dir: Path | None = Path(config.tokenizer) if config.tokenizer not in (None, "byte") else None
    if config.checkpoint is not None:
        from k3.model.checkpoint import CheckpointError, resolve_checkpoint

        try:
            checkpoint = resolve_checkpoint(config.checkpoint)
            model = K3Config.from_json((checkpoint / "config.json").read_text(encoding="utf-8"))
        except (CheckpointError, OSError, ValueError, json.JSONDecodeError) as exc:
            raise ValueError(f"model.checkpoint: {exc}") from None
        if config.tokenizer is None:
            tokenizer_dir = checkpoint / "tokenizer"
    elif config.preset is not None:
        try:
            model = get_preset(config.preset)
        except ValueError as exc:
            raise ValueError(f"model.preset: {exc}") from None
    else:
        raise ValueError("model: give a checkpoint folder or a preset")
    try:
        tokenizer = load_tokenizer(tokenizer_dir) if tokenizer_dir is not None else ByteTokenizer()
    except (OSError, ValueError) as exc:
        raise ValueError(f"model.tokenizer: cannot load {tokenizer_dir}: {exc}") from None
    if tokenizer.vocab_size > model.vocab_size:
        raise ValueError(
            f"model.tokenizer: {tokenizer.vocab_size} tokens do not fit the model's vocabulary of {model.vocab_size}"
        )
    max_context = config.max_context or model.max_seq_len
    if max_context > model.max_seq_len:
        raise ValueError(f"model.max_context: {max_context} exceeds the model's max_seq_len {model.max_seq_len}")
    return ModelInfo(tokenizer=tokenizer, max_context=max_context, vocab_size=model.vocab_size)
