"""The one place that decides which implementation of a kernel runs: Triton or the readable reference.

Rule: CUDA tensors go to the Triton kernels, everything else to the references. Never silently on a GPU: when a
CUDA tensor comes in and the Triton path fails to compile or launch, the error propagates; nothing falls back
to the (slow) reference behind the caller's back.

The environment variable ``K3_KERNELS`` overrides the rule:

* ``auto`` (or unset): the rule above.
* ``reference``: references everywhere, e.g. to bisect a numerical problem on a GPU. Logged once per process
  (a warning), so a forced slow path is never invisible.
* ``triton``: Triton everywhere, also for CPU tensors; that only works under Triton's CPU interpreter
  (``TRITON_INTERPRET=1`` set before the kernels are imported) and is how the CPU tests route through this module.

Any other value raises ``ValueError``. The variable is read on every call (no cached global state beyond the
once-only log), so tests and tools may change it at run time.

Triton modules are imported lazily, inside the ops, so importing this module (and the model) does not import
Triton or compile anything.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
from torch import Tensor

__all__ = [
    "ENV_VAR",
    "MODES",
    "kernel_mode",
    "select_backend",
    "kda_chunk_op",
    "kda_chunk_raw_reference",
    "kda_decode_op",
    "short_conv_decode_op",
    "mla_decode_op",
    "situ_glu_op",
    "grouped_mm_op",
]

ENV_VAR = "K3_KERNELS"
MODES = ("auto", "reference", "triton")

_log = logging.getLogger(__name__)


def kernel_mode() -> str:
    """The validated value of ``K3_KERNELS`` (``"auto"`` when unset or empty)."""
    mode = os.environ.get(ENV_VAR, "").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV_VAR} must be one of {MODES}, got {os.environ.get(ENV_VAR)!r}")
    return mode


@functools.cache
def _announce_forced(mode: str) -> None:
    _log.warning("%s=%s: kernel dispatch forced to the %s implementations", ENV_VAR, mode, mode)


def select_backend(*tensors: Tensor | None) -> str:
    """``"triton"`` or ``"reference"`` for an op whose inputs are ``tensors`` (``None`` entries are ignored)."""
    mode = kernel_mode()
    if mode != "auto":
        _announce_forced(mode)
        return mode
    on_gpu = any(t is not None and t.device.type == "cuda" for t in tensors)
    return "triton" if on_gpu else "reference"


# ----------------------------------------------------------------------------------------------------- KDA
def kda_chunk_op(
    q: Tensor, k: Tensor, v: Tensor, g_raw: Tensor, beta_raw: Tensor, A_log: Tensor, dt_bias: Tensor,
    *,
    lower_bound: float = -5.0,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    use_qk_l2norm: bool = True,
    use_beta_sigmoid: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Chunked KDA over ``[B, T, H, K]`` inputs with raw gate/beta (see ``k3.kernels.kda.chunk.chunk_kda``)."""
    kwargs = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  cu_seqlens=cu_seqlens)
    if select_backend(q) == "triton":
        from k3.kernels.kda.chunk import chunk_kda

        return chunk_kda(q, k, v, g_raw, beta_raw, A_log, dt_bias, lower_bound=lower_bound,
                         use_qk_l2norm=use_qk_l2norm, use_beta_sigmoid=use_beta_sigmoid, **kwargs)
    return kda_chunk_raw_reference(q, k, v, g_raw, beta_raw, A_log, dt_bias, lower_bound=lower_bound,
                                   use_qk_l2norm=use_qk_l2norm, use_beta_sigmoid=use_beta_sigmoid, **kwargs)


def kda_chunk_raw_reference(
    q: Tensor, k: Tensor, v: Tensor, g_raw: Tensor, beta_raw: Tensor, A_log: Tensor, dt_bias: Tensor,
    *,
    lower_bound: float = -5.0,
    use_qk_l2norm: bool = True,
    use_beta_sigmoid: bool = True,
    **kwargs,
) -> tuple[Tensor, Tensor | None]:
    """The reference of :func:`kda_chunk_op`: L2 norm, gate and sigmoid in torch, then ``kda_chunk``.

    ``kwargs`` (scale, initial_state, output_final_state, cu_seqlens) go to
    :func:`k3.kernels.kda.reference.kda_chunk`. Differentiable.
    """
    from k3.kernels.kda.reference import _compute_dtype, kda_chunk, kda_gate

    # fp32 at least, fp64 kept (the benchmark's ground truth): an fp32 step here would make all of it fp32
    if use_qk_l2norm:
        q = torch.nn.functional.normalize(q.to(_compute_dtype(q)), dim=-1, eps=1e-6)
        k = torch.nn.functional.normalize(k.to(_compute_dtype(k)), dim=-1, eps=1e-6)
    g = kda_gate(g_raw, A_log, dt_bias, lower_bound)
    beta = torch.sigmoid(beta_raw.to(_compute_dtype(beta_raw))) if use_beta_sigmoid else beta_raw
    return kda_chunk(q, k, v, g, beta, **kwargs)


