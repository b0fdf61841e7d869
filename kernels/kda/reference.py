"""Readable reference implementations of Kimi Delta Attention (KDA).

Everything here is plain PyTorch, written for clarity; fast kernels are tested against these functions.

Layout and conventions
----------------------
* Activations are ``[B, T, H, K]`` (``v`` is ``[B, T, H, V]``), ``beta`` is ``[B, T, H]``.
* ``g`` is the per-channel **log** decay, ``g <= 0``; the one-step retention of key channel ``c`` is
  ``exp(g[..., c])``. :func:`kda_gate` produces it from the raw gate projection.
* The recurrent state of one head is ``S`` of shape ``[K, V]``; a batch of states is ``[B, H, K, V]``.
  States are kept in fp32 (fp64 when the inputs are fp64) whatever the input dtype; outputs come back in
  the dtype of ``v``.
* Packed variable-length batches use ``cu_seqlens`` (int tensor ``[N + 1]``, ``cu_seqlens[0] == 0``,
  ``cu_seqlens[-1] == T``) with ``B == 1``; sequence ``n`` occupies tokens ``cu_seqlens[n]:cu_seqlens[n+1]``
  and every sequence starts from its own initial state (``initial_state`` is then ``[N, H, K, V]``).

The recurrence (one token, one head)
------------------------------------
::

    S <- Diag(exp(g_t)) S                      # decay along the key dimension
    S <- S + beta_t k_t (v_t - S^T k_t)^T      # delta rule: erase what k_t addressed, write v_t
    o_t = scale * S^T q_t

The chunked form and where it comes from
----------------------------------------
Split the sequence into chunks of ``C`` tokens; inside one chunk let ``S_0`` be the state before it and
``G_i = g_1 + ... + g_i`` the cumulative log decay (per key channel, inclusive). Write the value the delta
rule actually adds at step ``i`` as ``delta_i = beta_i (v_i - S'_i^T k_i)`` (``S'_i`` = state after the
decay of step ``i``). Unrolling the recurrence gives

    S_i = Diag(exp(G_i)) S_0 + sum_{j<=i} (k_j * exp(G_i - G_j)) delta_j^T.

Substituting ``S'_i`` into the definition of ``delta_i`` yields a linear system that is unit lower
triangular in the chunk positions:

    delta_i + sum_{j<i} A_kk[i, j] delta_j = beta_i v_i - beta_i (k_i * exp(G_i))^T S_0,
    A_kk[i, j] = beta_i sum_c k_ic k_jc exp(G_ic - G_jc)        (strictly lower triangular)

so with ``T_inv = (I + A_kk)^-1`` (forward substitution; the "UT"/"WY" transform)

    u = T_inv (beta * V),   w = T_inv (beta * K * exp(G)),   delta = v_new = u - w S_0.

The state after the chunk and the chunk's outputs then follow from the unrolled form:

    S_next = Diag(exp(G_last)) S_0 + (K * exp(G_last - G))^T v_new
    O      = scale (Q * exp(G)) S_0 + A_qk v_new,
    A_qk[i, j] = scale sum_c q_ic k_jc exp(G_ic - G_jc)          (lower triangular, diagonal included)

Every exponent used is ``G_i - G_j`` with ``i >= j`` (or ``G_i`` itself), i.e. never positive, so nothing
can overflow; the pairwise differences are formed explicitly instead of factorising
``exp(G_i) * exp(-G_j)``, which would overflow for long chunks (``G`` reaches ``-5 * 64``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["kda_gate", "kda_recurrent", "kda_chunk"]

# exp(A_log) is clamped to the largest finite fp32 value so that a huge A_log times a zero
# (g_raw + dt_bias) is 0 rather than inf * 0 = NaN.
_FP32_MAX = torch.finfo(torch.float32).max
# sigmoid(-80) ~ 1.8e-35 is still a normal fp32 number, so lower_bound * sigmoid(x) stays strictly
# negative; the retention exp(g) is 1.0 in fp32 either way, so the clamp changes no result.
_GATE_LOGIT_MIN = -80.0


def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def kda_gate(g_raw: Tensor, A_log: Tensor, dt_bias: Tensor, lower_bound: float = -5.0) -> Tensor:
    """Per-channel log decay ``lower_bound * sigmoid(exp(A_log[h]) * (g_raw + dt_bias[h, c]))``.

    Args:
        g_raw: raw gate projection ``[..., H, K]``.
        A_log: ``[H]``, log of the per-head decay rate.
        dt_bias: ``[H * K]``, per-channel bias (flattened head-major, like the projection output).
        lower_bound: most negative log decay allowed (``< 0``).

    Returns:
        ``g_log`` of the shape of ``g_raw`` in fp32 (fp64 for fp64 input), every entry in
        ``[lower_bound, 0)``; infinite ``g_raw`` entries map onto the ends of that interval without NaN.
    """
    if g_raw.dim() < 2:
        raise ValueError(f"g_raw must be [..., H, K], got shape {tuple(g_raw.shape)}")
    H, K = g_raw.shape[-2:]
    if A_log.shape != (H,):
        raise ValueError(f"A_log must have shape [H]=[{H}], got {tuple(A_log.shape)}")
    if dt_bias.shape != (H * K,):
        raise ValueError(f"dt_bias must have shape [H*K]=[{H * K}], got {tuple(dt_bias.shape)}")
    if not lower_bound < 0:
        raise ValueError(f"lower_bound must be negative, got {lower_bound}")
    dtype = _compute_dtype(g_raw)
    rate = A_log.to(dtype).exp().clamp(max=_FP32_MAX)[:, None]  # [H, 1]
    logits = rate * (g_raw.to(dtype) + dt_bias.to(dtype).view(H, K))
    return lower_bound * torch.sigmoid(logits.clamp(min=_GATE_LOGIT_MIN))


# --------------------------------------------------------------------------------------------- validation


def sequence_bounds(cu_seqlens: Tensor, total: int) -> list[tuple[int, int]]:
    """Validate ``cu_seqlens`` for a packed row of ``total`` tokens; return the ``(start, end)`` of each sequence."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D tensor [N + 1] with N >= 1, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(f"cu_seqlens must start at 0 and end at T = {total}, got {bounds[0]} .. {bounds[-1]}")
    if any(end < start for start, end in zip(bounds[:-1], bounds[1:], strict=True)):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {bounds}")
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _check_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
) -> list[tuple[int, int, int]]:
    """Validate shapes; return the list of (batch row, start, end) segments that are independent sequences."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q {tuple(q.shape)}, got {tuple(k.shape)}")
    if g.shape != q.shape:
        raise ValueError(f"g must have the shape of q {tuple(q.shape)}, got {tuple(g.shape)}")
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] with B, T, H = {B}, {T}, {H}, got {tuple(v.shape)}")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must be [B, T, H] = {(B, T, H)}, got {tuple(beta.shape)}")
    V = v.shape[-1]

    if cu_seqlens is None:
        segments = [(b, 0, T) for b in range(B)]
    else:
        if B != 1:
            raise ValueError(f"cu_seqlens requires a packed batch with B == 1, got B = {B}")
        segments = [(0, s, e) for s, e in sequence_bounds(cu_seqlens, T)]

    if initial_state is not None and initial_state.shape != (len(segments), H, K, V):
        who = "N (number of sequences)" if cu_seqlens is not None else "B"
        raise ValueError(
            f"initial_state must be [{who}, H, K, V] = {(len(segments), H, K, V)}, got {tuple(initial_state.shape)}"
        )
    return segments


def _initial_states(initial_state: Tensor | None, n: int, H: int, K: int, V: int, dtype, device) -> Tensor:
    if initial_state is None:
        return torch.zeros(n, H, K, V, dtype=dtype, device=device)
    return initial_state.to(dtype)


# -------------------------------------------------------------------------------------- token recurrence


def _recurrent_sequence(q, k, v, g, beta, scale, S):
    """One batch of equal-length sequences: q, k, g [b, t, H, K]; v [b, t, H, V]; beta [b, t, H]; S [b, H, K, V]."""
    outputs = []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None]  # decay each key row
        recalled = torch.einsum("bhk,bhkv->bhv", k[:, t], S)  # S^T k: what k currently retrieves
        delta = beta[:, t, :, None] * (v[:, t] - recalled)
        S = S + k[:, t, :, :, None] * delta[:, :, None, :]
        outputs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(v.shape)
    return o, S


def kda_recurrent(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Token-by-token KDA (the definition). See the module docstring for shapes and conventions.

    Returns ``(o, final_state)``: ``o`` is ``[B, T, H, V]`` in ``v``'s dtype; ``final_state`` is
    ``[B, H, K, V]`` (``[N, H, K, V]`` with ``cu_seqlens``) in fp32/fp64, or ``None`` unless
    ``output_final_state``.
    """
    segments = _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    dtype = _compute_dtype(q)
    scale = K**-0.5 if scale is None else scale
    v_dtype = v.dtype
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    states = _initial_states(initial_state, len(segments), H, K, V, dtype, q.device)

    if cu_seqlens is None:  # all rows share T: run them together
        o, final = _recurrent_sequence(q, k, v, g, beta, scale, states)
    else:  # segments are contiguous and in order, so the outputs concatenate back to [1, T, H, V]
        outs, finals = [], []
        for n, (_, s, e) in enumerate(segments):
            o_n, S_n = _recurrent_sequence(
                q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], scale, states[n : n + 1]
            )
            outs.append(o_n)
            finals.append(S_n)
        o, final = torch.cat(outs, dim=1), torch.cat(finals, dim=0)
    return o.to(v_dtype), (final if output_final_state else None)


