"""Attention Residuals (AttnRes): each sublayer reads a learned softmax mixture of earlier block summaries.

Instead of one running residual stream, the model keeps a *bank* of block representations (the token
embedding first, then the summed outputs of each completed block of ``attnres_block_size`` layers) plus the
running partial sum ``p`` of the current block. Before every sublayer, and once after the last layer, the
stream it reads is

    rows    = [bank..., p]                                   (R rows of width d)
    score_r = sum_d RMSNorm(rows_r)_d * norm_weight_d * w_d  (one scalar per row and token)
    mix     = sum_r softmax_r(score) * rows_r

``w`` is a learned per-sublayer query vector, initialised to zero so training starts from a uniform average of
the rows; ``norm_weight`` is the per-sublayer gain of the key norm (initialised to ones). Everything is per token
position, so incremental decoding recomputes the mixture for each new token from that token's own bank: nothing
about AttnRes is cached across tokens. The mixture is computed in fp32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from k3.model.norm import rms_norm


def aggregate(p: Tensor, bank: Sequence[Tensor], w: Tensor, norm_weight: Tensor, eps: float = 1e-5) -> Tensor:
    """Softmax mixture of ``[*bank, p]`` (each [..., d]) scored by ``RMSNorm(row) * norm_weight . w``.

    With an empty bank the result is ``p`` itself (a softmax over one row).
    """
    if not bank:
        return p
    rows = torch.stack([*bank, p], dim=0)  # [R, ..., d]
    keys = rms_norm(rows.float(), norm_weight, eps)
    scores = (keys * w.float()).sum(dim=-1)  # [R, ...]
    weights = torch.softmax(scores, dim=0)
    return (weights.unsqueeze(-1) * rows.float()).sum(dim=0).to(p.dtype)


class AttnResMixer(nn.Module):
    """The learned parameters of one AttnRes read: query ``w`` (zeros) and key-norm gain (ones)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.query = nn.Parameter(torch.zeros(dim))
        self.norm_weight = nn.Parameter(torch.ones(dim))

    def forward(self, p: Tensor, bank: Sequence[Tensor]) -> Tensor:
        return aggregate(p, bank, self.query, self.norm_weight, self.eps)
