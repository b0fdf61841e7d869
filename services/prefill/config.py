"""Configuration of ``k3 serve prefill``: server, model, cache store address and prefill limits."""

from __future__ import annotations

from dataclasses import dataclass

from k3.services.common.config import ConfigError, ServerConfig, documented
from k3.services.engine.handoff import MAX_CHUNK_BYTES
from k3.services.engine.handoff_dist import DistHandoffConfig, check_handoff_mode
from k3.services.engine.model_source import ModelSourceConfig


@dataclass
class PrefillSettings:
    """How prompts are processed."""

    prefill_chunk: int = documented(
        512, doc="Most tokens per model call; cancellation and deadlines are checked between calls."
    )
    max_concurrent: int = documented(1, doc="Prompts computed at the same time.")
    max_queue: int = documented(
        16, doc="Prompts waiting for a free worker; one more is refused with RESOURCE_EXHAUSTED."
    )
    max_context: int = documented(
        0, doc="Longest accepted prompt + 1 (room for a generated token); 0 = the model's max_seq_len."
    )
    handoff_chunk_bytes: int = documented(
        MAX_CHUNK_BYTES, doc="Largest hand-off chunk sent to a decode worker (at most 1 MiB)."
    )
    handoff_timeout_s: float = documented(
        60.0, doc="Time limit of a hand-off when the caller set no deadline."
    )
    cache_timeout_s: float = documented(10.0, doc="Time limit of each cache store call.")
    handoff: str = documented(
        "grpc", doc="How states reach decode workers: grpc (safetensors bytes in chunks) or dist (tensors over a "
        "torch.distributed pair group, NCCL/gloo; the decode worker needs handoff: dist too)."
    )
    dist: DistHandoffConfig = documented(
        default_factory=DistHandoffConfig, doc="Backend and time limit of the dist hand-off (handoff: dist)."
    )

    def __post_init__(self) -> None:
        check_handoff_mode(self.handoff)
        for name in ("prefill_chunk", "max_concurrent"):
            if getattr(self, name) < 1:
                raise ConfigError(f"must be >= 1, got {getattr(self, name)}", field=name)
        for name in ("max_queue", "max_context"):
            if getattr(self, name) < 0:
                raise ConfigError(f"must be >= 0, got {getattr(self, name)}", field=name)
        if not 4096 <= self.handoff_chunk_bytes <= MAX_CHUNK_BYTES:
            raise ConfigError(f"must be in [4096, {MAX_CHUNK_BYTES}], got {self.handoff_chunk_bytes}",
                              field="handoff_chunk_bytes")
        for name in ("handoff_timeout_s", "cache_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"must be > 0, got {getattr(self, name)}", field=name)


@dataclass
class PrefillServiceConfig:
    """Configuration of ``k3 serve prefill``."""

    server: ServerConfig = documented(default_factory=ServerConfig, doc="How the gRPC server listens.")
    model: ModelSourceConfig = documented(default_factory=ModelSourceConfig, doc="The model to serve.")
    cache_address: str | None = documented(
        None, doc="host:port of the cache store; None = no prefix cache (every prompt is computed in full)."
    )
    prefill: PrefillSettings = documented(default_factory=PrefillSettings, doc="Prompt processing limits.")

    def __post_init__(self) -> None:
        if self.cache_address is not None and not self.cache_address.strip():
            raise ConfigError("must not be blank (use null for no cache store)", field="cache_address")