# ------------------------------------------------------------------------------------------ chunked form


def _forward_substitution_inverse(A: Tensor) -> Tensor:
    """``(I + A)^-1`` for strictly lower-triangular ``A`` ``[..., C, C]`` by forward substitution.

    Row ``i`` of ``X = (I + A)^-1`` solves ``X[i] = e_i - sum_{m<i} A[i, m] X[m]``, so rows are produced in
    order from the rows above (appended rather than written in place, so autograd can differentiate it).
    """
    C = A.shape[-1]
    eye = torch.eye(C, dtype=A.dtype, device=A.device)
    X = eye[:1].expand(*A.shape[:-2], 1, C)
    for i in range(1, C):
        row = eye[i] - A[..., i : i + 1, :i] @ X
        X = torch.cat([X, row], dim=-2)
    return X


def _chunk_step(q, k, v, g, beta, scale, S):
    """Advance a batch of states over one chunk.

    q, k, g: [b, H, C, K]; v: [b, H, C, V]; beta: [b, H, C]; S: [b, H, K, V]. Returns (out [b, H, C, V], S_next).
    """
    C = q.shape[-2]
    G = g.cumsum(dim=-2)  # inclusive cumulative log decay within the chunk
    # Pairwise G_i - G_j per key channel; only i >= j is used, the rest is masked before exp.
    diff = G[..., :, None, :] - G[..., None, :, :]  # [b, H, C(i), C(j), K]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict = causal.tril(-1)
    decay_incl = diff.masked_fill(~causal[..., None], -math.inf).exp()
    decay_strict = diff.masked_fill(~strict[..., None], -math.inf).exp()

    A_kk = beta[..., None] * torch.einsum("bhik,bhjk,bhijk->bhij", k, k, decay_strict)
    A_qk = scale * torch.einsum("bhik,bhjk,bhijk->bhij", q, k, decay_incl)

    T_inv = _forward_substitution_inverse(A_kk)
    u = T_inv @ (beta[..., None] * v)  # [b, H, C, V]
    w = T_inv @ (beta[..., None] * k * G.exp())  # [b, H, C, K]
    v_new = u - w @ S  # the values the delta rule really writes

    out = scale * (q * G.exp()) @ S + A_qk @ v_new
    G_last = G[..., -1:, :]  # [b, H, 1, K]
    S_next = G_last.transpose(-1, -2).exp() * S + (k * (G_last - G).exp()).transpose(-1, -2) @ v_new
    return out, S_next


