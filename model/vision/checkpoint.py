"""Vision encoder checkpoints: a folder with ``vision_config.json`` and ``model.safetensors`` (never pickle).

The config travels with the weights, so a checkpoint is self-describing; loading is strict (every tensor
present with its exact shape, nothing extra). ``weights_digest`` names the exact weights (BLAKE2b of the
safetensors file) so that caches can tell encoders apart.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from k3.model.vision.config import VisionConfig

CONFIG_FILE = "vision_config.json"
WEIGHTS_FILE = "model.safetensors"


def save_encoder(encoder, folder: str | Path) -> Path:
    """Write ``encoder`` (a ``VisionEncoder``) into ``folder`` (created); returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().to("cpu").contiguous() for name, tensor in encoder.state_dict().items()}
    save_file(state, str(folder / WEIGHTS_FILE))
    (folder / CONFIG_FILE).write_text(json.dumps(encoder.cfg.to_dict(), indent=2, sort_keys=True) + "\n")
    return folder


def load_encoder(folder: str | Path, *, device: str | torch.device = "cpu"):
    """The ``VisionEncoder`` saved in ``folder``; ``ValueError`` names what is missing or mismatched."""
    from k3.model.vision.encoder import VisionEncoder

    folder = Path(folder)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise ValueError(f"{folder} is not a vision encoder checkpoint: {name} is missing")
    cfg = VisionConfig.from_dict(json.loads((folder / CONFIG_FILE).read_text()))
    with torch.device("meta"):
        encoder = VisionEncoder(cfg)
    state = load_file(str(folder / WEIGHTS_FILE), device=str(device))
    expected = {name: tuple(t.shape) for name, t in encoder.state_dict().items()}
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise ValueError(f"{folder / WEIGHTS_FILE}: missing tensors {missing[:5]}, unexpected {extra[:5]}")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ValueError(f"{folder / WEIGHTS_FILE}: {name} has shape {list(state[name].shape)}, "
                             f"expected {list(shape)}")
    encoder.load_state_dict(state, assign=True)
    return encoder.eval()


def weights_digest(folder: str | Path) -> str:
    """Hex BLAKE2b of the checkpoint's weights file (read in 1 MiB chunks)."""
    digest = hashlib.blake2b(digest_size=16)
    with open(Path(folder) / WEIGHTS_FILE, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
