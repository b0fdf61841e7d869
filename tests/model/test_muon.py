"""Per-Head Muon: Newton–Schulz, per-head independence, the AdamW-matched scale, the AdamW fallback,
convergence on least squares, exact resume through state_dict, and group validation."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from k3.model.muon import PerHeadMuon, merge_heads, newton_schulz, split_heads


@pytest.fixture(autouse=True)
def _one_thread():
    # These matrices are tiny: one thread is fastest, and it avoids oversubscribing shared CI cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rms(x: torch.Tensor) -> float:
    return float(x.detach().float().pow(2).mean().sqrt())


# ------------------------------------------------------------------------------------------ Newton–Schulz


@pytest.mark.parametrize("shape", [(64, 32), (32, 96), (6, 16, 40), (40, 16)], ids=str)
def test_newton_schulz_singular_values_in_the_quintic_band(shape):
    # Rectangular Gaussian matrices are well conditioned, so five steps bring every singular value into
    # the band the quintic oscillates in (its value at 1 is 0.701, its peak 1.156).
    g = torch.randn(*shape, generator=_gen(0)) * 37.0  # the scale is normalised away
    out = newton_schulz(g)
    assert out.shape == g.shape and out.dtype == torch.float32
    sv = torch.linalg.svdvals(out)
    assert float(sv.min()) >= 0.67 and float(sv.max()) <= 1.2
    assert float(sv.min()) < 0.75 and float(sv.max()) > 0.95  # it is a band, not an exact projection
    # Same singular vectors as the input: O ≈ U f(S) Vᵀ, so Oᵀ G (or G Oᵀ) is symmetric positive definite.
    gram = out.mT @ g if shape[-2] >= shape[-1] else g @ out.mT
    torch.testing.assert_close(gram, gram.mT, rtol=1e-3, atol=1e-3 * float(gram.abs().max()))


def test_newton_schulz_rejects_vectors_and_runs_in_bf16():
    with pytest.raises(ValueError, match=r"needs matrices \[..., A, B\]"):
        newton_schulz(torch.ones(4))
    g = torch.randn(32, 64, generator=_gen(1))
    low = newton_schulz(g, dtype=torch.bfloat16)
    assert low.dtype == torch.bfloat16
    assert _rms(low.float() - newton_schulz(g)) < 0.05


def test_split_and_merge_heads_are_inverse_and_pick_contiguous_blocks():
    w = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6)
    rows = split_heads(w, 2, 0)
    assert rows.shape == (2, 2, 6) and torch.equal(rows[1], w[2:4])
    cols = split_heads(w, 3, 1)
    assert cols.shape == (3, 4, 2) and torch.equal(cols[2], w[:, 4:6])
    assert torch.equal(merge_heads(rows, 0), w) and torch.equal(merge_heads(cols, 1), w)


# ------------------------------------------------------------------------------------- per-head blocks


def _one_step_update(group: dict, grad: torch.Tensor, lr: float = 1.0) -> torch.Tensor:
    p = torch.nn.Parameter(torch.zeros_like(grad))
    opt = PerHeadMuon([{"params": [p], **group}], lr=lr, weight_decay=0.0)
    p.grad = grad.clone()
    opt.step()
    return p.detach().clone()


@pytest.mark.parametrize("head_axis", [0, 1])
def test_each_head_is_orthogonalised_on_its_own(head_axis):
    # Tall per-head layout (heads · head_dim > width), as in q/k/v projections: the whole matrix's column
    # space is shared by all heads, so whole-matrix Muon lets the loud head take it.
    heads, head_dim, width = 4, 16, 8
    shape = (heads * head_dim, width) if head_axis == 0 else (width, heads * head_dim)
    grad = torch.randn(*shape, generator=_gen(2))
    blocks = split_heads(grad, heads, head_axis).clone()
    blocks[0] *= 100.0  # one head with a 100× gradient
    grad = merge_heads(blocks, head_axis)

    per_head = _one_step_update({"kind": "muon_per_head", "num_heads": heads, "head_axis": head_axis}, grad)
    whole = _one_step_update({"kind": "muon"}, grad)
    ph_rms = [_rms(b) for b in split_heads(per_head, heads, head_axis)]
    wm_rms = [_rms(b) for b in split_heads(whole, heads, head_axis)]
    print(f"\nhead_axis={head_axis}: per-head block RMS {ph_rms}, whole-matrix block RMS {wm_rms}")

    # Per head: the loud head gets the same step size as the others.
    assert max(ph_rms) / min(ph_rms) < 1.2
    # Whole matrix: the loud head takes the spectrum and the others barely move.
    assert max(wm_rms[1:]) < 0.05 * wm_rms[0]

    # Each block is exactly what orthogonalising that block alone gives (scaled by 0.2·√max(block)).
    scale = 0.2 * math.sqrt(max(head_dim, width))
    # Nesterov on the first step: g + μ(μ·0 + g) = 1.95 g, a scale Newton–Schulz normalises away.
    for h in range(heads):
        alone = -scale * newton_schulz(1.95 * split_heads(grad, heads, head_axis)[h])
        torch.testing.assert_close(split_heads(per_head, heads, head_axis)[h], alone, rtol=1e-4, atol=1e-6)

    # Changing one head's gradient leaves the other heads' updates untouched.
    other = split_heads(grad, heads, head_axis).clone()
    other[1] = torch.randn(other[1].shape, generator=_gen(3))
    changed = _one_step_update(
        {"kind": "muon_per_head", "num_heads": heads, "head_axis": head_axis}, merge_heads(other, head_axis)
    )
    before, after = split_heads(per_head, heads, head_axis), split_heads(changed, heads, head_axis)
    for h in (0, 2, 3):
        torch.testing.assert_close(after[h], before[h], rtol=1e-5, atol=1e-7)
    assert not torch.allclose(after[1], before[1])


def test_batched_muon_treats_each_expert_matrix_separately():
    grad = torch.randn(3, 16, 24, generator=_gen(4))
    grad[0] *= 1000.0
    update = _one_step_update({"kind": "muon", "batched": True}, grad)
    scale = 0.2 * math.sqrt(24)
    for e in range(3):
        torch.testing.assert_close(update[e], -scale * newton_schulz(grad[e]), rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------------------------ scale


@pytest.mark.parametrize(
    "group",
    [
        {"kind": "muon"},
        {"kind": "muon_per_head", "num_heads": 4, "head_axis": 0},
        {"kind": "muon_per_head", "num_heads": 8, "head_axis": 1},
    ],
    ids=["muon", "per-head-rows", "per-head-cols"],
)
@pytest.mark.parametrize("shape", [(64, 32), (32, 128)], ids=str)
def test_update_rms_is_about_point_two_lr(group, shape):
    lr = 0.01
    grad = torch.randn(*shape, generator=_gen(5))
    update = _one_step_update(group, grad, lr=lr)
    assert 0.15 <= _rms(update) / lr <= 0.22


def test_steady_state_update_rms_matches_adamw():
    # With noise gradients AdamW(β=(0.9, 0.95)) settles at an update RMS of about 0.23·lr; the 0.2·√max
    # scale puts Muon next to it, so both kinds can share one learning rate.
    lr, shape = 1e-3, (32, 64)
    pa = torch.nn.Parameter(torch.zeros(shape))
    pm = torch.nn.Parameter(torch.zeros(shape))
    adamw = torch.optim.AdamW([pa], lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    muon = PerHeadMuon([{"params": [pm], "kind": "muon"}], lr=lr, weight_decay=0.0)
    gen = _gen(6)
    a_rms, m_rms = [], []
    for _ in range(60):
        grad = torch.randn(shape, generator=gen)
        a0, m0 = pa.detach().clone(), pm.detach().clone()
        pa.grad, pm.grad = grad.clone(), grad.clone()
        adamw.step()
        muon.step()
        a_rms.append(_rms(pa - a0) / lr)
        m_rms.append(_rms(pm - m0) / lr)
    a_mean, m_mean = sum(a_rms[30:]) / 30, sum(m_rms[30:]) / 30
    print(f"\nsteady-state update RMS / lr: AdamW {a_mean:.3f}, Muon {m_mean:.3f}")
    assert 0.15 <= a_mean <= 0.3 and 0.15 <= m_mean <= 0.22
    assert 0.6 <= m_mean / a_mean <= 1.4


# ---------------------------------------------------------------------------------------- AdamW fallback


def test_adamw_groups_follow_torch_adamw():
    gen = _gen(7)
    init = [torch.randn(5, 7, generator=gen), torch.randn(7, generator=gen)]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    opt = PerHeadMuon(
        [{"params": ours, "kind": "adamw"}], lr=0.5, adamw_lr=1e-2, weight_decay=0.1, adamw_betas=(0.8, 0.9),
        adamw_eps=1e-6,
    )
    assert opt.param_groups[0]["lr"] == 1e-2
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    for _ in range(12):
        for a, b in zip(ours, ref, strict=True):
            grad = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = grad.clone(), grad.clone()
        opt.step()
        ref_opt.step()
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert not torch.equal(ours[0], init[0])


def test_weight_decay_is_decoupled_and_skips_params_without_grad():
    w = torch.nn.Parameter(torch.full((4, 4), 2.0))
    idle = torch.nn.Parameter(torch.ones(4, 4))
    opt = PerHeadMuon([{"params": [w, idle], "kind": "muon"}], lr=0.1, weight_decay=0.5)
    w.grad = torch.zeros(4, 4)  # a zero gradient orthogonalises to zero: only the decay acts
    opt.step()
    torch.testing.assert_close(w.detach(), torch.full((4, 4), 2.0 * (1 - 0.1 * 0.5)))
    assert torch.equal(idle.detach(), torch.ones(4, 4)) and idle not in opt.state


# ------------------------------------------------------------------------------------------ convergence


def test_least_squares_loss_decreases():
    gen = _gen(8)
    x = torch.randn(256, 32, generator=gen)
    w_true, b_true = torch.randn(16, 32, generator=gen), torch.randn(16, generator=gen)
    o_true, e_true = torch.randn(32, 16, generator=gen), torch.randn(2, 32, 8, generator=gen)
    y, z, u = x @ w_true.T + b_true, x @ o_true, x @ e_true  # u: [2, 256, 8]
    w = torch.nn.Parameter(torch.zeros(16, 32))  # 4 "heads" of 4 output rows
    o = torch.nn.Parameter(torch.zeros(32, 16))  # 4 heads on the columns
    e = torch.nn.Parameter(torch.zeros(2, 32, 8))  # two expert matrices
    b = torch.nn.Parameter(torch.zeros(16))
    opt = PerHeadMuon(
        [
            {"params": [w], "kind": "muon_per_head", "num_heads": 4, "head_axis": 0},
            {"params": [o], "kind": "muon_per_head", "num_heads": 4, "head_axis": 1},
            {"params": [e], "kind": "muon", "batched": True},
            {"params": [b], "kind": "adamw"},
        ],
        lr=0.1,
        weight_decay=0.0,
    )

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (x @ w.T + b - y).pow(2).mean() + (x @ o - z).pow(2).mean() + (x @ e - u).pow(2).mean()
        loss.backward()
        return loss

    losses = [opt.step(closure).item() for _ in range(100)]
    print(f"\nleast squares: loss {losses[0]:.3f} -> {losses[-1]:.4f}")
    assert losses[-1] < 0.03 * losses[0]
    assert all(float(p.detach().abs().max()) > 0 for p in (w, o, e, b))


# ------------------------------------------------------------------------------------------- checkpoints


def _resume_model(seed: int) -> list[torch.nn.Parameter]:
    gen = _gen(seed)
    return [
        torch.nn.Parameter(torch.randn(16, 12, generator=gen)),  # per-head, fp32
        torch.nn.Parameter(torch.randn(12, 16, generator=gen).bfloat16()),  # per-head, bf16 (state fp32)
        torch.nn.Parameter(torch.randn(3, 8, 6, generator=gen)),  # batched muon
        torch.nn.Parameter(torch.randn(10, generator=gen).bfloat16()),  # adamw, bf16
    ]


def _resume_optimizer(params: list[torch.nn.Parameter]) -> PerHeadMuon:
    return PerHeadMuon(
        [
            {"params": [params[0]], "kind": "muon_per_head", "num_heads": 4, "head_axis": 0},
            {"params": [params[1]], "kind": "muon_per_head", "num_heads": 2, "head_axis": 1, "name": "o"},
            {"params": [params[2]], "kind": "muon", "batched": True},
            {"params": [params[3]], "kind": "adamw", "weight_decay": 0.0},
        ],
        lr=0.01,
    )


def _grads(step: int, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    gen = _gen(1000 + step)
    return [torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]


def test_state_dict_round_trip_gives_identical_next_steps():
    params = _resume_model(9)
    opt = _resume_optimizer(params)
    for step in range(3):
        for p, g in zip(params, _grads(step, params), strict=True):
            p.grad = g
        opt.step()
    saved_state = copy.deepcopy(opt.state_dict())
    saved_params = [p.detach().clone() for p in params]

    for step in range(3, 6):
        for p, g in zip(params, _grads(step, params), strict=True):
            p.grad = g
        opt.step()

    resumed = [torch.nn.Parameter(t.clone()) for t in saved_params]
    resumed_opt = _resume_optimizer(resumed)
    resumed_opt.load_state_dict(saved_state)
    assert resumed_opt.state[resumed[1]]["momentum_buffer"].dtype == torch.float32
    assert resumed_opt.state[resumed[3]]["exp_avg"].dtype == torch.float32
    assert int(resumed_opt.state[resumed[3]]["step"]) == 3
    for step in range(3, 6):
        for p, g in zip(resumed, _grads(step, resumed), strict=True):
            p.grad = g
        resumed_opt.step()
    for a, b in zip(params, resumed, strict=True):
        assert torch.equal(a, b)
    # The loaded state is a copy: stepping did not write into the saved dict.
    assert int(saved_state["state"][3]["step"]) == 3


def test_load_state_dict_rejects_a_different_layout():
    params = _resume_model(10)
    opt = _resume_optimizer(params)
    state = copy.deepcopy(opt.state_dict())
    state["param_groups"][0]["num_heads"] = 2
    with pytest.raises(ValueError, match="param group 0: state_dict has num_heads=2"):
        _resume_optimizer(_resume_model(10)).load_state_dict(state)
    state["param_groups"] = state["param_groups"][:3]
    with pytest.raises(ValueError, match="state_dict has 3 param groups, this optimizer 4"):
        _resume_optimizer(_resume_model(10)).load_state_dict(state)


# ------------------------------------------------------------------------------------------- validation


def _p(*shape: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(*shape))


@pytest.mark.parametrize(
    ("groups", "kwargs", "error", "match"),
    [
        ([{"params": [_p(4, 4)]}], {}, ValueError, "param group 0 has no 'kind'"),
        ([{"params": [_p(4, 4)], "kind": "sgd", "name": "attn"}], {}, ValueError, "'attn' has unknown kind 'sgd'"),
        (
            [{"params": [_p(4)], "kind": "adamw"}, {"params": [_p(3, 4, 5)], "kind": "muon"}],
            {},
            ValueError,
            r"param group 1: params\[0\] must be 2-D for a 'muon' group, got \(3, 4, 5\)",
        ),
        (
            [{"params": [_p(4, 4), _p(12)], "kind": "muon_per_head", "num_heads": 2, "head_axis": 0}],
            {},
            ValueError,
            r"params\[1\] must be 2-D for kind 'muon_per_head', got \(12,\)",
        ),
        (
            [{"params": [_p(12, 8)], "kind": "muon_per_head", "num_heads": 5, "head_axis": 0}],
            {},
            ValueError,
            r"shape \(12, 8\) has 12 along head_axis=0, not divisible by num_heads=5",
        ),
        (
            [{"params": [_p(12, 8)], "kind": "muon_per_head", "num_heads": 3, "head_axis": 1}],
            {},
            ValueError,
            "has 8 along head_axis=1, not divisible by num_heads=3",
        ),
        (
            [{"params": [_p(12, 8)], "kind": "muon_per_head", "num_heads": 2, "head_axis": 2}],
            {},
            ValueError,
            "head_axis must be 0 or 1, got 2",
        ),
        (
            [{"params": [_p(12, 8)], "kind": "muon_per_head", "head_axis": 0}],
            {},
            ValueError,
            "num_heads must be a positive int, got None",
        ),
        (
            [{"params": [_p(12, 8)], "kind": "muon", "batched": True}],
            {},
            ValueError,
            r"must be 3-D \[E, a, b\] for a batched 'muon' group, got \(12, 8\)",
        ),
        ([{"params": [_p(8)], "kind": "adamw", "num_heads": 2}], {}, ValueError, "'num_heads' only applies"),
        ([{"params": [_p(8, 8)], "kind": "muon_per_head", "num_heads": 2, "head_axis": 0, "batched": True}],
         {}, ValueError, "'batched' only applies to kind 'muon'"),
        ([{"params": [], "kind": "adamw"}], {}, ValueError, "param group 0 has no params"),
        ([{"params": [_p(8, 8)], "kind": "muon", "momentum": 1.0}], {}, ValueError, r"momentum must be in \[0, 1\)"),
        ([{"params": [_p(8, 8)], "kind": "muon"}], {"lr": -1.0}, ValueError, "defaults: lr must be a number >= 0"),
        ([{"params": [_p(8, 8)], "kind": "muon"}], {"ns_steps": 0}, ValueError, "ns_steps must be a positive int"),
        ([{"params": [_p(8, 8)], "kind": "muon"}], {"ns_dtype": torch.float16}, ValueError, "ns_dtype must be"),
        ([{"params": [_p(8, 8)], "kind": "adamw"}], {"adamw_betas": (0.9, 1.0)}, ValueError, "betas must be"),
        ([], {}, ValueError, "empty parameter list"),
        ([_p(8, 8)], {}, ValueError, "param group 0 has no 'kind'"),
        (
            [{"params": [_p(8)], "kind": "adamw"}, _p(8, 8)],
            {},
            TypeError,
            "each parameter group must be a dict",
        ),
        (_p(8, 8), {}, TypeError, "params must be an iterable of parameter-group dicts"),
        (
            [{"params": [torch.zeros(4, 4, dtype=torch.int64)], "kind": "adamw"}],
            {},
            ValueError,
            r"params\[0\] must be floating point",
        ),
    ],
)
def test_bad_groups_are_rejected(groups, kwargs, error, match):
    with pytest.raises(error, match=match):
        PerHeadMuon(groups, **kwargs)


def test_sparse_gradients_are_refused():
    p = _p(4, 4)
    opt = PerHeadMuon([{"params": [p], "kind": "adamw"}])
    p.grad = torch.zeros(4, 4).to_sparse()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        opt.step()
