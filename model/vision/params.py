"""Parameter counts of a vision encoder, on the meta device (nothing is allocated).

Convention: ``tower`` is the vision transformer proper (patch embedding, blocks, final norm) and is the
number a "~401 M parameter" vision encoder refers to; ``projector`` (merge MLP into the language model's
width) depends on the language model and is reported separately; ``total`` is both. The encoder is dense,
so every parameter is active for every patch.
"""

from __future__ import annotations

import torch

from k3.model.vision.config import VisionConfig


def vision_param_breakdown(cfg: VisionConfig) -> dict:
    """``{"parts": {...}, "summary": {"tower", "projector", "total"}}`` for ``cfg``."""
    from k3.model.vision.encoder import VisionEncoder

    with torch.device("meta"):
        encoder = VisionEncoder(cfg)
    parts = {
        "patch_embed": _numel(encoder.patch_embed),
        "blocks": _numel(encoder.blocks),
        "final_norm": _numel(encoder.norm),
        "projector": _numel(encoder.projector),
    }
    tower = parts["patch_embed"] + parts["blocks"] + parts["final_norm"]
    return {"parts": parts, "summary": {"tower": tower, "projector": parts["projector"],
                                        "total": tower + parts["projector"]}}


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
