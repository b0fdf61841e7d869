"""``VisionEncoder``: a MoonViT-V2 style vision tower, 2x2 spatial merge and projector into the LM width.

Pipeline for a packed batch (``k3.model.vision.patching`` builds it):

    patches [N, 3*14*14] --Linear--> [N, d] --27 x (pre-norm attention + GELU MLP)--> LayerNorm
    --> concat each 2x2 merge cell's 4 features [N/4, 4d] --> Linear, GELU, Linear --> [N/4, lm_hidden_size]

Design decisions:

- Positions are 2-D rotary (RoPE), not learned embeddings: each head's rotary pairs are split in half, the
  first half rotated by the patch's row and the second half by its column. Nothing needs interpolating to a
  new resolution, any grid up to 3584 px (256 patches per side) is encoded the same way, and a patch's
  position does not depend on what else is packed with it.
- Packing: the patches of many media are one sequence; the linear layers (nearly all of the compute) run on
  all of it at once, and attention is block-diagonal over ``cu_seqlens``. Two exact implementations:
  ``"segments"`` (default) runs scaled-dot-product attention per segment, memory linear in the longest
  segment; ``"mask"`` runs one attention call with a boolean block-diagonal mask, memory quadratic in the
  whole sequence (fine for small batches; it is the check that the segment loop leaks nothing).
  A media encoded alone or packed with others gives the same tokens (up to float rounding).
- Pre-norm blocks with LayerNorm, biases and tanh-GELU, as in SigLIP-so400m, whose widths the ``moonvit-v2``
  preset borrows.
- Weights initialise through ``init_normal_`` (a no-op on meta tensors), so a shape-only encoder for
  parameter counting is built instantly on the meta device.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from k3.model.params import init_normal_
from k3.model.vision.config import VisionConfig
from k3.model.vision.patching import PackedBatch, pack, patchify

ATTENTION_IMPLS = ("segments", "mask")


def rotary_2d(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin of shape [N, head_dim / 2]: the first half of the pairs by row, the second by column."""
    quarter = head_dim // 4
    inv_freq = theta ** (-torch.arange(quarter, dtype=torch.float32, device=positions.device) / quarter)
    rows = positions[:, 0:1].to(torch.float32) * inv_freq
    cols = positions[:, 1:2].to(torch.float32) * inv_freq
    angles = torch.cat([rows, cols], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x[..., i], x[..., i + D/2]) of ``x`` [N, H, D] by the angles behind ``cos``/``sin`` [N, D/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


def block_diagonal_mask(cu_seqlens: Tensor) -> Tensor:
    """[N, N] bool, True where query and key lie in the same segment."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths)
    return segment[:, None] == segment[None, :]


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.out = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cu_seqlens: Tensor, impl: str) -> Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [H, N, D]
        if impl == "mask":
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=block_diagonal_mask(cu_seqlens))
        else:
            bounds = cu_seqlens.tolist()
            out = torch.cat([
                F.scaled_dot_product_attention(q[:, s:e], k[:, s:e], v[:, s:e])
                for s, e in zip(bounds[:-1], bounds[1:], strict=True)
            ], dim=1)
        return self.out(out.transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = VisionAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cu_seqlens: Tensor, impl: str) -> Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, cu_seqlens, impl)
        return x + self.mlp(self.norm2(x))


class Projector(nn.Module):
    """merge_size^2 * d -> projector_hidden_size -> lm_hidden_size (two linear layers with tanh-GELU)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.merged_dim, cfg.projector_hidden_size)
        self.fc2 = nn.Linear(cfg.projector_hidden_size, cfg.lm_hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class VisionEncoder(nn.Module):
    """Patches of a packed batch -> visual tokens in the language model's width (see the module docstring)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = nn.Linear(cfg.patch_dim, cfg.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.projector = Projector(cfg)
        self._init_weights()

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                init_normal_(module.weight, std=0.02)
                if module.bias is not None and module.bias.device.type != "meta":
                    nn.init.zeros_(module.bias)

    def forward(self, batch: PackedBatch, *, attention: str = "segments") -> Tensor:
        """Visual tokens [total tokens, lm_hidden_size] of every media in ``batch``, in order."""
        if attention not in ATTENTION_IMPLS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_IMPLS)}, got {attention!r}")
        cfg = self.cfg
        device, dtype = self.patch_embed.weight.device, self.patch_embed.weight.dtype
        patches = batch.patches.to(device=device, dtype=dtype)
        positions, cu_seqlens = batch.positions.to(device), batch.cu_seqlens.to(device)
        if patches.shape[1] != cfg.patch_dim:
            raise ValueError(f"patches have {patches.shape[1]} values each, expected patch_dim={cfg.patch_dim}")
        if int(cu_seqlens[-1]) != patches.shape[0]:
            raise ValueError(f"cu_seqlens ends at {int(cu_seqlens[-1])}, but there are {patches.shape[0]} patches")
        cos, sin = rotary_2d(positions, cfg.head_dim, cfg.rope_theta)
        x = self.patch_embed(patches)
        for block in self.blocks:
            x = block(x, cos, sin, cu_seqlens, attention)
        x = self.norm(x)
        # Patches are merge-cell major (patching.py): each run of merge_size^2 rows is one cell.
        merged = x.reshape(-1, cfg.merged_dim)
        return self.projector(merged)

    @torch.inference_mode()
    def encode(self, media: list[np.ndarray | Tensor], *, video: list[bool] | None = None,
               attention: str = "segments") -> list[Tensor]:
        """Encode several media in one packed forward pass; returns [tokens_i, lm_hidden_size] per media.

        Each media is uint8 [T, H, W, C] (or [H, W, C] for an image); ``video[i]`` marks videos (default:
        all images).
        """
        video = video or [False] * len(media)
        if len(video) != len(media):
            raise ValueError(f"video has {len(video)} flags for {len(media)} media")
        batch = pack([patchify(self.cfg, item, video=is_video) for item, is_video in zip(media, video, strict=True)])
        tokens = self(batch, attention=attention)
        return list(tokens.split(batch.token_counts))
