"""Gated NoPE MLA: masks, packed sequences, the latent cache, and absorbed decode == expanded attention."""

from __future__ import annotations

import pytest
import torch

from k3.model.mla import GatedMLA, MLACache, causal_mask, check_cu_seqlens, packed_causal_mask
from k3.model.presets import get_preset


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # The test machine is shared; one intra-op thread avoids oversubscription stalls on tiny tensors.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def layer():
    torch.manual_seed(0)
    cfg = get_preset("tiny")
    mla = GatedMLA(cfg, layer_idx=3).eval()
    with torch.no_grad():  # non-trivial norm gains so the cache contents are distinguishable from raw c_kv
        mla.kv_norm.weight.uniform_(0.5, 1.5)
        mla.q_norm.weight.uniform_(0.5, 1.5)
    return mla


def test_masks():
    assert causal_mask(2, 4).tolist() == [[True, True, True, False], [True, True, True, True]]
    m = packed_causal_mask(torch.tensor([0, 2, 5]), 5)
    assert m.tolist() == [
        [True, False, False, False, False],
        [True, True, False, False, False],
        [False, False, True, False, False],
        [False, False, True, True, False],
        [False, False, True, True, True],
    ]


@pytest.mark.parametrize(
    ("cu", "message"),
    [
        (torch.tensor([0, 3, 4]), r"must start at 0 and end at the packed length 5, got \[0, 3, 4\]"),
        (torch.tensor([1, 5]), r"must start at 0 and end at the packed length 5"),
        (torch.tensor([0, 3, 3, 5]), r"must be strictly increasing, got \[0, 3, 3, 5\]"),
        (torch.tensor([0.0, 5.0]), r"1-D integer tensor"),
        (torch.tensor([5]), r"at least two boundaries"),
    ],
)
def test_bad_cu_seqlens(cu, message):
    with pytest.raises(ValueError, match=message):
        check_cu_seqlens(cu, 5)


def test_packed_sequences_do_not_leak(layer):
    torch.manual_seed(1)
    a, b = torch.randn(1, 5, 128), torch.randn(1, 9, 128)
    with torch.no_grad():
        packed = layer(torch.cat([a, b], dim=1), cu_seqlens=torch.tensor([0, 5, 14]))
        separate = torch.cat([layer(a), layer(b)], dim=1)
    torch.testing.assert_close(packed, separate, atol=1e-5, rtol=1e-5)


def test_causal(layer):
    torch.manual_seed(2)
    x = torch.randn(2, 8, 128)
    y = x.clone()
    y[:, 5:] += 1.0
    with torch.no_grad():
        out_x, out_y = layer(x), layer(y)
    assert torch.equal(out_x[:, :5], out_y[:, :5])
    assert not torch.allclose(out_x[:, 5:], out_y[:, 5:])


def test_cache_holds_normalised_latent_and_extra_key(layer):
    torch.manual_seed(3)
    x = torch.randn(6, 128)
    with torch.no_grad():
        _, cache = layer.prefill(x, None)
        c_kv, k_extra = layer.wkv_a(x).split([32, 16], dim=-1)
        expected_c = c_kv * torch.rsqrt(c_kv.pow(2).mean(-1, keepdim=True) + 1e-5) * layer.kv_norm.weight
    assert cache.c_kv.shape == (6, 32) and cache.k_extra.shape == (6, 16) and len(cache) == 6
    torch.testing.assert_close(cache.c_kv, expected_c)
    torch.testing.assert_close(cache.k_extra, k_extra)


def test_prefill_in_pieces_equals_forward(layer):
    torch.manual_seed(4)
    x = torch.randn(1, 11, 128)
    with torch.no_grad():
        full = layer(x)[0]
        first, cache = layer.prefill(x[0, :4], None)
        second, cache = layer.prefill(x[0, 4:], cache)
    torch.testing.assert_close(torch.cat([first, second]), full, atol=1e-5, rtol=1e-5)
    assert len(cache) == 11


def test_absorbed_decode_equals_naive_for_a_ragged_batch(layer):
    torch.manual_seed(5)
    lengths = [1, 6, 3]
    histories = [torch.randn(n, 128) for n in lengths]
    new = torch.randn(3, 128)
    with torch.no_grad():
        caches = [layer.prefill(h, None)[1] for h in histories]
        absorbed, grown = layer.decode(new, caches, absorb=True)
        naive, _ = layer.decode(new, caches, absorb=False)
        # the same token appended to each history, through the training path
        reference = torch.stack([layer(torch.cat([h, new[i:i + 1]])[None])[0, -1] for i, h in enumerate(histories)])
    torch.testing.assert_close(absorbed, naive, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(absorbed, reference, atol=1e-5, rtol=1e-5)
    assert [len(c) for c in grown] == [n + 1 for n in lengths]
    assert [len(c) for c in caches] == lengths  # inputs untouched


def test_bad_shapes(layer):
    with pytest.raises(ValueError, match=r"GatedMLA.forward expects x \[B, T, d\], got shape \(4, 128\)"):
        layer(torch.randn(4, 128))
    with pytest.raises(ValueError, match="packed sequences \\(cu_seqlens\\) need batch size 1, got 2"):
        layer(torch.randn(2, 4, 128), cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match=r"expects x \[B, d\] and B caches, got shape \(2, 128\) and 1 caches"):
        layer.decode(torch.randn(2, 128), [MLACache.empty(get_preset("tiny"))])
    with pytest.raises(ValueError, match=r"GatedMLA.prefill expects x \[T, d\] of one sequence"):
        layer.prefill(torch.randn(1, 3, 128), None)
