"""Configuration of ``k3 serve decode``: server, model, cache store address, engine and hand-off limits."""

from __future__ import annotations

from dataclasses import dataclass

from k3.services.common.config import ConfigError, ServerConfig, documented
from k3.services.engine.config import EngineConfig
from k3.services.engine.handoff_dist import DistHandoffConfig, check_handoff_mode
from k3.services.engine.model_source import ModelSourceConfig


@dataclass
class DecodeSettings:
    """Hand-off and end-of-turn checkpoint behaviour."""

    max_state_bytes: int = documented(
        1 << 30, doc="Largest serialised state a hand-off may announce; larger ones are refused up front."
    )
    checkpoint_on_finish: bool = documented(
        True, doc="Store each finished turn's final state in the cache store (needs cache_address)."
    )
    cache_timeout_s: float = documented(10.0, doc="Time limit of each cache store call.")
    handoff: str = documented(
        "grpc", doc="grpc: states arrive as bytes over gRPC only; dist: also host a TCPStore and take "
        "torch.distributed hand-offs (tensors over NCCL/gloo, control over gRPC; engine.handoff_dist)."
    )
    dist: DistHandoffConfig = documented(
        default_factory=DistHandoffConfig, doc="Rendezvous and limits of the dist hand-off (handoff: dist)."
    )

    def __post_init__(self) -> None:
        check_handoff_mode(self.handoff)
        if not 1 <= self.max_state_bytes <= (1 << 31) - 1:
            raise ConfigError(f"must be in [1, 2^31 - 1] (an int32 on the wire), got {self.max_state_bytes}",
                              field="max_state_bytes")
        if not self.cache_timeout_s > 0:
            raise ConfigError(f"must be > 0, got {self.cache_timeout_s}", field="cache_timeout_s")


@dataclass
class DecodeServiceConfig:
    """Configuration of ``k3 serve decode``."""

    server: ServerConfig = documented(default_factory=ServerConfig, doc="How the gRPC server listens.")
    model: ModelSourceConfig = documented(default_factory=ModelSourceConfig, doc="The model to serve.")
    cache_address: str | None = documented(
        None, doc="host:port of the cache store for end-of-turn checkpoints; None = do not checkpoint."
    )
    engine: EngineConfig = documented(default_factory=EngineConfig, doc="Slots, pages, batching, queue.")
    decode: DecodeSettings = documented(default_factory=DecodeSettings, doc="Hand-off and checkpoint settings.")

    def __post_init__(self) -> None:
        if self.cache_address is not None and not self.cache_address.strip():
            raise ConfigError("must not be blank (use null for no cache store)", field="cache_address")
