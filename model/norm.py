"""RMSNorm, the only normalisation in the model.

Computed in fp32 whatever the activation dtype (the mean of squares of bf16 values loses too much precision),
then cast back. The weight is initialised to ones, so a fresh norm only rescales.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension, in fp32, returned in ``x.dtype``."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension with a learned per-channel gain."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.dim:
            raise ValueError(f"RMSNorm expects last dimension {self.dim}, got shape {tuple(x.shape)}")
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"
