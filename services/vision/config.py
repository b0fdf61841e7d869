"""Configuration of ``k3 serve vision``: server, encoder, media limits, cache and batching.

The encoder is either a checkpoint folder (``k3.model.vision.checkpoint``) or a preset with random weights
from ``seed`` (tests, benchmarks, trying the platform), drawn from a private RNG state so that loading never
disturbs the process's random state and two services with the same preset and seed hold identical weights.
``EncoderSourceConfig.load`` also returns the encoder's identity: a digest of its config, weights (seed or
weights-file hash) and dtype, recorded with every cached entry so that tokens of one encoder are never served
as another's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from k3.model.vision.config import VISION_PRESETS
from k3.model.vision.media import MediaLimits
from k3.services.common.config import ConfigError, ServerConfig, documented

DTYPES = ("float32", "bfloat16", "float16")


def encoder_folder(path: str) -> Path:
    """``path`` itself if it is an encoder checkpoint, else the ``vision/`` folder of the multimodal checkpoint
    (or run folder's latest checkpoint) at ``path``; ``ValueError`` if neither."""
    from k3.model.checkpoint import CheckpointError
    from k3.model.vision.checkpoint import CONFIG_FILE
    from k3.model.vision_sft import vision_checkpoint_folder

    if (Path(path) / CONFIG_FILE).is_file():
        return Path(path)
    try:
        return vision_checkpoint_folder(path)
    except CheckpointError as exc:
        raise ValueError(f"encoder.checkpoint: {path!r} is neither a vision encoder checkpoint nor a "
                         f"multimodal checkpoint ({exc})") from None


@dataclass
class EncoderSourceConfig:
    """Which vision encoder the service runs."""

    checkpoint: str | None = documented(
        None, doc="Encoder checkpoint folder (vision_config.json + model.safetensors), or a multimodal "
        "training checkpoint or run folder holding one in vision/; exclusive with preset."
    )
    preset: str | None = documented(
        None, doc=f"Vision preset ({', '.join(VISION_PRESETS)}) with random weights from seed; "
        "exclusive with checkpoint."
    )
    seed: int = documented(0, doc="Seed of a preset encoder's random weights.")
    lm_hidden_size: int | None = documented(
        None, doc="Projector output width of a preset encoder (the language model's hidden size); None keeps "
        "the preset's."
    )
    dtype: str = documented("float32", doc=f"Parameter and output dtype: one of {', '.join(DTYPES)}.")
    device: str = documented("cpu", doc="torch device to run on, e.g. cpu or cuda:0.")

    def __post_init__(self) -> None:
        if self.checkpoint is not None and self.preset is not None:
            raise ConfigError("set either checkpoint or preset, not both", field="preset")
        if self.preset is not None and self.preset not in VISION_PRESETS:
            raise ConfigError(f"unknown vision preset {self.preset!r} (known: {', '.join(VISION_PRESETS)})",
                              field="preset")
        if self.dtype not in DTYPES:
            raise ConfigError(f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}", field="dtype")
        if self.seed < 0:
            raise ConfigError(f"must be >= 0, got {self.seed}", field="seed")
        if self.lm_hidden_size is not None and self.lm_hidden_size < 1:
            raise ConfigError(f"must be >= 1, got {self.lm_hidden_size}", field="lm_hidden_size")

    def load(self):
        """``(VisionEncoder in eval mode, identity hex string)``; ``ValueError`` if none is configured."""
        from k3.model.vision.checkpoint import load_encoder, weights_digest
        from k3.model.vision.config import get_vision_preset
        from k3.model.vision.encoder import VisionEncoder

        if self.checkpoint is not None:
            folder = encoder_folder(self.checkpoint)
            encoder = load_encoder(folder, device=self.device)
            weights = f"file:{weights_digest(folder)}"
        elif self.preset is not None:
            cfg = get_vision_preset(self.preset)
            if self.lm_hidden_size is not None:
                cfg = dataclasses.replace(cfg, lm_hidden_size=self.lm_hidden_size)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                encoder = VisionEncoder(cfg)
            weights = f"preset:{self.preset}:seed:{self.seed}"
        else:
            raise ValueError("encoder: set encoder.checkpoint (a trained encoder) or encoder.preset (random "
                             "weights from encoder.seed)")
        encoder = encoder.to(device=self.device, dtype=getattr(torch, self.dtype)).eval()
        identity = json.dumps({"config": encoder.cfg.config_hash(), "weights": weights, "dtype": self.dtype},
                              sort_keys=True)
        return encoder, hashlib.blake2b(identity.encode(), digest_size=16).hexdigest()


@dataclass
class VisionSettings:
    """Request and batching limits."""

    max_media: int = documented(32, doc="Most media items in one Encode request.")
    max_batch_patches: int = documented(
        65536, doc="Most patches packed into one encoder forward pass; a single media larger than this "
        "runs alone."
    )
    max_request_pixels: int = documented(
        128 << 20, doc="Most decoded pixels (all frames of all media) in one request: bounds its memory."
    )
    local_cache_bytes: int = documented(
        1 << 30, doc="Byte budget of the in-process LRU used when cache_address is not set."
    )
    cache_timeout_s: float = documented(10.0, doc="Time limit of each cache store call.")

    def __post_init__(self) -> None:
        for name in ("max_media", "max_batch_patches", "max_request_pixels", "local_cache_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"must be >= 1, got {getattr(self, name)}", field=name)
        if not self.cache_timeout_s > 0:
            raise ConfigError(f"must be > 0, got {self.cache_timeout_s}", field="cache_timeout_s")


@dataclass
class VisionServiceConfig:
    """Configuration of ``k3 serve vision``."""

    server: ServerConfig = documented(default_factory=ServerConfig, doc="How the gRPC server listens.")
    encoder: EncoderSourceConfig = documented(default_factory=EncoderSourceConfig, doc="The encoder to run.")
    media: MediaLimits = documented(default_factory=MediaLimits, doc="Limits on every decoded image and video.")
    cache_address: str | None = documented(
        None, doc="host:port of the cache store (kind vision_tokens); None = an in-process LRU of "
        "vision.local_cache_bytes."
    )
    vision: VisionSettings = documented(default_factory=VisionSettings, doc="Request and batching limits.")

    def __post_init__(self) -> None:
        if self.cache_address is not None and not self.cache_address.strip():
            raise ConfigError("must not be blank (use null for the in-process cache)", field="cache_address")
