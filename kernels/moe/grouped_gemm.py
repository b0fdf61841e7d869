"""Grouped matrix product for MoE experts: ``y[rows of e] = x[rows of e] @ w[e]`` over expert-sorted tokens.

Layout as in :mod:`k3.kernels.moe.reference`: ``x [M, K]``, ``w [E, K, N]`` (any strides, so the model's
``[E, N, K]`` weights pass as ``w.transpose(1, 2)``), ``offsets [E]`` int32 cumulative row ends.

Two backends behind one autograd Function (forward, ``dx``, ``dw``):

* ``"torch"`` — ``torch._grouped_mm(x, w, offs)`` (CUTLASS grouped GEMM), used for bf16 on CUDA devices of
  compute capability 9.0+ when K and N are multiples of 8 (its 16-byte alignment rule). Backward calls it
  twice more: ``dx = grouped(dy, w^T)`` and ``dw = grouped(x^T, dy)`` (the 2-D x 2-D form, grouped along M).
* ``"triton"`` — our kernels, for everything else (fp32, other GPUs, odd sizes, the CPU interpreter).
  Forward/dx: a program per (row tile, column tile); the row-tile index space is ``cdiv(M, BM) + E`` (every
  expert may waste at most one partial tile), and each program finds its expert by walking ``offsets``, so
  no host synchronisation and no tile map are needed. dw: a program per (expert, K tile, N tile) looping over
  that expert's rows; an expert without rows writes zeros.

``backend="auto"`` picks ``"torch"`` where it applies (on an H200 at the routed-expert shapes it is ~15-20 %
faster than our kernel: 2.2 vs 2.7 ms forward, 6.7 vs 8.4 ms forward+backward) and ``"triton"`` otherwise. fp32 products use full-fp32
``tl.dot`` (no TF32), so fp32 results match the reference to ~1e-6.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3.kernels.cast import dot_upcast, round_to
from k3.kernels.moe.reference import check_grouped_inputs

__all__ = ["GroupedConfig", "grouped_mm", "grouped_mm_forward", "grouped_mm_dw", "pick_backend", "BACKENDS"]

BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class GroupedConfig:
    """Tile sizes of the Triton kernels (powers of two, >= 16 for ``tl.dot``); defaults tuned for bf16 on an H200.

    Fields:
        block_m, block_n, block_k: forward/dx tile (rows of x, columns of w, reduction step).
        dw_block_k, dw_block_n, dw_block_m: dw tile (rows of dw, columns of dw, token step).
        num_warps, num_stages: launch parameters shared by both kernels.
    """

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    dw_block_k: int = 128
    dw_block_n: int = 256
    dw_block_m: int = 64
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "dw_block_k", "dw_block_n", "dw_block_m"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(f"GroupedConfig.{name} must be a power of two >= 16, got {value!r}")
        for name in ("num_warps", "num_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GroupedConfig.{name} must be a positive integer, got {value!r}")


FP32_CONFIG = GroupedConfig(block_m=64, block_n=64, block_k=32, dw_block_k=64, dw_block_n=64, dw_block_m=32,
                            num_warps=4, num_stages=2)
"""Default tiles for fp32 operands: exact fp32 products (no tensor cores) want smaller tiles than bf16 ones."""


def _default_config(dtype: torch.dtype) -> GroupedConfig:
    return FP32_CONFIG if dtype == torch.float32 else GroupedConfig()


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _grouped_mm_kernel(
    x_ptr, w_ptr, offs_ptr, y_ptr,
    N, K, E,
    stride_xm, stride_xk, stride_we, stride_wk, stride_wn, stride_ym, stride_yn,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    # Find the expert whose row tiles contain `tile` (tiles are numbered expert by expert).
    expert = -1
    row0 = 0
    row_end = 0
    first_tile = 0
    start = 0
    for e in range(E):
        end = tl.load(offs_ptr + e)
        n_tiles = tl.cdiv(end - start, BM)
        hit = (tile >= first_tile) & (tile < first_tile + n_tiles)
        expert = tl.where(hit, e, expert)
        row0 = tl.where(hit, start + (tile - first_tile) * BM, row0)
        row_end = tl.where(hit, end, row_end)
        first_tile += n_tiles
        start = end
    if expert >= 0:
        rows = row0 + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        mask_m = rows < row_end
        mask_n = cols < N
        x_base = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
        w_base = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            mask_k = ks < K
            a = tl.load(x_base + ks[None, :] * stride_xk, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            b = tl.load(w_base + ks[:, None] * stride_wk, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            if UPCAST:  # see k3.kernels.cast
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        y = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :] * stride_yn
        tl.store(y, round_to(acc, y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _grouped_mm_dw_kernel(
    x_ptr, dy_ptr, offs_ptr, dw_ptr,
    K, N,
    stride_xm, stride_xk, stride_dym, stride_dyn, stride_we, stride_wk, stride_wn,
    BK: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.program_id(2)
    start = tl.load(offs_ptr + expert - 1, mask=expert > 0, other=0)
    end = tl.load(offs_ptr + expert)
    ks = pid_k * BK + tl.arange(0, BK)
    cols = pid_n * BN + tl.arange(0, BN)
    mask_k = ks < K
    mask_n = cols < N
    acc = tl.zeros((BK, BN), dtype=tl.float32)
    for m0 in range(start, end, BM):
        rows = m0 + tl.arange(0, BM)
        mask_m = rows < end
        r64 = rows.to(tl.int64)
        xt = tl.load(x_ptr + r64[None, :] * stride_xm + ks[:, None] * stride_xk,
                     mask=mask_k[:, None] & mask_m[None, :], other=0.0)  # [BK, BM] = x^T tile
        dy = tl.load(dy_ptr + r64[:, None] * stride_dym + cols[None, :] * stride_dyn,
                     mask=mask_m[:, None] & mask_n[None, :], other=0.0)
        if UPCAST:
            xt, dy = xt.to(tl.float32), dy.to(tl.float32)
        acc = tl.dot(xt, dy, acc, input_precision=PRECISION)
    out = dw_ptr + expert.to(tl.int64) * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn
    tl.store(out, round_to(acc, dw_ptr.dtype.element_ty), mask=mask_k[:, None] & mask_n[None, :])


def grouped_mm_forward(x: Tensor, w: Tensor, offsets: Tensor, *, out: Tensor | None = None,
                       config: GroupedConfig | None = None) -> Tensor:
    """Triton ``y = grouped(x, w)`` (no autograd, no value checks: see :func:`grouped_mm`)."""
    config = config or _default_config(x.dtype)
    M, K = x.shape
    E, _, N = w.shape
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (M, N) or out.dtype != x.dtype:
        raise ValueError(f"out must be [M, N] = {(M, N)} of {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    grid = (triton.cdiv(M, config.block_m) + E, triton.cdiv(N, config.block_n))
    upcast = dot_upcast(_grouped_mm_kernel)
    _grouped_mm_kernel[grid](
        x, w, offsets, out, N, K, E,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        BM=config.block_m, BN=config.block_n, BK=config.block_k, PRECISION=_precision(x.dtype),
        UPCAST=upcast,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def grouped_mm_dw(x: Tensor, dy: Tensor, offsets: Tensor, *, out: Tensor | None = None,
                  config: GroupedConfig | None = None) -> Tensor:
    """Triton ``dw[e] = x[rows of e]^T @ dy[rows of e]`` -> ``[E, K, N]`` (experts without rows get zeros)."""
    config = config or _default_config(x.dtype)
    M, K = x.shape
    N = dy.shape[1]
    E = offsets.shape[0]
    if out is None:
        out = torch.empty(E, K, N, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (E, K, N) or out.dtype != x.dtype:
        raise ValueError(f"out must be [E, K, N] = {(E, K, N)} of {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    if K == 0 or N == 0:
        return out
    grid = (triton.cdiv(K, config.dw_block_k), triton.cdiv(N, config.dw_block_n), E)
    upcast = dot_upcast(_grouped_mm_dw_kernel)
    _grouped_mm_dw_kernel[grid](
        x, dy, offsets, out, K, N,
        x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), out.stride(0), out.stride(1), out.stride(2),
        BK=config.dw_block_k, BN=config.dw_block_n, BM=config.dw_block_m, PRECISION=_precision(x.dtype),
        UPCAST=upcast,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def pick_backend(x: Tensor, w: Tensor, backend: str = "auto") -> str:
    """Resolve ``backend`` for these operands (``"torch"`` or ``"triton"``); an impossible request raises."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    torch_ok = (
        hasattr(torch, "_grouped_mm")
        and x.is_cuda
        and x.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
        and x.shape[1] % 8 == 0
        and w.shape[2] % 8 == 0
    )
    if backend == "torch" and not torch_ok:
        raise ValueError("backend='torch' needs torch._grouped_mm, bf16 CUDA tensors on compute capability >= 9.0 "
                         f"and K, N multiples of 8; got {x.dtype} on {x.device}, K={x.shape[1]}, N={w.shape[2]}")
    if backend == "auto":
        return "torch" if torch_ok else "triton"
    return backend