def _chunk_sequence(q, k, v, g, beta, scale, S, chunk_size):
    """Chunked KDA over equal-length sequences in [b, t, H, *] layout; returns (o, final S, states before chunks)."""
    # Heads next to batch so that the per-chunk algebra is a batch of matrix products.
    b, t, H, V = v.shape
    q, k, v, g = (x.transpose(1, 2) for x in (q, k, v, g))  # [b, H, t, *]
    beta = beta.transpose(1, 2)  # [b, H, t]
    outputs, chunk_states = [v.new_zeros(b, H, 0, V)], []
    for start in range(0, q.shape[2], chunk_size):
        sl = slice(start, start + chunk_size)  # the last chunk may be shorter
        chunk_states.append(S)
        out, S = _chunk_step(q[:, :, sl], k[:, :, sl], v[:, :, sl], g[:, :, sl], beta[:, :, sl], scale, S)
        outputs.append(out)
    o = torch.cat(outputs, dim=2).transpose(1, 2)  # the empty head entry makes t == 0 work
    return o, S, chunk_states


def kda_chunk(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    chunk_size: int = 64,
    return_chunk_states: bool = False,
) -> tuple[Tensor, Tensor | None] | tuple[Tensor, Tensor | None, Tensor]:
    """Chunked KDA (the WY/UT-transform algorithm of the module docstring); same results as :func:`kda_recurrent`.

    A trailing partial chunk is handled as a shorter chunk. With ``cu_seqlens`` every sequence is chunked on
    its own, starting at its first token, so no chunk straddles two sequences.

    Returns ``(o, final_state)`` like :func:`kda_recurrent`, plus, when ``return_chunk_states``, a third
    tensor ``chunk_states`` of shape ``[B, NC, H, K, V]`` (fp32/fp64) holding the state *before* every chunk:

    * without ``cu_seqlens``: ``NC = ceil(T / chunk_size)`` and ``chunk_states[b, c]`` is the state of row
      ``b`` after its first ``c * chunk_size`` tokens (``chunk_states[:, 0]`` is the initial state);
    * with ``cu_seqlens`` (``B == 1``): ``NC = sum_n ceil(len_n / chunk_size)``; chunks are listed sequence
      by sequence, and chunk ``c`` of sequence ``n`` holds that sequence's state after
      ``c * chunk_size`` of its tokens. Empty sequences contribute no chunk.
    """
    segments = _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    dtype = _compute_dtype(q)
    scale = K**-0.5 if scale is None else scale
    v_dtype = v.dtype
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    states = _initial_states(initial_state, len(segments), H, K, V, dtype, q.device)

    if cu_seqlens is None:
        o, final, per_chunk = _chunk_sequence(q, k, v, g, beta, scale, states, chunk_size)
        chunk_states = (
            torch.stack(per_chunk, dim=1) if per_chunk else torch.zeros(B, 0, H, K, V, dtype=dtype, device=q.device)
        )
    else:
        outs, finals, per_chunk = [], [], []
        for n, (_, s, e) in enumerate(segments):
            o_n, S_n, chunks_n = _chunk_sequence(
                q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], scale, states[n : n + 1], chunk_size
            )
            outs.append(o_n)
            finals.append(S_n)
            per_chunk.extend(chunks_n)  # an empty sequence has no chunk
        o, final = torch.cat(outs, dim=1), torch.cat(finals, dim=0)
        chunk_states = (
            torch.stack(per_chunk, dim=1) if per_chunk else torch.zeros(1, 0, H, K, V, dtype=dtype, device=q.device)
        )

    o = o.to(v_dtype)
    final = final if output_final_state else None
    if return_chunk_states:
        return o, final, chunk_states
    return o, final
