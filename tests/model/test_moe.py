"""LatentMoE: sigmoid routing with renormalised top-k weights, bias for selection only, the expert loop
against a per-token reference, router statistics."""

from __future__ import annotations

import pytest
import torch

from k3.model.moe import LatentMoE
from k3.model.presets import get_preset
from k3.model.situ import situ_glu


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture()
def moe():
    torch.manual_seed(0)
    return LatentMoE(get_preset("tiny"), layer_idx=1)


def test_stacked_expert_weights(moe):
    assert moe.w_in.shape == (8, 2 * 96, 64) and moe.w_out.shape == (8, 64, 96)
    assert moe.expert_bias.shape == (8,) and "expert_bias" in moe.state_dict()
    assert "tokens_per_expert" not in moe.state_dict()


def test_weights_are_renormalised_unbiased_scores(moe):
    x = torch.randn(20, 128)
    weights, ids, scores = moe.route(x)
    torch.testing.assert_close(scores, torch.sigmoid(x @ moe.router.weight.t()))
    torch.testing.assert_close(weights.sum(-1), torch.ones(20))
    selected = scores.gather(-1, ids)
    torch.testing.assert_close(weights, selected / selected.sum(-1, keepdim=True))
    assert torch.equal(ids.sort(-1).values, torch.topk(scores, 2, dim=-1).indices.sort(-1).values)


def test_bias_changes_selection_only(moe):
    x = torch.randn(20, 128)
    _, ids_before, scores_before = moe.route(x)
    moe.expert_bias[5] = 10.0  # force expert 5 into every token's top-k
    weights, ids, scores = moe.route(x)
    assert torch.equal(scores, scores_before)
    assert (ids == 5).any(-1).all() and not (ids_before == 5).any(-1).all()
    selected = scores.gather(-1, ids)  # the weights still come from the unbiased scores
    torch.testing.assert_close(weights, selected / selected.sum(-1, keepdim=True))
    moe.expert_bias.fill_(3.0)  # a uniform shift changes nothing
    assert torch.equal(moe.route(x)[1], ids_before)


def _reference(moe, x):
    """Per-token, per-selected-expert evaluation of the LatentMoE equations."""
    weights, ids, _ = moe.route(x)
    out = []
    for t in range(x.shape[0]):
        z = moe.w_down(x[t])
        u = torch.zeros(z.shape[-1])
        for j in range(moe.top_k):
            e = int(ids[t, j])
            gate, linear = (moe.w_in[e] @ z).split(moe.inter)
            u = u + weights[t, j] * (moe.w_out[e] @ situ_glu(gate, linear, 4.0, 25.0))
        y = moe.routed_scaling * moe.w_up(moe.latent_norm(u))
        for shared in moe.shared_experts:
            y = y + shared(x[t])
        out.append(y)
    return torch.stack(out)


def test_forward_matches_per_token_reference(moe):
    x = torch.randn(2, 7, 128)
    with torch.no_grad():
        y = moe(x)
        ref = _reference(moe, x.reshape(-1, 128)).reshape(2, 7, 128)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)


def test_routed_scaling_scales_the_routed_branch_only(moe):
    x = torch.randn(5, 128)
    with torch.no_grad():
        shared = sum(expert(x) for expert in moe.shared_experts)
        base = moe(x) - shared
        moe.routed_scaling = 2.5
        scaled = moe(x) - shared
    torch.testing.assert_close(scaled, 2.5 * base, atol=1e-5, rtol=1e-5)


def test_router_statistics(moe):
    x1, x2 = torch.randn(9, 128), torch.randn(4, 128)
    _, ids1, _ = moe.route(x1)
    _, ids2, scores2 = moe.route(x2)
    with torch.no_grad():
        moe(x1)
        assert moe.last_router_scores is None  # not recorded unless asked
        moe.record_scores = True
        moe(x2)
    expected = torch.bincount(torch.cat([ids1, ids2]).flatten(), minlength=8)
    assert torch.equal(moe.tokens_per_expert, expected) and int(expected.sum()) == 13 * 2
    torch.testing.assert_close(moe.last_router_scores, scores2)
    moe.reset_router_stats()
    assert int(moe.tokens_per_expert.sum()) == 0 and moe.last_router_scores is None


def test_gradients_reach_only_experts_that_received_tokens(moe):
    moe.expert_bias.copy_(torch.tensor([9.0, 9.0, 0, 0, 0, 0, 0, 0]))  # every token picks experts 0 and 1
    moe(torch.randn(6, 128)).pow(2).sum().backward()
    used = moe.w_in.grad.flatten(1).abs().sum(-1) > 0
    assert used.tolist() == [True, True] + [False] * 6
    assert moe.router.weight.grad.abs().sum() > 0  # weights (not the bias) carry the router gradient
