"""A KDA segment as the affine map ``S -> M S + S_ext``: against the token recurrence, the per-token product
that defines ``M``, the fold across consecutive segments, and bad inputs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from k3.kernels.kda.context_parallel import (
    apply_segment_transition,
    fold_segment_transitions,
    kda_segment_transition,
)
from k3.kernels.kda.reference import kda_gate, kda_recurrent

pytestmark = pytest.mark.timeout(120)

H, K, V = 2, 8, 6


def make_segment(B: int, T: int, seed: int = 0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = F.normalize(randn(B, T, H, K), dim=-1)
    k = F.normalize(randn(B, T, H, K), dim=-1)
    v = randn(B, T, H, V)
    A_log = torch.empty(H, dtype=torch.float64).uniform_(0.0, math.log(16.0), generator=gen)
    g = kda_gate(randn(B, T, H, K), A_log, randn(H * K))
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    return tuple(x.to(dtype) for x in (q, k, v, g, beta))


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize(("T", "chunk_size"), [(1, 64), (37, 64), (150, 64), (150, 16), (64, 64), (23, 5)])
def test_affine_map_matches_the_recurrence_from_any_state(T, chunk_size):
    q, k, v, g, beta = make_segment(2, T, seed=T)
    M, S_ext = kda_segment_transition(k, v, g, beta, chunk_size=chunk_size)
    assert M.shape == (2, H, K, K) and S_ext.shape == (2, H, K, V)
    assert M.dtype == S_ext.dtype == torch.float64
    gen = torch.Generator().manual_seed(100 + T)
    for _ in range(2):
        S = torch.randn(2, H, K, V, generator=gen, dtype=torch.float64)
        _, expected = kda_recurrent(q, k, v, g, beta, initial_state=S, output_final_state=True)
        assert max_rel(apply_segment_transition(M, S_ext, S), expected) <= 1e-10
    _, from_zero = kda_recurrent(q, k, v, g, beta, output_final_state=True)
    assert max_rel(S_ext, from_zero) <= 1e-10


def test_M_is_the_ordered_product_of_the_token_maps():
    # A_t = (I - beta_t k_t k_t^T) Diag(exp g_t), latest token leftmost.
    _, k, v, g, beta = make_segment(1, 9, seed=3)
    M, _ = kda_segment_transition(k, v, g, beta, chunk_size=4)
    eye = torch.eye(K, dtype=torch.float64)
    for h in range(H):
        expected = eye.clone()
        for t in range(9):
            kt = k[0, t, h]
            A_t = (eye - beta[0, t, h] * torch.outer(kt, kt)) @ torch.diag(g[0, t, h].exp())
            expected = A_t @ expected
        assert max_rel(M[0, h], expected) <= 1e-12


def test_empty_segment_is_the_identity():
    _, k, v, g, beta = make_segment(2, 0)
    M, S_ext = kda_segment_transition(k, v, g, beta)
    assert torch.equal(M, torch.eye(K, dtype=torch.float64).expand(2, H, K, K))
    assert torch.equal(S_ext, torch.zeros(2, H, K, V, dtype=torch.float64))


def test_fp32_inputs_give_fp32_transitions_close_to_fp64():
    _, k, v, g, beta = make_segment(1, 70, seed=5)
    M64, S64 = kda_segment_transition(k, v, g, beta)
    M32, S32 = kda_segment_transition(*(x.float() for x in (k, v, g, beta)))
    assert M32.dtype == S32.dtype == torch.float32
    assert max_rel(M32, M64) <= 1e-5 and max_rel(S32, S64) <= 1e-5


def test_fold_gives_the_state_at_every_segment_boundary():
    q, k, v, g, beta = make_segment(2, 120, seed=7)
    bounds = [0, 37, 37, 101, 120]  # uneven, one empty segment
    pairs = [kda_segment_transition(k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], chunk_size=16)
             for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
    M = torch.stack([p[0] for p in pairs])
    S_ext = torch.stack([p[1] for p in pairs])
    h0 = torch.randn(2, H, K, V, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    states = fold_segment_transitions(M, S_ext, h0)
    assert states.shape == (5, 2, H, K, V)
    assert torch.equal(states[0], h0)
    for i, end in enumerate(bounds):
        _, expected = kda_recurrent(q[:, :end], k[:, :end], v[:, :end], g[:, :end], beta[:, :end],
                                    initial_state=h0, output_final_state=True)
        assert max_rel(states[i], expected) <= 1e-10
    without = fold_segment_transitions(M, S_ext)
    assert torch.equal(without[0], torch.zeros(2, H, K, V, dtype=torch.float64))
    assert max_rel(without[-1], kda_recurrent(q, k, v, g, beta, output_final_state=True)[1]) <= 1e-10


def test_gradients_flow_to_every_input():
    _, k, v, g, beta = make_segment(1, 6, seed=9)
    inputs = [x.clone().requires_grad_() for x in (k, v, g, beta)]
    assert torch.autograd.gradcheck(lambda *xs: kda_segment_transition(*xs, chunk_size=4), inputs,
                                    fast_mode=True)


def test_bad_inputs_name_the_field():
    _, k, v, g, beta = make_segment(1, 10)
    with pytest.raises(ValueError, match=r"k must be \[B, T, H, K\], got shape \(10, 2, 8\)"):
        kda_segment_transition(k[0], v, g, beta)
    with pytest.raises(ValueError, match=r"g must have the shape of k \(1, 10, 2, 8\), got \(1, 9, 2, 8\)"):
        kda_segment_transition(k, v, g[:, :9], beta)
    wrong_v = r"v must be \[B, T, H, V\] with B, T, H = 1, 10, 2, got \(1, 10, 3, 6\)"
    with pytest.raises(ValueError, match=wrong_v):
        kda_segment_transition(k, torch.zeros(1, 10, 3, 6, dtype=torch.float64), g, beta)
    with pytest.raises(ValueError, match=r"beta must be \[B, T, H\] = \(1, 10, 2\), got \(1, 10\)"):
        kda_segment_transition(k, v, g, beta[..., 0])
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="chunk_size must be a positive int"):
            kda_segment_transition(k, v, g, beta, chunk_size=bad)

    M = torch.zeros(3, 1, H, K, K)
    with pytest.raises(ValueError, match=r"M must be \[R, B, H, K, K\], got shape \(3, 1, 2, 8, 7\)"):
        fold_segment_transitions(M[..., :7], torch.zeros(3, 1, H, K, V))
    with pytest.raises(ValueError, match=r"S_ext must be \[R, B, H, K, V\] with R, B, H, K = 3, 1, 2, 8"):
        fold_segment_transitions(M, torch.zeros(2, 1, H, K, V))
    wrong_h0 = r"initial_state must be \[B, H, K, V\] = \(1, 2, 8, 6\), got \(2, 8, 6\)"
    with pytest.raises(ValueError, match=wrong_h0):
        fold_segment_transitions(M, torch.zeros(3, 1, H, K, V), torch.zeros(H, K, V))
