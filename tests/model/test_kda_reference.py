"""The readable KDA references: the chunked form against the token recurrence, the gate's range, bad inputs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from k3.kernels.kda import kda_chunk, kda_gate, kda_recurrent

pytestmark = pytest.mark.timeout(120)

H, K, V = 2, 16, 16


def make_inputs(B: int, T: int, dtype=torch.float64, seed: int = 0, n_states: int | None = None):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = F.normalize(randn(B, T, H, K), dim=-1)
    k = F.normalize(randn(B, T, H, K), dim=-1)
    v = randn(B, T, H, V)
    A_log = torch.empty(H, dtype=torch.float64).uniform_(0.0, math.log(16.0), generator=gen)
    g = kda_gate(randn(B, T, H, K), A_log, randn(H * K))
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    h0 = randn(n_states if n_states is not None else B, H, K, V)
    return tuple(x.to(dtype) for x in (q, k, v, g, beta)), h0.to(dtype)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ----------------------------------------------------------------------------------- the recurrence itself


def test_recurrence_writes_and_recalls_an_association():
    # With no decay (g = 0) and beta = 1, writing (k, v) makes S^T k == v exactly: the delta rule replaces
    # whatever k addressed; and with beta = 0 the memory is only read: o = scale * S0^T q.
    (q, k, v, _, _), h0 = make_inputs(1, 1)
    g = torch.zeros_like(q)
    o, S = kda_recurrent(q, k, v, g, torch.ones(1, 1, H, dtype=torch.float64), initial_state=h0,
                         output_final_state=True)
    recalled = torch.einsum("hk,hkv->hv", k[0, 0], S[0])
    torch.testing.assert_close(recalled, v[0, 0], rtol=0, atol=1e-12)
    torch.testing.assert_close(o[0, 0], K**-0.5 * torch.einsum("hk,hkv->hv", q[0, 0], S[0]))

    o_read, S_read = kda_recurrent(q, k, v, g, torch.zeros(1, 1, H, dtype=torch.float64), scale=0.5,
                                   initial_state=h0, output_final_state=True)
    torch.testing.assert_close(S_read, h0)
    torch.testing.assert_close(o_read[0, 0], 0.5 * torch.einsum("hk,hkv->hv", q[0, 0], h0[0]))


def test_decay_acts_along_the_key_dimension():
    # beta = 0: the state only decays; row c of S is multiplied by exp(g_c) each step.
    (q, k, v, g, _), h0 = make_inputs(1, 3)
    _, S = kda_recurrent(q, k, v, g, torch.zeros(1, 3, H, dtype=torch.float64), initial_state=h0,
                         output_final_state=True)
    expected = h0 * g[0].sum(0).exp()[None, :, :, None]
    torch.testing.assert_close(S, expected)


# --------------------------------------------------------------------------------- chunked == recurrence


@pytest.mark.parametrize("T", [1, 64, 100, 130])
def test_chunk_matches_recurrence_fp64(T):
    (q, k, v, g, beta), h0 = make_inputs(2, T)
    o_r, s_r = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_c, s_c = kda_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o_c.shape == (2, T, H, V) and o_c.dtype == torch.float64
    assert s_c.shape == (2, H, K, V) and s_c.dtype == torch.float64
    assert rel_err(o_c, o_r) <= 1e-8
    assert rel_err(s_c, s_r) <= 1e-8


def test_chunk_matches_recurrence_fp32_with_small_chunks():
    (q, k, v, g, beta), h0 = make_inputs(2, 100, dtype=torch.float32, seed=1)
    o_r, s_r = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    for chunk_size in (16, 64):
        o_c, s_c = kda_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=chunk_size)
        assert o_c.dtype == torch.float32 and s_c.dtype == torch.float32
        assert rel_err(o_c, o_r) <= 1e-4
        assert rel_err(s_c, s_r) <= 1e-4


def test_chunk_without_initial_state_and_custom_scale():
    (q, k, v, g, beta), _ = make_inputs(2, 70, seed=2)
    o_r, none = kda_recurrent(q, k, v, g, beta, scale=0.3)
    o_c, none_c = kda_chunk(q, k, v, g, beta, scale=0.3)
    assert none is None and none_c is None
    assert rel_err(o_c, o_r) <= 1e-8


def test_strong_decay_stays_finite():
    # Every step at the lower bound: G reaches -5 * 64 = -320 inside a chunk, far beyond exp's fp32 range
    # if it were factorised as exp(G_i) * exp(-G_j).
    (q, k, v, _, beta), h0 = make_inputs(1, 100, dtype=torch.float32, seed=3)
    g = torch.full_like(q, -5.0)
    o_r, s_r = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_c, s_c = kda_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert torch.isfinite(o_c).all() and torch.isfinite(s_c).all()
    assert rel_err(o_c, o_r) <= 1e-4


def test_low_precision_inputs_keep_an_fp32_state():
    (q, k, v, g, beta), h0 = make_inputs(1, 40, dtype=torch.bfloat16, seed=4)
    o, s = kda_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    o_r, s_r = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o_r.dtype == torch.bfloat16 and s_r.dtype == torch.float32
    assert rel_err(s, s_r) <= 1e-4


def test_chunk_gradients_match_recurrence():
    (q, k, v, g, beta), h0 = make_inputs(1, 20, seed=5)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    o, s = kda_chunk(*leaves[:5], initial_state=leaves[5], output_final_state=True, chunk_size=8)
    grads_c = torch.autograd.grad(o.sin().sum() + s.cos().sum(), leaves)
    leaves_r = [x.detach().clone().requires_grad_() for x in leaves]
    o, s = kda_recurrent(*leaves_r[:5], initial_state=leaves_r[5], output_final_state=True)
    grads_r = torch.autograd.grad(o.sin().sum() + s.cos().sum(), leaves_r)
    for name, gc, gr in zip("q k v g beta h0".split(), grads_c, grads_r, strict=True):
        assert rel_err(gc, gr) <= 1e-8, name


# ---------------------------------------------------------------------------------------- chunk states


def test_chunk_states_are_the_states_before_each_chunk():
    (q, k, v, g, beta), h0 = make_inputs(2, 100, seed=6)
    _, final, chunk_states = kda_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                       return_chunk_states=True)
    assert chunk_states.shape == (2, 2, H, K, V)  # ceil(100 / 64) chunks
    torch.testing.assert_close(chunk_states[:, 0], h0, rtol=0, atol=0)
    _, s64 = kda_recurrent(q[:, :64], k[:, :64], v[:, :64], g[:, :64], beta[:, :64], initial_state=h0,
                           output_final_state=True)
    assert rel_err(chunk_states[:, 1], s64) <= 1e-8
    # return_chunk_states does not change the other results
    o2, final2 = kda_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(final2, final, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ varlen

LENGTHS = [70, 13, 100]  # one sequence shorter than a chunk, none a multiple of it


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def test_varlen_equals_separate_sequences():
    T = sum(LENGTHS)
    (q, k, v, g, beta), h0 = make_inputs(1, T, seed=7, n_states=len(LENGTHS))
    cu = _cu(LENGTHS)
    o_c, s_c, chunk_states = kda_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                       cu_seqlens=cu, return_chunk_states=True)
    o_r, s_r = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert s_c.shape == s_r.shape == (3, H, K, V)
    assert rel_err(o_c, o_r) <= 1e-8 and rel_err(s_c, s_r) <= 1e-8
    # chunks per sequence: ceil(70/64) + ceil(13/64) + ceil(100/64) = 2 + 1 + 2
    assert chunk_states.shape == (1, 5, H, K, V)

    expected_chunk_states = []
    for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        seg = [x[:, s:e] for x in (q, k, v, g, beta)]
        o_n, s_n = kda_recurrent(*seg, initial_state=h0[n : n + 1], output_final_state=True)
        assert rel_err(o_c[:, s:e], o_n) <= 1e-8
        assert rel_err(s_c[n : n + 1], s_n) <= 1e-8
        for start in range(0, e - s, 64):
            _, s_prefix = kda_recurrent(*(x[:, :start] for x in seg), initial_state=h0[n : n + 1],
                                        output_final_state=True)
            expected_chunk_states.append(s_prefix[0])
    assert rel_err(chunk_states[0], torch.stack(expected_chunk_states)) <= 1e-8


def test_varlen_without_initial_state_fp32():
    T = sum(LENGTHS)
    (q, k, v, g, beta), _ = make_inputs(1, T, dtype=torch.float32, seed=8)
    cu = _cu(LENGTHS)
    o_c, s_c = kda_chunk(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu)
    o_r, s_r = kda_recurrent(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu)
    assert rel_err(o_c, o_r) <= 1e-4 and rel_err(s_c, s_r) <= 1e-4
    # the second sequence does not see the first: same as running it alone from zeros
    o_alone, _ = kda_recurrent(*(x[:, 70:83] for x in (q, k, v, g, beta)))
    assert rel_err(o_c[:, 70:83], o_alone) <= 1e-4


def test_varlen_empty_sequence_keeps_its_initial_state():
    (q, k, v, g, beta), h0 = make_inputs(1, 10, seed=9, n_states=2)
    cu = torch.tensor([0, 0, 10])
    o, s, chunk_states = kda_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                   return_chunk_states=True)
    torch.testing.assert_close(s[0], h0[0], rtol=0, atol=0)
    assert chunk_states.shape == (1, 1, H, K, V)
    _, s_r = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert rel_err(s, s_r) <= 1e-8


# ----------------------------------------------------------------------------------------------- the gate


def test_gate_formula_and_range():
    gen = torch.Generator().manual_seed(10)
    g_raw = torch.randn(3, 5, H, K, generator=gen)
    A_log, dt_bias = torch.randn(H, generator=gen), torch.randn(H * K, generator=gen)
    g = kda_gate(g_raw, A_log, dt_bias)
    expected = -5.0 * torch.sigmoid(A_log.exp()[:, None] * (g_raw + dt_bias.view(H, K)))
    torch.testing.assert_close(g, expected)
    assert g.dtype == torch.float32 and g.shape == g_raw.shape
    g3 = kda_gate(g_raw, A_log, dt_bias, lower_bound=-3.0)
    torch.testing.assert_close(g3, g * 0.6)


@pytest.mark.parametrize("A_log_value", [0.0, 20.0, 100.0, 1e4])
def test_gate_stays_in_range_for_extreme_inputs(A_log_value):
    g_raw = torch.tensor([-1e4, 1e4, -math.inf, math.inf, 0.0, -30.0, 30.0, -1e-3]).repeat(H, K // 8 + 1)[:, :K]
    g_raw = g_raw.to(torch.bfloat16).float()[None]  # [1, H, K]
    A_log = torch.full((H,), A_log_value)
    for dt_bias in (torch.zeros(H * K), torch.full((H * K,), -50.0), torch.full((H * K,), 50.0)):
        g = kda_gate(g_raw, A_log, dt_bias)
        assert not torch.isnan(g).any()
        assert (g >= -5.0).all() and (g < 0).all(), g
    g64 = kda_gate(g_raw.double(), A_log.double(), torch.zeros(H * K, dtype=torch.float64))
    assert g64.dtype == torch.float64 and (g64 < 0).all() and (g64 >= -5.0).all()


def test_gate_bad_inputs():
    with pytest.raises(ValueError, match=r"A_log must have shape \[H\]=\[2\], got \(3,\)"):
        kda_gate(torch.zeros(4, H, K), torch.zeros(3), torch.zeros(H * K))
    with pytest.raises(ValueError, match=r"dt_bias must have shape \[H\*K\]=\[32\], got \(16,\)"):
        kda_gate(torch.zeros(4, H, K), torch.zeros(H), torch.zeros(16))
    with pytest.raises(ValueError, match="lower_bound must be negative, got 0.0"):
        kda_gate(torch.zeros(4, H, K), torch.zeros(H), torch.zeros(H * K), lower_bound=0.0)
    with pytest.raises(ValueError, match=r"g_raw must be \[\.\.\., H, K\]"):
        kda_gate(torch.zeros(K), torch.zeros(H), torch.zeros(H * K))


# ------------------------------------------------------------------------------------------- bad inputs


def test_bad_shapes_are_rejected_with_the_argument_named():
    (q, k, v, g, beta), h0 = make_inputs(2, 8)
    for fn in (kda_recurrent, kda_chunk):
        with pytest.raises(ValueError, match=r"q must be \[B, T, H, K\]"):
            fn(q[0], k, v, g, beta)
        with pytest.raises(ValueError, match=r"k must have the shape of q \(2, 8, 2, 16\), got \(2, 8, 2, 8\)"):
            fn(q, k[..., :8], v, g, beta)
        with pytest.raises(ValueError, match=r"g must have the shape of q"):
            fn(q, k, v, g[:, :4], beta)
        with pytest.raises(ValueError, match=r"v must be \[B, T, H, V\]"):
            fn(q, k, v[:, :4], g, beta)
        with pytest.raises(ValueError, match=r"beta must be \[B, T, H\] = \(2, 8, 2\), got \(2, 8\)"):
            fn(q, k, v, g, beta[..., 0])
        with pytest.raises(ValueError, match=r"initial_state must be \[B, H, K, V\] = \(2, 2, 16, 16\)"):
            fn(q, k, v, g, beta, initial_state=h0[:1])


def test_bad_cu_seqlens_are_rejected():
    (q, k, v, g, beta), _ = make_inputs(2, 8)
    for fn in (kda_recurrent, kda_chunk):
        with pytest.raises(ValueError, match="cu_seqlens requires a packed batch with B == 1, got B = 2"):
            fn(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 8]))
        one = [x[:1] for x in (q, k, v, g, beta)]
        with pytest.raises(ValueError, match=r"cu_seqlens must start at 0 and end at T = 8, got 0 \.\. 7"):
            fn(*one, cu_seqlens=torch.tensor([0, 3, 7]))
        with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
            fn(*one, cu_seqlens=torch.tensor([0, 5, 3, 8]))
        with pytest.raises(ValueError, match="cu_seqlens must be an integer tensor"):
            fn(*one, cu_seqlens=torch.tensor([0.0, 8.0]))
        with pytest.raises(ValueError, match=r"cu_seqlens must be a 1-D tensor"):
            fn(*one, cu_seqlens=torch.tensor([8]))
        with pytest.raises(ValueError, match=r"initial_state must be \[N \(number of sequences\), H, K, V\]"):
            fn(*one, cu_seqlens=torch.tensor([0, 3, 8]), initial_state=torch.zeros(1, H, K, V))


def test_bad_chunk_size():
    (q, k, v, g, beta), _ = make_inputs(1, 8)
    for bad in (0, -4, 2.5, True):
        with pytest.raises(ValueError, match="chunk_size must be a positive int"):
            kda_chunk(q, k, v, g, beta, chunk_size=bad)
