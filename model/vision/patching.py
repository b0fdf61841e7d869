"""Pixels -> patches at native resolution, and packing of many media into one sequence.

Design decisions:

- Native resolution: an image is never resized to a fixed square. Its sides are padded up to multiples of
  ``unit = patch_size * merge_size`` (28 px) so that the patch grid splits evenly into 2x2 merge cells; the
  padding is zero after normalisation (the mean colour), at the bottom and right. Only an image whose padded
  area exceeds the pixel budget (``max_pixels``; ``max_video_frame_pixels`` for video frames) is downscaled,
  keeping its aspect ratio, to the largest size that fits. Smaller images are never upscaled, so token counts
  follow the image size: an H x W image gives ceil(H/28) * ceil(W/28) visual tokens.
- Video: frames are cut into groups of ``temporal_merge`` (2) consecutive frames and each group is averaged
  pixel-wise before patch embedding. The patch embedding is affine, so this equals averaging the two frames'
  patch embeddings, at half the embedding cost. An odd last frame forms a group on its own (its average is
  itself). Each temporal group is then a frame-like grid of its own: one attention segment in the packed
  sequence. Attention therefore stays within a group (cost linear in video length); information across time
  enters through the temporal average, and the groups reach the language model in time order.
- Patch order inside a segment is merge-cell major: the merge_size^2 patches of one cell are consecutive, so
  the 2x2 spatial merge after the tower is a reshape. Rows of cells follow each other top to bottom, cells
  left to right within a row: the visual tokens come out in raster order. Attention does not care about the
  order (positions are rotary and explicit).
- Packing concatenates the segments of many media into one sequence and records ``cu_seqlens`` (cumulative
  segment lengths), from which the tower builds a block-diagonal attention: no token attends across media or
  across temporal groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from k3.model.vision.config import VisionConfig


@dataclass
class PatchedMedia:
    """One image or video as tower input."""

    patches: Tensor
    """[groups * patches_per_group, patch_dim] float32 normalised pixels, merge-cell major order."""
    positions: Tensor
    """[same rows, 2] int64 (row, column) of each patch in its frame's patch grid."""
    grid: tuple[int, int, int]
    """(temporal groups, token rows, token columns): the visual tokens are grid[0] * grid[1] * grid[2]."""
    size: tuple[int, int]
    """(height, width) in pixels the frames were encoded at, before padding (after any downscale)."""

    @property
    def num_tokens(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    @property
    def segment_length(self) -> int:
        """Patches per temporal group (one attention segment)."""
        return self.patches.shape[0] // self.grid[0]


@dataclass
class PackedBatch:
    """Segments of several media concatenated into one sequence."""

    patches: Tensor
    """[N, patch_dim] all patches."""
    positions: Tensor
    """[N, 2] (row, column) of each patch."""
    cu_seqlens: Tensor
    """[segments + 1] int64 cumulative segment lengths (0, l0, l0 + l1, ...); attention stays inside one."""
    token_counts: list[int]
    """Visual tokens of each media, in order (to split the tower's output)."""
    grids: list[tuple[int, int, int]]
    """``PatchedMedia.grid`` of each media, in order."""

    @property
    def num_patches(self) -> int:
        return self.patches.shape[0]


def fit_size(height: int, width: int, max_pixels: int, unit: int) -> tuple[int, int]:
    """The (height, width) to encode an image at: unchanged if its padded area fits ``max_pixels``, else the
    largest aspect-preserving downscale whose padded area (sides rounded up to ``unit``) fits."""
    if height < 1 or width < 1:
        raise ValueError(f"image size must be positive, got {height}x{width}")

    def padded_area(h: int, w: int) -> int:
        return math.ceil(h / unit) * unit * math.ceil(w / unit) * unit

    if padded_area(height, width) <= max_pixels:
        return height, width
    scale = math.sqrt(max_pixels / (height * width))
    while True:  # padding can push the first guess over the budget; shrink by 1 % steps until it fits
        h, w = max(1, math.floor(height * scale)), max(1, math.floor(width * scale))
        if padded_area(h, w) <= max_pixels:
            return h, w
        scale *= 0.99


def _as_frames(frames: np.ndarray | Tensor, field: str = "frames") -> Tensor:
    """uint8 [T, H, W, C] (or [H, W, C] for one image) as a tensor, checked."""
    if isinstance(frames, np.ndarray):  # torch wants a writable buffer; copy only if it is not (or not C order)
        tensor = torch.from_numpy(np.require(frames, requirements=["C", "W"]))
    else:
        tensor = frames
    if tensor.dim() == 3:
        tensor = tensor.unsqueeze(0)
    if tensor.dim() != 4 or tensor.dtype != torch.uint8:
        raise ValueError(f"{field} must be uint8 [T, H, W, C] or [H, W, C], got {tensor.dtype} {list(tensor.shape)}")
    if min(tensor.shape) == 0:
        raise ValueError(f"{field} must not be empty, got shape {list(tensor.shape)}")
    return tensor


def patchify(cfg: VisionConfig, frames: np.ndarray | Tensor, *, video: bool) -> PatchedMedia:
    """Normalise, downscale if over budget, pad, merge time and cut into patches (see the module docstring).

    ``frames`` is uint8 [T, H, W, C] (an image is T = 1); ``video`` picks the pixel budget and turns on the
    temporal merge.
    """
    x = _as_frames(frames)
    t, height, width, channels = x.shape
    if channels != cfg.in_channels:
        raise ValueError(f"frames have {channels} channels, the encoder expects {cfg.in_channels}")
    budget = cfg.max_video_frame_pixels if video else cfg.max_pixels
    h, w = fit_size(height, width, budget, cfg.unit)
    x = x.permute(0, 3, 1, 2).to(torch.float32) / 255.0  # [T, C, H, W] in [0, 1]
    if (h, w) != (height, width):
        x = F.interpolate(x, size=(h, w), mode="bicubic", antialias=True, align_corners=False).clamp_(0.0, 1.0)
    mean = torch.tensor(cfg.image_mean).view(1, -1, 1, 1)
    std = torch.tensor(cfg.image_std).view(1, -1, 1, 1)
    x = (x - mean) / std
    pad_h, pad_w = -h % cfg.unit, -w % cfg.unit
    if pad_h or pad_w:
        x = F.pad(x, (0, pad_w, 0, pad_h))
    if video:
        groups = math.ceil(t / cfg.temporal_merge)
        x = torch.stack([x[g * cfg.temporal_merge:(g + 1) * cfg.temporal_merge].mean(0) for g in range(groups)])
    elif t != 1:
        raise ValueError(f"an image has one frame, got {t} (pass video=True for videos)")
    groups = x.shape[0]
    p, m = cfg.patch_size, cfg.merge_size
    rows, cols = x.shape[2] // (p * m), x.shape[3] // (p * m)  # merge cells per column / row
    # [G, C, rows, m, p, cols, m, p] -> [G, rows, cols, m(i), m(j), C, p, p]: the cell's patches are adjacent.
    cells = x.view(groups, channels, rows, m, p, cols, m, p).permute(0, 2, 5, 3, 6, 1, 4, 7)
    patches = cells.reshape(groups * rows * cols * m * m, cfg.patch_dim)
    r = torch.arange(rows).view(rows, 1, 1, 1) * m + torch.arange(m).view(1, 1, m, 1)
    c = torch.arange(cols).view(1, cols, 1, 1) * m + torch.arange(m).view(1, 1, 1, m)
    grid_pos = torch.stack(torch.broadcast_tensors(r, c), dim=-1).reshape(-1, 2)
    positions = grid_pos.repeat(groups, 1)
    return PatchedMedia(patches=patches.contiguous(), positions=positions, grid=(groups, rows, cols), size=(h, w))


def pack(media: list[PatchedMedia]) -> PackedBatch:
    """Concatenate the segments of ``media`` (at least one) into one ``PackedBatch``."""
    if not media:
        raise ValueError("pack needs at least one media")
    lengths = [item.segment_length for item in media for _ in range(item.grid[0])]
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    return PackedBatch(
        patches=torch.cat([item.patches for item in media]),
        positions=torch.cat([item.positions for item in media]),
        cu_seqlens=cu,
        token_counts=[item.num_tokens for item in media],
        grids=[item.grid for item in media],
    )
