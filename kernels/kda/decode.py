"""Decode-time KDA kernels: one new token per sequence against states kept in slot pools.

Two Triton kernels and their readable references:

* :func:`fused_recurrent_kda_decode` — one step of the KDA recurrence for N sequences. The fp32 states live in a
  pool ``state_pool [num_slots, H, K, V]`` shared by all running sequences; ``slot_ids [N]`` names each
  sequence's row, which is updated **in place**. Gate (``kda_gate``), L2 normalisation of q and k, and the
  sigmoid of beta all happen in the kernel, so the caller hands over raw projections.
* :func:`short_conv_decode` — one step of the depthwise causal convolution + SiLU that produces q, k, v, with its
  ``kernel - 1`` last inputs kept in ``conv_state_pool [num_slots, D, W - 1]`` (oldest first), updated in place.

Design decisions:

- The decode step is memory-bound: per (sequence, head) it must read and write a K x V fp32 state (64 KiB at
  K = V = 128) while doing ~4 flops per state element. Each program owns one (sequence, head, V-block) tile,
  loads that slice of the state once, applies decay, delta-rule update and read-out in registers and writes it
  back once. Splitting V (not K) keeps every reduction (``S^T k``, ``S^T q``) inside a program; the small
  vectors q, k, g are re-read per V-block, which costs ~1 % of the state traffic.
- The state rows are addressed through ``slot_ids`` so that a serving engine never gathers/scatters states.
  Slot ids are validated (range, no duplicates: two programs writing one row would race) unless the caller
  passes ``validate=False``; on a GPU that check synchronises the device, so a hot loop that has already
  validated its slot table should turn it off.
- All arithmetic is fp32; the output has ``v``'s dtype. The gate uses the same clamps as
  :func:`k3.kernels.kda.reference.kda_gate`, so infinities in the raw gate give no NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3.kernels.cast import round_to
from k3.kernels.kda.reference import kda_gate, kda_recurrent

__all__ = [
    "DecodeConfig",
    "fused_recurrent_kda_decode",
    "fused_recurrent_kda_decode_reference",
    "short_conv_decode",
    "short_conv_decode_reference",
]

_FP32_MAX = 3.4028234663852886e38
_GATE_LOGIT_MIN = -80.0
_L2NORM_EPS = 1e-6  # the eps of torch.nn.functional.normalize used by the KDA layer


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the decode kernels.

    Fields:
        block_v: width of the V-slice one recurrence program owns (power of two).
        num_warps: warps per recurrence program.
        block_d: channels per short-convolution program (power of two).
    """

    block_v: int = 64
    num_warps: int = 4
    block_d: int = 256

    def __post_init__(self) -> None:
        for name in ("block_v", "num_warps", "block_d"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
                raise ValueError(f"DecodeConfig.{name} must be a positive power of two, got {value!r}")


# ------------------------------------------------------------------------------------------------ validation
def _check_slots(slot_ids: Tensor, n: int, num_slots: int, validate: bool) -> None:
    if slot_ids.dim() != 1 or slot_ids.shape[0] != n:
        raise ValueError(f"slot_ids must be [N]=[{n}], got shape {tuple(slot_ids.shape)}")
    if slot_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_ids must be int32 or int64, got {slot_ids.dtype}")
    if validate and n > 0:
        lo, hi = int(slot_ids.min()), int(slot_ids.max())
        if lo < 0 or hi >= num_slots:
            raise ValueError(f"slot_ids must lie in [0, {num_slots}), got values in [{lo}, {hi}]")
        if torch.unique(slot_ids).numel() != n:
            raise ValueError("slot_ids must be distinct: two sequences cannot share one state slot")


def _check_decode_inputs(q, k, v, g_raw, beta_raw, A_log, dt_bias, state_pool, slot_ids, validate) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [N, H, K], got shape {tuple(q.shape)}")
    N, H, K = q.shape
    for name, t in (("k", k), ("g_raw", g_raw)):
        if t.shape != q.shape:
            raise ValueError(f"{name} must have the shape of q {tuple(q.shape)}, got {tuple(t.shape)}")
    if v.dim() != 3 or v.shape[:2] != (N, H):
        raise ValueError(f"v must be [N, H, V] with N, H = {N}, {H}, got shape {tuple(v.shape)}")
    V = v.shape[2]
    if beta_raw.shape != (N, H):
        raise ValueError(f"beta_raw must be [N, H] = {(N, H)}, got shape {tuple(beta_raw.shape)}")
    if A_log.shape != (H,):
        raise ValueError(f"A_log must be [H]=[{H}], got shape {tuple(A_log.shape)}")
    if dt_bias.shape != (H * K,):
        raise ValueError(f"dt_bias must be [H*K]=[{H * K}], got shape {tuple(dt_bias.shape)}")
    if state_pool.dim() != 4 or state_pool.shape[1:] != (H, K, V):
        raise ValueError(f"state_pool must be [num_slots, H, K, V] = [*, {H}, {K}, {V}], got {tuple(state_pool.shape)}")
    if state_pool.dtype != torch.float32:
        raise ValueError(f"state_pool must be float32, got {state_pool.dtype}")
    devices = {t.device for t in (q, k, v, g_raw, beta_raw, A_log, dt_bias, state_pool, slot_ids)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(str(d) for d in devices)}")
    _check_slots(slot_ids, N, state_pool.shape[0], validate)


# ---------------------------------------------------------------------------------------------- references
def fused_recurrent_kda_decode_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g_raw: Tensor,
    beta_raw: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    state_pool: Tensor,
    slot_ids: Tensor,
    *,
    lower_bound: float = -5.0,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    use_beta_sigmoid: bool = True,
    validate: bool = True,
) -> Tensor:
    """The decode step written with the reference pieces (gather rows, ``kda_recurrent`` for T = 1, scatter)."""
    _check_decode_inputs(q, k, v, g_raw, beta_raw, A_log, dt_bias, state_pool, slot_ids, validate)
    if use_qk_l2norm:
        q = torch.nn.functional.normalize(q.float(), dim=-1, eps=_L2NORM_EPS)
        k = torch.nn.functional.normalize(k.float(), dim=-1, eps=_L2NORM_EPS)
    g = kda_gate(g_raw, A_log, dt_bias, lower_bound)
    beta = torch.sigmoid(beta_raw.float()) if use_beta_sigmoid else beta_raw.float()
    rows = slot_ids.long()
    o, final = kda_recurrent(
        q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
        scale=scale, initial_state=state_pool[rows], output_final_state=True,
    )
    state_pool[rows] = final
    return o[:, 0]