def kda_decode_op(
    q: Tensor, k: Tensor, v: Tensor, g_raw: Tensor, beta_raw: Tensor, A_log: Tensor, dt_bias: Tensor,
    state_pool: Tensor, slot_ids: Tensor,
    *,
    lower_bound: float = -5.0,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    use_beta_sigmoid: bool = True,
    validate: bool = True,
) -> Tensor:
    """One KDA decode step, ``state_pool[slot_ids]`` updated in place (see ``k3.kernels.kda.decode``)."""
    from k3.kernels.kda import decode

    fn = (decode.fused_recurrent_kda_decode if select_backend(q) == "triton"
          else decode.fused_recurrent_kda_decode_reference)
    return fn(q, k, v, g_raw, beta_raw, A_log, dt_bias, state_pool, slot_ids, lower_bound=lower_bound,
              scale=scale, use_qk_l2norm=use_qk_l2norm, use_beta_sigmoid=use_beta_sigmoid, validate=validate)


def short_conv_decode_op(
    x: Tensor, conv_state_pool: Tensor, weight: Tensor, slot_ids: Tensor, *, validate: bool = True
) -> Tensor:
    """One ShortConv + SiLU step, ``conv_state_pool[slot_ids]`` shifted in place (see ``k3.kernels.kda.decode``)."""
    from k3.kernels.kda import decode

    fn = decode.short_conv_decode if select_backend(x) == "triton" else decode.short_conv_decode_reference
    return fn(x, conv_state_pool, weight, slot_ids, validate=validate)


# ----------------------------------------------------------------------------------------------------- MLA
def mla_decode_op(
    q_nope: Tensor, q_extra: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
    w_kvb: Tensor, gate_logits: Tensor,
    *,
    scale: float | None = None,
    validate: bool = True,
) -> Tensor:
    """Absorbed MLA decode over a paged cache up to (excluding) W_o: ``[B, Tq, H * v]`` (see ``k3.kernels.mla``).

    ``validate=False`` skips the Triton path's host-side checks of ``seq_lens`` and page ids (a device
    synchronisation) for callers that built the page table themselves; the reference always checks.
    """
    if select_backend(q_nope, kv_cache) == "triton":
        from k3.kernels.mla.decode import mla_decode

        return mla_decode(q_nope, q_extra, kv_cache, block_table, seq_lens, w_kvb, gate_logits, scale=scale,
                          validate=validate)
    from k3.kernels.mla.reference import mla_decode_reference

    return mla_decode_reference(q_nope, q_extra, kv_cache, block_table, seq_lens, w_kvb, gate_logits, scale=scale)


# ----------------------------------------------------------------------------------------------------- MoE
def situ_glu_op(x: Tensor, beta1: float = 4.0, beta2: float = 25.0) -> Tensor:
    """SiTU-GLU of a packed ``[..., 2 I]`` input (gate half first), differentiable: ``[..., I]``."""
    if select_backend(x) == "triton":
        from k3.kernels.situ.triton import situ_glu_triton

        return situ_glu_triton(x, beta1, beta2)
    from k3.kernels.situ.reference import situ_glu_reference

    return situ_glu_reference(x, beta1, beta2)


def grouped_mm_op(x: Tensor, w: Tensor, offsets: Tensor, *, validate: bool = True) -> Tensor:
    """Grouped expert product ``y[rows of e] = x[rows of e] @ w[e]``, differentiable (see ``k3.kernels.moe``).

    ``validate=False`` skips the Triton path's host-side check of the offsets (a device synchronisation).
    """
    if select_backend(x) == "triton":
        from k3.kernels.moe.grouped_gemm import grouped_mm

        return grouped_mm(x, w, offsets, validate=validate)
    from k3.kernels.moe.reference import grouped_mm_reference

    return grouped_mm_reference(x, w, offsets)
