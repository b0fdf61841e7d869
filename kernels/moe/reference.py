"""Readable grouped matrix product for MoE expert compute.

Tokens are sorted by expert, so expert ``e`` owns the contiguous rows ``offsets[e-1]:offsets[e]`` of ``x``
(``offsets`` holds cumulative *ends*, ``offsets[-1] == M``; an expert without tokens repeats the previous end).
The product is ``y[rows of e] = x[rows of e] @ w[e]`` with ``w [E, K, N]``. The model stores expert weights
in ``nn.Linear``'s ``[E, out, in]`` layout; pass ``w.transpose(1, 2)`` (a view, no copy).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["check_grouped_inputs", "grouped_mm_reference"]


def check_grouped_inputs(x: Tensor, w: Tensor, offsets: Tensor, *, validate: bool = True) -> None:
    """Shapes, dtypes and devices always; offset values (which synchronise a GPU) when ``validate``."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
    if w.dim() != 3 or w.shape[1] != x.shape[1] or w.shape[0] < 1:
        raise ValueError(f"w must be [E >= 1, K, N] with K = {x.shape[1]}, got shape {tuple(w.shape)}")
    if offsets.dim() != 1 or offsets.shape[0] != w.shape[0]:
        raise ValueError(f"offsets must be [E]=[{w.shape[0]}] cumulative row ends, got shape {tuple(offsets.shape)}")
    if offsets.dtype != torch.int32:
        raise ValueError(f"offsets must be int32, got {offsets.dtype}")
    if x.dtype != w.dtype or not x.dtype.is_floating_point:
        raise ValueError(f"x and w must share one floating-point dtype, got {x.dtype} and {w.dtype}")
    if len({x.device, w.device, offsets.device}) != 1:
        raise ValueError(f"x, w, offsets must be on one device, got {x.device}, {w.device}, {offsets.device}")
    if validate:
        ends = offsets.tolist()
        if ends[-1] != x.shape[0]:
            raise ValueError(f"offsets[-1] must equal the number of rows M = {x.shape[0]}, got {ends[-1]}")
        if ends[0] < 0 or any(b < a for a, b in zip(ends[:-1], ends[1:], strict=True)):
            raise ValueError(f"offsets must be non-decreasing and non-negative, got {ends}")


def grouped_mm_reference(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """``y [M, N]`` with ``y[s:e] = x[s:e] @ w[expert]``, one matmul per expert (differentiable)."""
    check_grouped_inputs(x, w, offsets)
    pieces, start = [], 0
    for expert, end in enumerate(offsets.tolist()):
        pieces.append(x[start:end] @ w[expert])
        start = end
    return torch.cat(pieces, dim=0)
