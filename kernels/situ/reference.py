"""Readable SiTU-GLU over a packed input: the model's definition applied to the two halves of ``x``.

The up-projection of a SiTU-GLU block produces ``[gate | linear]`` side by side (gate half first, as in
:mod:`k3.model.situ` and the stacked expert weights of :mod:`k3.model.moe`); the fused kernel takes that packed
tensor, so the reference does too.
"""

from __future__ import annotations

from torch import Tensor

from k3.model.situ import situ_glu

__all__ = ["situ_glu_reference", "check_packed"]


def check_packed(x: Tensor) -> int:
    """Validate a packed ``[..., 2 * I]`` input; return ``I``."""
    if x.dim() < 1 or x.shape[-1] % 2 != 0:
        raise ValueError(f"x must be [..., 2 * I] (gate half, then linear half), got shape {tuple(x.shape)}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"x must be a floating-point tensor, got {x.dtype}")
    return x.shape[-1] // 2


def situ_glu_reference(x: Tensor, beta1: float = 4.0, beta2: float = 25.0) -> Tensor:
    """``[beta1 tanh(a/beta1) sigmoid(a)] * [beta2 tanh(b/beta2)]`` for ``(a, b) = split(x)``; ``[..., I]`` in x's dtype."""
    check_packed(x)
    gate, linear = x.chunk(2, dim=-1)
    return situ_glu(gate, linear, beta1, beta2)
