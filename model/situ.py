"""SiTU-GLU: a SwiGLU whose two halves are softly capped, so activations cannot blow up.

For the two halves ``(a, b) = split(W_in x)`` of the up-projection:

    h = [beta1 * tanh(a / beta1) * sigmoid(a)] * [beta2 * tanh(b / beta2)],   y = W_out h

Design decisions:

- ``beta * tanh(x / beta)`` is ``x`` to first order for ``|x| << beta`` (the error is ``x^3 / (3 beta^2)``),
  so SiTU-GLU equals SwiGLU (``silu(a) * b``) for moderate values, while ``|h| < beta1 * beta2`` (100 for the
  released 4 / 25) for any input, including inf; the caps are what keep large-scale training stable.
- The activation is computed in fp32 whatever the activation dtype (tanh/sigmoid of bf16 lose too much near
  the caps) and cast back to the input dtype, so the following matmul runs in the model's dtype.
- ``W_in`` holds the gate half first, then the linear half, in ``nn.Linear``'s [out, in] layout: the same
  convention as the stacked routed-expert weights of the MoE, so one split rule serves both.
- ``SiTUGLU`` applies the activation through :func:`k3.kernels.dispatch.situ_glu_op` on the packed
  ``[gate | linear]`` projection: the fused Triton kernel on CUDA, :func:`situ_glu` (the same ops as always)
  elsewhere.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from k3.kernels import dispatch


def _check_beta(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


def situ_glu(gate: Tensor, linear: Tensor, beta1: float = 4.0, beta2: float = 25.0) -> Tensor:
    """``[beta1 tanh(gate/beta1) sigmoid(gate)] * [beta2 tanh(linear/beta2)]`` in fp32, returned in ``gate.dtype``."""
    if gate.shape != linear.shape:
        raise ValueError(f"gate and linear must have the same shape, got {tuple(gate.shape)} and {tuple(linear.shape)}")
    _check_beta("beta1", beta1)
    _check_beta("beta2", beta2)
    a, b = gate.float(), linear.float()
    gated = beta1 * torch.tanh(a / beta1) * torch.sigmoid(a)
    return (gated * (beta2 * torch.tanh(b / beta2))).to(gate.dtype)


class SiTUGLU(nn.Module):
    """Feed-forward block ``d_in -> d_hidden -> d_in`` with the SiTU-GLU activation (no biases)."""

    def __init__(self, d_in: int, d_hidden: int, beta1: float = 4.0, beta2: float = 25.0):
        super().__init__()
        for name, value in (("d_in", d_in), ("d_hidden", d_hidden)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        _check_beta("beta1", beta1)
        _check_beta("beta2", beta2)
        self.d_in, self.d_hidden = d_in, d_hidden
        self.beta1, self.beta2 = beta1, beta2
        self.w_in = nn.Linear(d_in, 2 * d_hidden, bias=False)  # rows [0, d_hidden): gate; the rest: linear
        self.w_out = nn.Linear(d_hidden, d_in, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.d_in:
            raise ValueError(f"SiTUGLU expects last dimension d_in={self.d_in}, got shape {tuple(x.shape)}")
        return self.w_out(dispatch.situ_glu_op(self.w_in(x), self.beta1, self.beta2))

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_hidden={self.d_hidden}, beta1={self.beta1}, beta2={self.beta2}"
