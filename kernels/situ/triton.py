"""Fused SiTU-GLU forward and backward in Triton, with an autograd Function.

For a packed input ``x = [a | b]`` (``[N, 2 I]``, gate half first):

    f(a) = beta1 tanh(a / beta1) sigmoid(a)        g(b) = beta2 tanh(b / beta2)        h = f(a) g(b)
    f'(a) = (1 - tanh^2(a / beta1)) sigmoid(a) + beta1 tanh(a / beta1) sigmoid(a) (1 - sigmoid(a))
    g'(b) = 1 - tanh^2(b / beta2)
    dx = [dh g(b) f'(a) | dh f(a) g'(b)]

Design decisions:

- Both directions are elementwise and memory-bound (forward reads 2I and writes I values per row, backward reads
  3I and writes 2I), so each program streams one row slice of ``BLOCK`` columns: coalesced loads of the two
  halves, fp32 math in registers, one store. The grid is (rows, column blocks); no reductions, no atomics.
- Backward recomputes f, g from the saved input instead of saving them: cheaper in memory than storing two
  extra activations and the recompute is free next to the memory traffic.
- The activation is bound by special-function throughput, not only by memory: written naively it takes three
  exponentials and three IEEE divisions per element, which on an H200 costs as much time as the memory traffic.
  ``tanh`` is taken as ``sign(z) (1 - e^{-2|z|}) / (1 + e^{-2|z|})`` and ``sigmoid(a) = 1 / (1 + e^{-a})``, and
  the three denominators share **one** fast reciprocal (``tl.fdiv(..., ieee_rounding=False)``, ~2 ulp): three
  ``exp2`` and one reciprocal per element in either direction. No overflow for any input: infinite inputs give
  exactly the caps, and the exponent of the sigmoid is clamped at -80 so the product of denominators is finite.
- Math in fp32 whatever the storage dtype, as the model's definition requires; results rounded to nearest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3.kernels.cast import round_to
from k3.kernels.situ.reference import check_packed

__all__ = ["SiTUConfig", "situ_glu_triton", "situ_glu_forward", "situ_glu_backward"]


@dataclass(frozen=True)
class SiTUConfig:
    """Launch parameters. ``block``: columns per program (power of two); ``num_warps``: warps per program."""

    block: int = 1024
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("block", "num_warps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
                raise ValueError(f"SiTUConfig.{name} must be a positive power of two, got {value!r}")


_LOG2E = 1.4426950408889634


@triton.jit
def _parts(a, b, c1, c3):
    """Shared pieces of both directions with one reciprocal per element.

    tanh(|z|) = (1 - e)/(1 + e) with e = exp(-2|z|) <= 1, sigmoid(a) = 1/(1 + exp(-a)); the three
    denominators share one reciprocal ``r``. exp(-a) is taken at max(a, -80) so the product of the
    denominators stays finite (sigmoid(-80) ~ 1.8e-35 is already 0 for every purpose).
    ``c1 = -2 log2(e) / beta1`` and ``c3 = -2 log2(e) / beta2`` come from the host.
    """
    e1 = tl.exp2(c1 * tl.abs(a))
    e2 = tl.exp2(-1.4426950408889634 * tl.maximum(a, -80.0))
    e3 = tl.exp2(c3 * tl.abs(b))
    p1, p2, p3 = 1.0 + e1, 1.0 + e2, 1.0 + e3
    r = tl.fdiv(1.0, p1 * p2 * p3, ieee_rounding=False)
    n1 = tl.where(a < 0, e1 - 1.0, 1.0 - e1)  # sign(a) (1 - e1)
    n3 = tl.where(b < 0, e3 - 1.0, 1.0 - e3)
    return n1, n3, p1, p2, p3, r


@triton.jit
def _situ_fwd_kernel(x_ptr, y_ptr, stride_xn, stride_yn, inter, beta1, beta2, c1, c3, BLOCK: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    row = x_ptr + n * stride_xn
    a = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(row + inter + offs, mask=mask, other=0.0).to(tl.float32)
    n1, n3, p1, p2, p3, r = _parts(a, b, c1, c3)
    h = (beta1 * beta2) * (n1 * n3) * r  # beta1 tanh(a/beta1) sigmoid(a) * beta2 tanh(b/beta2)
    tl.store(y_ptr + n * stride_yn + offs, round_to(h, y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _situ_bwd_kernel(x_ptr, dy_ptr, dx_ptr, stride_xn, stride_dyn, stride_dxn, inter, beta1, beta2, c1, c3,
                     BLOCK: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    row = x_ptr + n * stride_xn
    a = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(row + inter + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + n * stride_dyn + offs, mask=mask, other=0.0).to(tl.float32)
    n1, n3, p1, p2, p3, r = _parts(a, b, c1, c3)
    ta = n1 * (r * p2) * p3  # tanh(a / beta1)
    sa = (r * p1) * p3  # sigmoid(a)
    tb = n3 * (r * p1) * p2  # tanh(b / beta2)
    f = beta1 * ta * sa
    g = beta2 * tb
    df = (1.0 - ta * ta) * sa + f * (1.0 - sa)
    dg = 1.0 - tb * tb
    out = dx_ptr + n * stride_dxn
    tl.store(out + offs, round_to(dy * g * df, dx_ptr.dtype.element_ty), mask=mask)
    tl.store(out + inter + offs, round_to(dy * f * dg, dx_ptr.dtype.element_ty), mask=mask)


def _coefficients(beta1: float, beta2: float) -> tuple[float, float]:
    return -2.0 * _LOG2E / beta1, -2.0 * _LOG2E / beta2


def _check_beta(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return float(value)


def _rows(x: Tensor) -> Tensor:
    """``x`` as ``[N, C]`` with a unit inner stride (a view when possible)."""
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def _check_out(out: Tensor | None, shape: tuple[int, ...], like: Tensor, name: str) -> Tensor:
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if tuple(out.shape) != shape or out.dtype != like.dtype or not out.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {shape} tensor of {like.dtype}, got "
                         f"{tuple(out.shape)} {out.dtype}")
    return out


def situ_glu_forward(x: Tensor, beta1: float = 4.0, beta2: float = 25.0, *, out: Tensor | None = None,
                     config: SiTUConfig | None = None) -> Tensor:
    """Forward kernel: packed ``x [..., 2 I]`` -> ``[..., I]`` in x's dtype (no autograd)."""
    inter = check_packed(x)
    beta1, beta2 = _check_beta("beta1", beta1), _check_beta("beta2", beta2)
    config = config or SiTUConfig()
    out = _check_out(out, (*x.shape[:-1], inter), x, "out")
    flat = _rows(x)
    if flat.shape[0] == 0 or inter == 0:
        return out
    y = out.view(-1, inter)
    grid = (flat.shape[0], triton.cdiv(inter, config.block))
    _situ_fwd_kernel[grid](flat, y, flat.stride(0), y.stride(0), inter, beta1, beta2,
                           *_coefficients(beta1, beta2), BLOCK=config.block, num_warps=config.num_warps)
    return out


