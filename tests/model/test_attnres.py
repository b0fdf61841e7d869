"""AttnRes: the aggregation formula, zero-initialised queries, and the block schedule of a layer."""

from __future__ import annotations

import pytest
import torch

from k3.model.attnres import AttnResMixer, aggregate
from k3.model.presets import get_preset
from k3.model.transformer import K3Layer


def test_zero_query_is_a_uniform_average():
    torch.manual_seed(0)
    bank = [torch.randn(2, 5, 16) for _ in range(3)]
    p = torch.randn(2, 5, 16)
    mixer = AttnResMixer(16)
    assert torch.count_nonzero(mixer.query) == 0
    torch.testing.assert_close(mixer(p, bank), (bank[0] + bank[1] + bank[2] + p) / 4)


def test_empty_bank_returns_p():
    p = torch.randn(3, 16)
    assert torch.equal(AttnResMixer(16)(p, []), p)


def test_matches_the_formula_with_learned_query():
    torch.manual_seed(1)
    rows = [torch.randn(4, 8) * s for s in (0.5, 2.0, 1.0)]
    w, g = torch.randn(8), torch.rand(8) + 0.5
    out = aggregate(rows[2], rows[:2], w, g, eps=1e-5)
    for t in range(4):
        scores = torch.stack([(r[t] / r[t].pow(2).mean().add(1e-5).sqrt() * g * w).sum() for r in rows])
        mix = sum(a * r[t] for a, r in zip(torch.softmax(scores, 0), rows, strict=True))
        torch.testing.assert_close(out[t], mix)


def test_scores_ignore_row_scale():
    # RMSNorm on the keys: scaling a row changes what is mixed but not how much weight it gets.
    torch.manual_seed(2)
    bank, p = [torch.randn(6, 8)], torch.randn(6, 8)
    w, g = torch.randn(8), torch.ones(8)
    base = aggregate(p, bank, w, g)
    scaled = aggregate(p, [bank[0] * 3.0], w, g)

    def bank_weight(mixed, row):  # mixed = a * row + (1 - a) * p, solved for a per token
        return ((mixed - p) * (row - p)).sum(-1) / (row - p).pow(2).sum(-1)

    weight_bank, weight_scaled = bank_weight(base, bank[0]), bank_weight(scaled, 3.0 * bank[0])
    torch.testing.assert_close(weight_bank, weight_scaled, atol=1e-4, rtol=1e-4)


def test_query_receives_gradient_once_the_bank_is_non_empty():
    mixer = AttnResMixer(8)
    bank, p = [torch.randn(3, 8)], torch.randn(3, 8)
    (mixer(p, bank) ** 2).sum().backward()
    assert mixer.query.grad is not None and mixer.query.grad.abs().sum() > 0


@pytest.mark.parametrize("layer_idx", [3, 4])
def test_layer_block_schedule(layer_idx):
    """Layer 3 of tiny (block size 3) closes a block: bank gains p and p restarts from the mixer output;
    layer 4 just accumulates. The FFN then reads aggregate(p, bank) and adds to p."""
    torch.manual_seed(3)
    cfg = get_preset("tiny")
    layer = K3Layer(cfg, layer_idx)
    with torch.no_grad():
        layer.attn_res.query.normal_()
        layer.ffn_res.query.normal_()
    emb, p = torch.randn(1, 4, 128), torch.randn(1, 4, 128)
    attn_out = torch.randn(1, 4, 128)
    seen = {}

    def mix(lay, h):
        seen["h"] = h
        return attn_out

    with torch.no_grad():
        new_p, new_bank = layer(p, [emb], mix)
        torch.testing.assert_close(seen["h"], layer.attn_norm(layer.attn_res(p, [emb])))
        if layer_idx % cfg.attnres_block_size == 0:
            assert layer.starts_block and len(new_bank) == 2 and new_bank[1] is p
            mid = attn_out
        else:
            assert not layer.starts_block and len(new_bank) == 1
            mid = p + attn_out
        expected = mid + layer.ffn(layer.ffn_norm(layer.ffn_res(mid, new_bank)))
    torch.testing.assert_close(new_p, expected)
