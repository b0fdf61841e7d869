"""The algebra of KDA context parallelism: a segment of tokens as an affine map on the state, and the fold.

A long sequence is cut into contiguous segments, one per rank. Whatever state ``S`` enters a segment, the
state that leaves it is affine in ``S``::

    S_out = M S + S_ext,        M: [K, K],  S_ext: [K, V]   (per batch row and head)

so the ranks only exchange the pair ``(M, S_ext)`` of their segment, fold the pairs of the ranks before them
onto the initial state, and then run their own segment from the right incoming state.

Deriving M
----------
One token (see :mod:`k3.kernels.kda.reference`) does ``S <- Diag(exp g_t) S`` and then
``S <- S + beta_t k_t (v_t - S^T k_t)^T``; together ::

    S <- (I - beta_t k_t k_t^T) Diag(exp g_t) S + beta_t k_t v_t^T = A_t S + beta_t k_t v_t^T

Each column of ``S`` evolves on its own by the same ``A_t``, so over a segment of tokens ``1..T``
``M = A_T ... A_1`` (latest token leftmost) and ``S_ext`` is the state the segment reaches from ``S = 0``.

Per chunk, the WY/UT form of the reference gives ``v_new = u - w S_0`` and
``S_next = Diag(exp G_last) S_0 + (K * exp(G_last - G))^T v_new``, i.e. ::

    S_next = M_c S_0 + (K * exp(G_last - G))^T u,
    M_c    = Diag(exp G_last) - (K * exp(G_last - G))^T w.

``M_c`` is never formed: the running product ``M <- M_c M`` is applied as
``exp(G_last) * M - (K * exp(G_last - G))^T (w M)``, two ``[C, K] x [K, K]``-sized products per chunk, so a
segment of ``T`` tokens costs ``O(T K (K + V + C))`` like one chunked pass, not ``O(T K^3)``. The same step
with ``u`` carries ``S_ext`` (``S_ext <- exp(G_last) * S_ext + (K * exp(G_last - G))^T (u - w S_ext)``).
All exponents are differences ``G_last - G_j <= 0`` (or ``G`` itself), so nothing overflows.

The fold
--------
Transitions compose associatively: ``(M2, E2) o (M1, E1) = (M2 M1, M2 E1 + E2)``, so a log-depth scan is
possible, but each combine costs a ``K x K`` by ``K x K`` product, while applying the pairs one after another
to the state costs ``K x K`` by ``K x V`` per rank. With at most a handful of ranks (R <= 8) the sequential
fold is both cheaper and simpler, and it yields every prefix state at once (each rank's incoming state and
the final state), so that is what :func:`fold_segment_transitions` does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3.kernels.kda.reference import _compute_dtype, _forward_substitution_inverse

__all__ = ["apply_segment_transition", "fold_segment_transitions", "kda_segment_transition"]


def _check_segment(k: Tensor, v: Tensor, g: Tensor, beta: Tensor, chunk_size: int) -> None:
    if k.dim() != 4:
        raise ValueError(f"k must be [B, T, H, K], got shape {tuple(k.shape)}")
    B, T, H, _ = k.shape
    if g.shape != k.shape:
        raise ValueError(f"g must have the shape of k {tuple(k.shape)}, got {tuple(g.shape)}")
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] with B, T, H = {B}, {T}, {H}, got {tuple(v.shape)}")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must be [B, T, H] = {(B, T, H)}, got {tuple(beta.shape)}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def kda_segment_transition(
    k: Tensor, v: Tensor, g: Tensor, beta: Tensor, chunk_size: int = 64
) -> tuple[Tensor, Tensor]:
    """The affine map ``S -> M S + S_ext`` that a segment of tokens applies to the KDA state.

    Args:
        k, g: ``[B, T, H, K]`` keys and per-channel log decays of the segment.
        v: ``[B, T, H, V]``; ``beta``: ``[B, T, H]``.
        chunk_size: tokens per chunk of the WY form (a trailing partial chunk is a shorter chunk).

    Returns:
        ``(M, S_ext)``: ``M`` ``[B, H, K, K]`` and ``S_ext`` ``[B, H, K, V]`` in fp32 (fp64 for fp64 ``k``),
        differentiable in every input. An empty segment (``T == 0``) is the identity: ``(I, 0)``.
    """
    _check_segment(k, v, g, beta, chunk_size)
    B, T, H, K = k.shape
    V = v.shape[-1]
    dtype = _compute_dtype(k)
    # Heads next to batch so that each chunk is a batch of matrix products: [B, H, T, *].
    k, v, g = (x.to(dtype).transpose(1, 2) for x in (k, v, g))
    beta = beta.to(dtype).transpose(1, 2)[..., None]  # [B, H, T, 1]

    M = torch.eye(K, dtype=dtype, device=k.device).expand(B, H, K, K)
    S_ext = torch.zeros(B, H, K, V, dtype=dtype, device=k.device)
    for start in range(0, T, chunk_size):
        sl = slice(start, start + chunk_size)
        kc, vc, bc = k[:, :, sl], v[:, :, sl], beta[:, :, sl]
        G = g[:, :, sl].cumsum(dim=-2)  # inclusive cumulative log decay within the chunk
        C = G.shape[-2]
        # A_kk[i, j] = beta_i sum_c k_ic k_jc exp(G_ic - G_jc) for j < i; masked entries become exp(-inf) = 0.
        strict = torch.ones(C, C, dtype=torch.bool, device=k.device).tril(-1)
        diff = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~strict[..., None], -torch.inf)
        A_kk = bc * torch.einsum("bhik,bhjk,bhijk->bhij", kc, kc, diff.exp())
        T_inv = _forward_substitution_inverse(A_kk)
        u = T_inv @ (bc * vc)  # [B, H, C, V]
        w = T_inv @ (bc * kc * G.exp())  # [B, H, C, K]

        G_last = G[..., -1:, :]  # [B, H, 1, K]
        keep = G_last.transpose(-1, -2).exp()  # Diag(exp G_last) as a [K, 1] row scaling
        k_to_end = (kc * (G_last - G).exp()).transpose(-1, -2)  # [B, H, K, C]
        M = keep * M - k_to_end @ (w @ M)
        S_ext = keep * S_ext + k_to_end @ (u - w @ S_ext)
    return M.contiguous(), S_ext


def apply_segment_transition(M: Tensor, S_ext: Tensor, S: Tensor) -> Tensor:
    """``M S + S_ext`` for batches of states ``S`` ``[..., K, V]`` (``M`` ``[..., K, K]``)."""
    return M @ S + S_ext


def fold_segment_transitions(M: Tensor, S_ext: Tensor, initial_state: Tensor | None = None) -> Tensor:
    """Every prefix state of a sequence cut into ``R`` segments, from their transitions in order.

    Args:
        M: ``[R, B, H, K, K]``, segment ``r``'s transition matrix.
        S_ext: ``[R, B, H, K, V]``, segment ``r``'s state from a zero incoming state.
        initial_state: ``[B, H, K, V]`` state before segment 0 (zeros when ``None``).

    Returns:
        ``states`` ``[R + 1, B, H, K, V]`` in the dtype of ``M``: ``states[r]`` enters segment ``r`` and
        ``states[R]`` is the final state. Sequential, ``O(R)`` deep (see the module docstring for why).
    """
    if M.dim() != 5 or M.shape[-1] != M.shape[-2]:
        raise ValueError(f"M must be [R, B, H, K, K], got shape {tuple(M.shape)}")
    R, B, H, K, _ = M.shape
    if S_ext.dim() != 5 or S_ext.shape[:4] != (R, B, H, K):
        raise ValueError(
            f"S_ext must be [R, B, H, K, V] with R, B, H, K = {R}, {B}, {H}, {K}, got {tuple(S_ext.shape)}"
        )
    V = S_ext.shape[-1]
    if initial_state is None:
        state = M.new_zeros(B, H, K, V)
    elif initial_state.shape != (B, H, K, V):
        raise ValueError(
            f"initial_state must be [B, H, K, V] = {(B, H, K, V)}, got {tuple(initial_state.shape)}"
        )
    else:
        state = initial_state.to(M.dtype)
    states = [state]
    for r in range(R):
        state = apply_segment_transition(M[r], S_ext[r], state)
        states.append(state)
    return torch.stack(states)
