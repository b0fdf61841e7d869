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


def _pools(model: K3Model, num_slots: int, num_pages: int, page_size: int):
    """The serving engine's state pool and latent pages for ``model``, every row poisoned with random values."""
    from k3.services.engine.pages import PagedLatentCache
    from k3.services.engine.slots import SlotPool

    slots, pages = SlotPool(model.cfg, num_slots), PagedLatentCache(model.cfg, num_pages, page_size)
    for t in [*pages.kv.values(), *(s.recurrent for s in slots.states.values())]:
        t.normal_()
    return slots, pages


@pytest.mark.timeout(300)
def test_decode_paged_equals_decode_and_advances_the_pools_in_place(model):
    """Three sequences of different lengths in scattered slots and pages: several in-place steps give the logits
    of ``decode`` on ``SequenceState``s, and the pools then hold exactly the states ``decode`` returned."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    page_size, lengths, slots, tables = 4, [3, 9, 6], [4, 0, 2], [[7, 2, 11, 5, 0], [3, 9, 1, 8, 12], [6, 10, 13, 14, 4]]
    slot_pool, page_pool = _pools(model, num_slots=5, num_pages=15, page_size=page_size)
    kda, pages = slot_pool.states, page_pool.kv
    states = []
    for b, n in enumerate(lengths):
        _, state = model.prefill(torch.randint(0, 512, (n,), generator=gen))
        slot_pool.write(slots[b], state.kda)
        page_pool.write(tables[b], 0, state.mla)
        states.append(state)
    slot_t = torch.tensor(slots)
    for step in range(6):  # crosses page boundaries for every sequence
        ids = torch.randint(0, 512, (3,), generator=gen)
        seq_lens = torch.tensor([s.num_tokens for s in states], dtype=torch.int32)
        table = page_pool.block_table(tables, int(seq_lens.max()) + 1)
        want, states = model.decode(ids, states)
        got = model.decode_paged(ids, slot_t, table, seq_lens, kda, pages)
        assert torch.isfinite(got).all()
        assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item(), f"step {step}"

    def close(a, b):  # fp32 noise of a different summation order, relative to the tensor's scale
        return (a - b).abs().max().item() <= 1e-4 * b.abs().max().item()

    for b, state in enumerate(states):
        for i, s in state.kda.items():
            assert close(kda[i].recurrent[slots[b]], s.recurrent[0]) and close(kda[i].conv_v[slots[b]], s.conv_v[0])
        for i, cache in page_pool.gather(tables[b], state.num_tokens).items():
            assert close(cache.c_kv, state.mla[i].c_kv) and close(cache.k_extra, state.mla[i].k_extra)


def test_decode_paged_rejects_bad_indices(model):
    slot_pool, page_pool = _pools(model, num_slots=2, num_pages=4, page_size=4)
    kda, pages = slot_pool.states, page_pool.kv
    ids, slots, lens = torch.tensor([1, 2]), torch.tensor([0, 1]), torch.tensor([3, 5], dtype=torch.int32)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    model.decode_paged(ids, slots, table, lens, kda, pages)  # the valid call the bad ones below differ from
    cases = [
        (dict(slots=torch.tensor([1, 1])), "distinct"),
        (dict(slots=torch.tensor([0, 2])), "distinct"),
        (dict(token_ids=torch.tensor([1, 512])), "token_ids must lie"),
        (dict(seq_lens=torch.tensor([3, 8], dtype=torch.int32)), "cannot hold"),
        (dict(seq_lens=torch.tensor([-1, 0], dtype=torch.int32)), "seq_lens must lie"),
        (dict(block_table=torch.tensor([[0, 1], [2, 4]], dtype=torch.int32)), "num_pages"),
        (dict(block_table=table.long()), "int32"),
        (dict(slots=torch.tensor([0])), r"slots must be .*\[B=2\]"),
        (dict(kv_pages={}), r"kv_pages layers \[3, 7\], got .* and \[\]"),
        (dict(kv_pages={i: p[..., :-1] for i, p in pages.items()}), "R \\+ e"),
    ]
    args = dict(token_ids=ids, slots=slots, block_table=table, seq_lens=lens, kda_pools=kda, kv_pages=pages)
    for change, message in cases:
        before = {i: p.clone() for i, p in pages.items()}
        with pytest.raises(ValueError, match=message):
            model.decode_paged(**{**args, **change})
        assert all(torch.equal(before[i], p) for i, p in pages.items()), "a rejected call must not write"
