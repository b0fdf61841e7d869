"""``k3.model.vision``: the MoonViT-V2 style vision encoder and safe decoding of its inputs.

``config`` holds ``VisionConfig`` and the presets, ``patching`` turns pixels into packed native-resolution
patches, ``encoder`` is the tower, merge and projector, ``media`` decodes untrusted images and videos,
``params`` counts parameters on the meta device and ``checkpoint`` saves and loads encoder weights.
"""

from k3.model.vision.checkpoint import load_encoder, save_encoder, weights_digest
from k3.model.vision.config import VISION_PRESETS, VisionConfig, get_vision_preset
from k3.model.vision.encoder import VisionEncoder
from k3.model.vision.media import (
    CONTAINER_FORMATS,
    IMAGE_FORMATS,
    DecodedMedia,
    MediaError,
    MediaLimits,
    content_hash,
    decode_container,
    decode_frames,
    decode_image,
)
from k3.model.vision.params import vision_param_breakdown
from k3.model.vision.patching import PackedBatch, PatchedMedia, fit_size, pack, patchify

__all__ = [
    "CONTAINER_FORMATS",
    "IMAGE_FORMATS",
    "VISION_PRESETS",
    "DecodedMedia",
    "MediaError",
    "MediaLimits",
    "PackedBatch",
    "PatchedMedia",
    "VisionConfig",
    "VisionEncoder",
    "content_hash",
    "decode_container",
    "decode_frames",
    "decode_image",
    "fit_size",
    "get_vision_preset",
    "load_encoder",
    "pack",
    "patchify",
    "save_encoder",
    "vision_param_breakdown",
    "weights_digest",
]
