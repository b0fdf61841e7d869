"""``VisionConfig`` and the vision presets: the shapes of a MoonViT-V2 style encoder.

Presets:

- ``moonvit-v2``: 27 layers of width 1152, MLP 4304, 16 heads of 72 (SigLIP-so400m-like widths), patch 14,
  2x2 spatial merge, 2-frame temporal merge, projector into the K3 width 7168. The vision tower (patch
  embedding, 27 blocks, final norm) holds 412.2 M parameters, within 3 % of the ~401 M the released model
  states; the projector adds 54.3 M and is counted separately, because its output width belongs to the
  language model (see ``vision_param_breakdown``). Images up to 3584 x 3584 are encoded at native
  resolution (65 536 patches, 16 384 visual tokens); video frames get a smaller budget.
- ``vit-tiny``: the same architecture in under 200 K parameters with small pixel budgets, for tests.

Design decisions:

- Plain data validated in ``__post_init__`` (a ``ValueError`` names the field), JSON round trip through
  ``to_dict``/``from_dict`` (the encoder checkpoint stores it), ``config_hash`` for cache identity.
- Pixel budgets are part of the config because they decide how many visual tokens a media becomes: two
  encoders with the same weights but different budgets produce different tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any


@dataclass(kw_only=True)
class VisionConfig:
    """Shapes, pixel budgets and constants of a vision encoder (keyword-only)."""

    patch_size: int = 14
    """Side of a square patch in pixels; one patch becomes one token of the vision tower."""
    in_channels: int = 3
    """Input channels (RGB)."""
    hidden_size: int
    """Width d of the vision tower."""
    num_layers: int
    """Transformer blocks of the tower."""
    num_heads: int
    """Attention heads; the head width hidden_size / num_heads must be divisible by 4 (2-D rotary halves)."""
    intermediate_size: int
    """Hidden width of each block's GELU MLP."""
    merge_size: int = 2
    """Side of the spatial merge: merge_size x merge_size neighbouring patch features are concatenated into
    one visual token before the projector (2 -> 4 patches per token)."""
    temporal_merge: int = 2
    """Consecutive video frames averaged into one temporal group before patch embedding."""
    lm_hidden_size: int
    """Width of the language model the projector feeds (7168 for kimi-k3)."""
    projector_hidden_size: int
    """Hidden width of the two-layer projector MLP (merge_size^2 * hidden_size in the presets)."""
    norm_eps: float = 1e-6
    """LayerNorm epsilon."""
    rope_theta: float = 10000.0
    """Base of the 2-D rotary frequencies."""
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    """Per-channel mean subtracted from pixels scaled to [0, 1]."""
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    """Per-channel standard deviation pixels are divided by."""
    max_pixels: int = 3584 * 3584
    """Pixel budget of one image after padding to the merge grid; larger images are downscaled (aspect
    ratio kept) until they fit. Smaller images are never upscaled."""
    max_video_frame_pixels: int = 448 * 448
    """The same budget for each frame of a video (videos have many frames, so each gets fewer tokens)."""

    def __post_init__(self) -> None:
        self.image_mean = tuple(float(v) for v in self.image_mean)
        self.image_std = tuple(float(v) for v in self.image_std)
        positive = ("patch_size", "in_channels", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                    "merge_size", "temporal_merge", "lm_hidden_size", "projector_hidden_size")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")
        if self.head_dim % 4:
            raise ValueError(f"num_heads: head width {self.head_dim} must be divisible by 4 (2-D rotary)")
        for name in ("image_mean", "image_std"):
            if len(getattr(self, name)) != self.in_channels:
                raise ValueError(f"{name} must have in_channels={self.in_channels} values")
        if any(s <= 0 for s in self.image_std):
            raise ValueError("image_std values must be positive")
        if not self.norm_eps > 0 or not self.rope_theta > 1:
            raise ValueError("norm_eps must be > 0 and rope_theta > 1")
        for name in ("max_pixels", "max_video_frame_pixels"):
            if getattr(self, name) < self.unit * self.unit:
                raise ValueError(f"{name} must be at least one merge cell ({self.unit}x{self.unit} pixels), "
                                 f"got {getattr(self, name)}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def unit(self) -> int:
        """Pixels per side of one visual token (patch_size * merge_size): images are padded to multiples of it."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Values per flattened patch (channels x patch x patch)."""
        return self.in_channels * self.patch_size * self.patch_size

    @property
    def merged_dim(self) -> int:
        """Width of one visual token before the projector (merge_size^2 concatenated patch features)."""
        return self.merge_size * self.merge_size * self.hidden_size

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["image_mean"] = list(self.image_mean)
        data["image_std"] = list(self.image_std)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> VisionConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown VisionConfig field(s): {', '.join(unknown)}")
        values = dict(data)
        for name in ("image_mean", "image_std"):
            if name in values:
                values[name] = tuple(values[name])
        return cls(**values)

    def config_hash(self) -> str:
        """Hex digest of the canonical JSON form: equal configs, equal hashes."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


VISION_PRESETS: Mapping[str, VisionConfig] = MappingProxyType({
    "moonvit-v2": VisionConfig(
        hidden_size=1152, num_layers=27, num_heads=16, intermediate_size=4304,
        lm_hidden_size=7168, projector_hidden_size=4 * 1152,
    ),
    "vit-tiny": VisionConfig(
        hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
        lm_hidden_size=96, projector_hidden_size=256,
        max_pixels=224 * 224, max_video_frame_pixels=112 * 112,
    ),
})


def get_vision_preset(name: str) -> VisionConfig:
    """A fresh copy of the named preset; ``KeyError`` lists the known names otherwise."""
    try:
        preset = VISION_PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown vision preset {name!r} (known: {', '.join(VISION_PRESETS)})") from None
    return dataclasses.replace(preset)