def situ_glu_backward(x: Tensor, dy: Tensor, beta1: float = 4.0, beta2: float = 25.0, *,
                      out: Tensor | None = None, config: SiTUConfig | None = None) -> Tensor:
    """Backward kernel: input ``x [..., 2 I]`` and output gradient ``dy [..., I]`` -> ``dx [..., 2 I]``."""
    inter = check_packed(x)
    if tuple(dy.shape) != (*x.shape[:-1], inter):
        raise ValueError(f"dy must have shape {(*x.shape[:-1], inter)}, got {tuple(dy.shape)}")
    beta1, beta2 = _check_beta("beta1", beta1), _check_beta("beta2", beta2)
    config = config or SiTUConfig()
    out = _check_out(out, tuple(x.shape), x, "out")
    flat, dflat = _rows(x), _rows(dy)
    if flat.shape[0] == 0 or inter == 0:
        return out
    dx = out.view(-1, 2 * inter)
    grid = (flat.shape[0], triton.cdiv(inter, config.block))
    _situ_bwd_kernel[grid](flat, dflat, dx, flat.stride(0), dflat.stride(0), dx.stride(0), inter, beta1, beta2,
                           *_coefficients(beta1, beta2), BLOCK=config.block, num_warps=config.num_warps)
    return out


class _SiTUGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, beta1: float, beta2: float, config: SiTUConfig | None) -> Tensor:
        ctx.save_for_backward(x)
        ctx.betas, ctx.config = (beta1, beta2), config
        return situ_glu_forward(x, beta1, beta2, config=config)

    @staticmethod
    def backward(ctx, dy: Tensor):
        (x,) = ctx.saved_tensors
        dx = situ_glu_backward(x, dy, *ctx.betas, config=ctx.config)
        return dx, None, None, None


def situ_glu_triton(x: Tensor, beta1: float = 4.0, beta2: float = 25.0, *,
                    config: SiTUConfig | None = None) -> Tensor:
    """SiTU-GLU of a packed ``[..., 2 I]`` input with fused Triton forward and backward."""
    check_packed(x)
    _check_beta("beta1", beta1)
    _check_beta("beta2", beta2)
    return _SiTUGLUFunction.apply(x, float(beta1), float(beta2), config)