def _torch_forward(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    return torch._grouped_mm(x, w, offsets)


def _torch_dw(x: Tensor, dy: Tensor, offsets: Tensor) -> Tensor:
    return torch._grouped_mm(x.t(), dy, offsets)


class _GroupedMMFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, offsets: Tensor, backend: str, config: GroupedConfig | None) -> Tensor:
        ctx.save_for_backward(x, w, offsets)
        ctx.backend, ctx.config = backend, config
        if backend == "torch":
            return _torch_forward(x, w, offsets)
        return grouped_mm_forward(x, w, offsets, config=config)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w, offsets = ctx.saved_tensors
        dy = dy.contiguous()  # e.g. the expanded gradient of a .sum()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            wt = w.transpose(1, 2)
            dx = _torch_forward(dy, wt, offsets) if ctx.backend == "torch" else \
                grouped_mm_forward(dy, wt, offsets, config=ctx.config)
        if ctx.needs_input_grad[1]:
            dw = _torch_dw(x, dy, offsets) if ctx.backend == "torch" else \
                grouped_mm_dw(x, dy, offsets, config=ctx.config)
        return dx, dw, None, None, None


def grouped_mm(x: Tensor, w: Tensor, offsets: Tensor, *, backend: str = "auto", validate: bool = True,
               config: GroupedConfig | None = None) -> Tensor:
    """Differentiable grouped product ``y [M, N]``; see the module docstring.

    Args:
        x: ``[M, K]`` tokens sorted by expert.
        w: ``[E, K, N]`` per-expert weights (any strides).
        offsets: ``[E]`` int32 cumulative row ends, ``offsets[-1] == M``; values checked when ``validate``
            (a host synchronisation on GPU).
        backend: ``"auto"``, ``"torch"`` (``torch._grouped_mm``) or ``"triton"``.
        config: Triton tile sizes (default: :class:`GroupedConfig` for 16-bit operands, ``FP32_CONFIG`` for fp32).
    """
    check_grouped_inputs(x, w, offsets, validate=validate)
    chosen = pick_backend(x, w, backend)
    offsets = offsets.contiguous()
    return _GroupedMMFunction.apply(x, w, offsets, chosen, config)
