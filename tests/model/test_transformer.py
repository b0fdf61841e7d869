"""K3Model: incremental decoding equals the full forward, packing, causality, loss helpers, optimizer groups."""

from __future__ import annotations

import math

import pytest
import torch

from k3.model.mla import GatedMLA
from k3.model.presets import get_preset
from k3.model.transformer import IGNORE_INDEX, K3Model, lm_loss, next_token_labels


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = K3Model(get_preset("tiny")).eval()
    with torch.no_grad():  # non-zero AttnRes queries so the mixing is exercised, not just averaged
        for name, param in m.named_parameters():
            if name.endswith(".query"):
                param.normal_(std=0.5)
    return m


@pytest.mark.timeout(300)
def test_prefill_then_decode_equals_full_forward(model):
    torch.manual_seed(1)
    ids = torch.randint(0, 512, (1, 24))
    with torch.no_grad():
        full = model(ids)[0]
    logits, state = model.prefill(ids[0, :10])
    steps = [logits]
    for t in range(10, 24):
        step, (state,) = model.decode(ids[0, t:t + 1], [state])
        steps.append(step)
    assert (torch.cat(steps) - full).abs().max().item() <= 1e-4
    assert state.num_tokens == 24


def test_packed_sequences_do_not_leak(model):
    torch.manual_seed(2)
    a, b, c = (torch.randint(0, 512, (1, n)) for n in (5, 12, 3))
    with torch.no_grad():
        packed = model(torch.cat([a, b, c], dim=1), cu_seqlens=torch.tensor([0, 5, 17, 20], dtype=torch.int32))
        separate = torch.cat([model(a), model(b), model(c)], dim=1)
        unpacked = model(torch.cat([a, b, c], dim=1))  # what leaking across the boundaries would look like
    # fp32 noise only (KDA's per-head output norm amplifies rounding of small early-token outputs), far below
    # the effect of attending across a boundary
    assert (packed - separate).abs().max().item() <= 1e-3
    assert (unpacked[:, 5:] - separate[:, 5:]).abs().max().item() > 1e-2


def test_causal(model):
    torch.manual_seed(3)
    ids = torch.randint(0, 512, (2, 12))
    changed = ids.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % 512
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert (a[:, :8] - b[:, :8]).abs().max().item() <= 1e-5
    assert (a[:, 8:] - b[:, 8:]).abs().max().item() > 1e-3


def test_structure_follows_the_config(model):
    cfg = model.cfg
    kinds = [layer.kind for layer in model.layers]
    assert kinds == [cfg.layer_kind(i) for i in range(cfg.num_layers)]
    assert all(isinstance(layer.attn, GatedMLA) == (layer.kind == "mla") for layer in model.layers)
    assert [layer.starts_block for layer in model.layers] == [i % 3 == 0 for i in range(8)]
    assert [layer.is_moe for layer in model.layers] == [False] + [True] * 7


def test_loss_helpers():
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    assert next_token_labels(ids).tolist() == [[2, 3, 4, 5, 6, IGNORE_INDEX]]
    packed = next_token_labels(ids, torch.tensor([0, 2, 6]))
    assert packed.tolist() == [[2, IGNORE_INDEX, 4, 5, 6, IGNORE_INDEX]]
    logits = torch.zeros(1, 6, 10)
    assert math.isclose(lm_loss(logits, packed).item(), math.log(10), rel_tol=1e-6)
    with pytest.raises(ValueError, match=r"labels shape \(1, 5\) does not match logits \(1, 6\)"):
        lm_loss(logits, packed[:, :5])


def test_loss_backward_reaches_every_trained_parameter():
    torch.manual_seed(4)
    model = K3Model(get_preset("tiny"))
    ids = torch.randint(0, 512, (1, 16))
    loss = model.loss(ids, cu_seqlens=torch.tensor([0, 9, 16]))
    assert abs(loss.item() - math.log(512)) < 1.0  # near-uniform predictions at initialisation
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    # (routed experts that received no token get a zero, not a missing, gradient)
    assert missing == []
    assert model.layers[0].attn_res is None  # layer 0's first read sees only the embedding


def test_forward_rejects_bad_inputs(model):
    with pytest.raises(ValueError, match=r"input_ids must be \[B, T\], got shape \(5,\)"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="packed sequences \\(cu_seqlens\\) need batch size 1, got 2"):
        model(torch.zeros(2, 5, dtype=torch.long), cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="cu_seqlens must start at 0 and end at the packed length 5"):
        model(torch.zeros(1, 5, dtype=torch.long), cu_seqlens=torch.tensor([0, 4]))


def test_tied_embeddings_share_the_matrix():
    cfg = get_preset("tiny")
    cfg.tie_embeddings = True
    model = K3Model(cfg)
    assert model.lm_head.weight is model.embed.weight
    groups = model.optimizer_groups()
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))


def test_optimizer_groups(model):
    groups = model.optimizer_groups()
    ids = [id(p) for g in groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())  # every parameter exactly once
    by_kind: dict[str, list[dict]] = {}
    for g in groups:
        by_kind.setdefault(g["kind"], []).append(g)
    assert set(by_kind) == {"muon_per_head", "muon", "adamw"}
    cfg = model.cfg
    per_head = {(g["num_heads"], g["head_axis"]): {id(p) for p in g["params"]} for g in by_kind["muon_per_head"]}
    for g in by_kind["muon_per_head"]:
        for p in g["params"]:
            assert p.dim() == 2 and p.shape[g["head_axis"]] % g["num_heads"] == 0
    for layer in model.layers:
        a = layer.attn
        if layer.kind == "mla":
            assert {id(a.wq_b.weight), id(a.wkv_b.weight)} <= per_head[(cfg.mla_heads, 0)]
            assert id(a.wo.weight) in per_head[(cfg.mla_heads, 1)]
        else:
            assert {id(a.w_q.weight), id(a.w_k.weight), id(a.w_v.weight)} <= per_head[(cfg.kda_heads, 0)]
            assert id(a.w_o.weight) in per_head[(cfg.kda_heads, 1)]
    batched = [g for g in by_kind["muon"] if g.get("batched")]
    plain = [g for g in by_kind["muon"] if not g.get("batched")]
    assert len(batched) == 1 and all(p.dim() == 3 for p in batched[0]["params"])
    assert len(batched[0]["params"]) == 2 * 7  # w_in and w_out of 7 MoE layers
    assert all(p.dim() == 2 for g in plain for p in g["params"])
    adamw = {id(p) for p in by_kind["adamw"][0]["params"]}
    assert id(model.embed.weight) in adamw and id(model.lm_head.weight) in adamw
    assert all(id(p) in adamw for n, p in model.named_parameters() if p.dim() != 2 and not n.endswith(("w_in", "w_out")))