def short_conv_decode_reference(
    x: Tensor, conv_state_pool: Tensor, weight: Tensor, slot_ids: Tensor, *, validate: bool = True
) -> Tensor:
    """``SiLU(sum_j weight[:, j] * [state, x][:, j])`` for one token; the state rows shift left by one, in place."""
    _check_conv_inputs(x, conv_state_pool, weight, slot_ids, validate)
    rows = slot_ids.long()
    window = torch.cat([conv_state_pool[rows].float(), x.float()[:, :, None]], dim=-1)  # [N, D, W]
    y = torch.nn.functional.silu((window * weight.float()).sum(-1))
    conv_state_pool[rows] = window[:, :, 1:].to(conv_state_pool.dtype)
    return y.to(x.dtype)


# --------------------------------------------------------------------------------------- recurrence kernel
@triton.jit
def _kda_decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, state_ptr, slot_ptr, o_ptr,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_gn, stride_gh,
    stride_bn, stride_bh, stride_sn, stride_sh, stride_sk, stride_on, stride_oh,
    H, scale, lower_bound,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr,
):
    i_nh = tl.program_id(0)
    i_v = tl.program_id(1)
    n = i_nh // H
    h = i_nh % H
    slot = tl.load(slot_ptr + n).to(tl.int64)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V

    q = tl.load(q_ptr + n * stride_qn + h * stride_qh + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + n * stride_kn + h * stride_kh + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    if L2NORM:
        q = q / tl.maximum(tl.sqrt(tl.sum(q * q, axis=0)), 1e-6)
        k = k / tl.maximum(tl.sqrt(tl.sum(k * k, axis=0)), 1e-6)
    # Gate: lower_bound * sigmoid(exp(A_log[h]) * (g_raw + dt_bias[h, :])), clamped as in kda_gate.
    rate = tl.minimum(tl.exp(tl.load(a_log_ptr + h).to(tl.float32)), 3.4028234663852886e38)
    g_raw = tl.load(g_ptr + n * stride_gn + h * stride_gh + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    bias = tl.load(dt_bias_ptr + h * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    logits = tl.maximum(rate * (g_raw + bias), -80.0)
    decay = tl.exp(lower_bound * tl.sigmoid(logits))
    beta = tl.load(beta_ptr + n * stride_bn + h * stride_bh).to(tl.float32)
    if BETA_SIGMOID:
        beta = tl.sigmoid(beta)
    v = tl.load(v_ptr + n * stride_vn + h * stride_vh + offs_v, mask=mask_v, other=0.0).to(tl.float32)

    s_ptrs = state_ptr + slot * stride_sn + h * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
    mask_s = mask_k[:, None] & mask_v[None, :]
    S = tl.load(s_ptrs, mask=mask_s, other=0.0)
    S = S * decay[:, None]
    recalled = tl.sum(S * k[:, None], axis=0)  # S^T k
    delta = beta * (v - recalled)
    S = S + k[:, None] * delta[None, :]
    o = scale * tl.sum(S * q[:, None], axis=0)  # scale * S^T q
    tl.store(s_ptrs, S, mask=mask_s)
    tl.store(o_ptr + n * stride_on + h * stride_oh + offs_v, round_to(o, o_ptr.dtype.element_ty), mask=mask_v)


def fused_recurrent_kda_decode(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g_raw: Tensor,
    beta_raw: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    state_pool: Tensor,
    slot_ids: Tensor,
    *,
    lower_bound: float = -5.0,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    use_beta_sigmoid: bool = True,
    validate: bool = True,
    out: Tensor | None = None,
    config: DecodeConfig | None = None,
) -> Tensor:
    """One KDA step for N sequences; ``state_pool[slot_ids]`` is advanced in place.

    Args:
        q, k: ``[N, H, K]`` raw (post-conv) queries and keys; L2-normalised in the kernel when ``use_qk_l2norm``.
        v: ``[N, H, V]``.
        g_raw: ``[N, H, K]`` raw gate projection; the log decay is ``kda_gate(g_raw, A_log, dt_bias, lower_bound)``.
        beta_raw: ``[N, H]`` write-strength logits (already sigmoided when ``use_beta_sigmoid=False``).
        A_log: ``[H]``; dt_bias: ``[H * K]``.
        state_pool: ``[num_slots, H, K, V]`` fp32, rows ``slot_ids`` read and overwritten.
        slot_ids: ``[N]`` int32/int64, distinct, in range (checked unless ``validate=False``).
        scale: read-out scale, ``K ** -0.5`` by default.
        out: optional ``[N, H, V]`` output buffer (``v``'s dtype).
        config: launch parameters (:class:`DecodeConfig`).

    Returns:
        ``o [N, H, V]`` in ``v``'s dtype.
    """
    _check_decode_inputs(q, k, v, g_raw, beta_raw, A_log, dt_bias, state_pool, slot_ids, validate)
    if not lower_bound < 0:
        raise ValueError(f"lower_bound must be negative, got {lower_bound}")
    config = config or DecodeConfig()
    N, H, K = q.shape
    V = v.shape[2]
    if out is None:
        out = torch.empty(N, H, V, dtype=v.dtype, device=v.device)
    elif out.shape != (N, H, V) or out.dtype != v.dtype:
        raise ValueError(f"out must be [N, H, V] = {(N, H, V)} of {v.dtype}, got {tuple(out.shape)} {out.dtype}")
    if N == 0:
        return out
    # The kernel reads the innermost dimension with unit stride; make that true where it is not.
    q, k, v, g_raw, out_c = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, g_raw, out))
    if state_pool.stride(-1) != 1:
        raise ValueError("state_pool must have a unit stride along V (it is updated in place)")
    A_log, dt_bias = A_log.contiguous(), dt_bias.contiguous()
    scale = K**-0.5 if scale is None else float(scale)
    BV = min(config.block_v, triton.next_power_of_2(V))
    grid = (N * H, triton.cdiv(V, BV))
    _kda_decode_kernel[grid](
        q, k, v, g_raw, beta_raw, A_log, dt_bias, state_pool, slot_ids, out_c,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g_raw.stride(0), g_raw.stride(1),
        beta_raw.stride(0), beta_raw.stride(1), state_pool.stride(0), state_pool.stride(1), state_pool.stride(2),
        out_c.stride(0), out_c.stride(1),
        H, scale, float(lower_bound),
        K=K, V=V, BK=triton.next_power_of_2(K), BV=BV,
        L2NORM=use_qk_l2norm, BETA_SIGMOID=use_beta_sigmoid,
        num_warps=config.num_warps,
    )
    if out_c.data_ptr() != out.data_ptr():
        out.copy_(out_c)
    return out


# ------------------------------------------------------------------------------------ short convolution
def _check_conv_inputs(x, conv_state_pool, weight, slot_ids, validate) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [N, D], got shape {tuple(x.shape)}")
    N, D = x.shape
    if weight.dim() != 2 or weight.shape[0] != D or weight.shape[1] < 1:
        raise ValueError(f"weight must be [D, W] = [{D}, W >= 1], got shape {tuple(weight.shape)}")
    W = weight.shape[1]
    if conv_state_pool.dim() != 3 or conv_state_pool.shape[1:] != (D, W - 1):
        raise ValueError(
            f"conv_state_pool must be [num_slots, D, W-1] = [*, {D}, {W - 1}], got {tuple(conv_state_pool.shape)}"
        )
    devices = {t.device for t in (x, conv_state_pool, weight, slot_ids)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(str(d) for d in devices)}")
    _check_slots(slot_ids, N, conv_state_pool.shape[0], validate)


@triton.jit
def _short_conv_decode_kernel(
    x_ptr, state_ptr, w_ptr, slot_ptr, y_ptr,
    stride_xn, stride_sn, stride_sd, stride_wd, stride_yn,
    D, W: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr,
):
    n = tl.program_id(0)
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    offs_w = tl.arange(0, BW)
    mask_d = offs_d < D
    slot = tl.load(slot_ptr + n).to(tl.int64)
    x = tl.load(x_ptr + n * stride_xn + offs_d, mask=mask_d, other=0.0)
    row = state_ptr + slot * stride_sn + offs_d[:, None] * stride_sd
    # window[:, j] = state[:, j] for j < W-1 and x for j == W-1 (oldest first, as nn.Conv1d sees it)
    in_state = offs_w[None, :] < W - 1
    old = tl.load(row + offs_w[None, :], mask=mask_d[:, None] & in_state, other=0.0)
    window = tl.where(in_state, old.to(tl.float32), x.to(tl.float32)[:, None])
    w = tl.load(w_ptr + offs_d[:, None] * stride_wd + offs_w[None, :],
                mask=mask_d[:, None] & (offs_w[None, :] < W), other=0.0).to(tl.float32)
    acc = tl.sum(window * w, axis=1)
    y = acc * tl.sigmoid(acc)
    tl.store(y_ptr + n * stride_yn + offs_d, round_to(y, y_ptr.dtype.element_ty), mask=mask_d)
    # New state: the window shifted left by one (drop the oldest input); re-read at offset +1.
    shifted_in_state = offs_w[None, :] + 1 < W - 1
    nxt = tl.load(row + offs_w[None, :] + 1, mask=mask_d[:, None] & shifted_in_state, other=0.0)
    new = tl.where(shifted_in_state, nxt.to(tl.float32), x.to(tl.float32)[:, None])
    tl.store(row + offs_w[None, :], round_to(new, state_ptr.dtype.element_ty), mask=mask_d[:, None] & in_state)


def short_conv_decode(
    x: Tensor,
    conv_state_pool: Tensor,
    weight: Tensor,
    slot_ids: Tensor,
    *,
    validate: bool = True,
    out: Tensor | None = None,
    config: DecodeConfig | None = None,
) -> Tensor:
    """One step of ShortConv (depthwise causal conv of width W, then SiLU) for N sequences.

    Args:
        x: ``[N, D]`` the new input of each sequence.
        conv_state_pool: ``[num_slots, D, W - 1]``, the last W-1 inputs (oldest first); rows ``slot_ids``
            are shifted left by one and get ``x`` appended, in place.
        weight: ``[D, W]`` (``nn.Conv1d(D, D, W, groups=D).weight[:, 0]``).
        slot_ids: ``[N]`` distinct slot rows (checked unless ``validate=False``).
        out: optional ``[N, D]`` output buffer of ``x``'s dtype.

    Returns:
        ``y [N, D]`` in ``x``'s dtype (accumulated in fp32).
    """
    _check_conv_inputs(x, conv_state_pool, weight, slot_ids, validate)
    config = config or DecodeConfig()
    N, D = x.shape
    W = weight.shape[1]
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    elif out.shape != x.shape or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be [N, D] = {tuple(x.shape)} of {x.dtype} with unit inner stride")
    if N == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    if W > 1 and conv_state_pool.stride(-1) != 1:
        raise ValueError("conv_state_pool must have a unit stride along its last dimension")
    BD = min(config.block_d, triton.next_power_of_2(D))
    grid = (N, triton.cdiv(D, BD))
    _short_conv_decode_kernel[grid](
        x, conv_state_pool, weight, slot_ids, out,
        x.stride(0), conv_state_pool.stride(0), conv_state_pool.stride(1), weight.stride(0), out.stride(0),
        D, W=W, BW=triton.next_power_of_2(W), BD=BD,
    )
    return out
