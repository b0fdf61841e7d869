"""Paged absorbed MLA decode: Triton kernels (CPU interpreter) against the torch reference and the model layer."""

from __future__ import annotations

import pytest
import torch
from utils import TOLERANCE, assert_close, fresh_generator, poisoned_empty, rel_rms

from k3.kernels.mla.decode import MLAConfig, mla_decode, mla_decode_attention, plan_splits, resident_programs
from k3.kernels.mla.reference import mla_decode_attention_reference, mla_decode_reference

B, H, R, E, PAGE, MAX_PAGES, NUM_PAGES = 3, 4, 32, 16, 8, 6, 24


def _paged_problem(gen, dtype, Tq, lengths=(5, 37, 20), page=PAGE, heads=H):
    """Ragged lengths (one shorter than a page), pages scattered over the pool, unused table entries = -1."""
    seq_lens = torch.tensor(lengths)
    kv_cache = torch.randn(NUM_PAGES, page, R + E, generator=gen).to(dtype)
    block_table = torch.full((B, MAX_PAGES), -1, dtype=torch.int32)
    pages = torch.randperm(NUM_PAGES, generator=gen).int()
    used = 0
    for b, n in enumerate(lengths):
        count = -(-n // page)
        block_table[b, :count] = pages[used:used + count]
        used += count
    q_latent = torch.randn(B, Tq, heads, R, generator=gen).to(dtype)
    q_extra = torch.randn(B, Tq, heads, E, generator=gen).to(dtype)
    return q_latent, q_extra, kv_cache, block_table, seq_lens


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "dtype,Tq,page",
    [(torch.float32, 1, 8), (torch.bfloat16, 1, 16), (torch.float32, 3, 16), (torch.bfloat16, 4, 8)],
)
def test_attention_core_matches_reference(dtype, Tq, page):
    """page 8 < block_n 16: keys gathered one by one; page 16: one page-table read per tile."""
    q_latent, q_extra, kv_cache, block_table, seq_lens = _paged_problem(fresh_generator(), dtype, Tq, page=page)
    out = poisoned_empty(B, Tq, H, R, dtype=dtype)
    # 3 slices of 16 keys: slices start inside, at the end of and past a sequence
    o = mla_decode_attention(q_latent, q_extra, kv_cache, block_table, seq_lens, out=out,
                             config=MLAConfig(block_n=16, num_splits=3))
    assert o.data_ptr() == out.data_ptr()
    ref = mla_decode_attention_reference(q_latent.float(), q_extra.float(), kv_cache.float(), block_table, seq_lens)
    assert_close(o, ref, dtype)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "dtype,block_m,num_splits",
    [(torch.float32, None, None), (torch.bfloat16, None, None), (torch.float32, 32, 2), (torch.bfloat16, 64, 3)],
)
def test_speculative_verification_tq4(dtype, block_m, num_splits):
    """Tq = 4 draft tokens x 8 heads: 32 rows in two blocks of 16 (default), one block of 32, or one 64-row
    block half of whose rows are padding; long slices mix mask-free tiles with the masked tail, short ones put
    draft tokens in every place."""
    Tq, heads = 4, 8
    q_latent, q_extra, kv_cache, block_table, seq_lens = _paged_problem(
        fresh_generator(), dtype, Tq, lengths=(4, 45, 23), page=16, heads=heads)
    out = poisoned_empty(B, Tq, heads, R, dtype=dtype)
    config = MLAConfig(block_m=block_m, block_n=16, num_splits=num_splits)
    o = mla_decode_attention(q_latent, q_extra, kv_cache, block_table, seq_lens, out=out, config=config)
    ref = mla_decode_attention_reference(q_latent.float(), q_extra.float(), kv_cache.float(), block_table, seq_lens)
    assert_close(o, ref, dtype)
    # the first draft token of the 4-token sequence sees one key: its output is that key's latent
    assert_close(o[0, 0], kv_cache[block_table[0, 0], 0, :R].float().expand(heads, R), dtype, "single visible key")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_absorbed_path_tq4(dtype):
    """The whole absorbed path (absorptions, kernel, gate) for 4 draft tokens against the reference."""
    gen = fresh_generator()
    Tq, n, v = 4, 16, 8
    _, q_extra, kv_cache, block_table, seq_lens = _paged_problem(gen, dtype, Tq, lengths=(9, 40, 17), page=16)
    q_nope = torch.randn(B, Tq, H, n, generator=gen).to(dtype)
    w_kvb = (torch.randn(H * (n + v), R, generator=gen) * 0.2).to(dtype)
    gate = torch.randn(B, Tq, H * v, generator=gen).to(dtype)
    ours = mla_decode(q_nope, q_extra, kv_cache, block_table, seq_lens, w_kvb, gate, config=MLAConfig(block_n=16))
    ref = mla_decode_reference(q_nope.float(), q_extra.float(), kv_cache.float(), block_table, seq_lens,
                               w_kvb.float(), gate.float())
    assert ours.dtype == dtype
    assert_close(ours, ref, dtype)


@pytest.mark.timeout(120)
def test_many_slices_merge_into_one_output():
    """20 slices of 16 keys: the merge combines up to 19 partial states per row; slices past a sequence's end are
    empty (lse = -inf) and must weigh nothing."""
    gen = fresh_generator()
    lengths, page, max_pages = (300, 17, 161), 16, 20
    kv_cache = torch.randn(3 * max_pages, page, R + E, generator=gen)
    block_table = torch.randperm(3 * max_pages, generator=gen).int().view(3, max_pages)
    q_latent, q_extra = torch.randn(3, 2, H, R, generator=gen), torch.randn(3, 2, H, E, generator=gen)
    seq_lens = torch.tensor(lengths)
    out = poisoned_empty(3, 2, H, R, dtype=torch.float32)
    o = mla_decode_attention(q_latent, q_extra, kv_cache, block_table, seq_lens, out=out,
                             config=MLAConfig(block_n=16, num_splits=20))
    assert_close(o, mla_decode_attention_reference(q_latent, q_extra, kv_cache, block_table, seq_lens), torch.float32)


def test_causality_among_the_new_tokens():
    """With Tq = 2 the first new token must not see the second: changing the last cache row leaves it alone."""
    gen = fresh_generator()
    q_latent, q_extra, kv_cache, block_table, seq_lens = _paged_problem(gen, torch.float32, 2, lengths=(9, 9, 9))
    first = mla_decode_attention_reference(q_latent, q_extra, kv_cache, block_table, seq_lens)
    last_page, last_row = block_table[0, 8 // PAGE], 8 % PAGE
    kv_cache[last_page, last_row] += 5.0
    second = mla_decode_attention_reference(q_latent, q_extra, kv_cache, block_table, seq_lens)
    assert torch.equal(first[0, 0], second[0, 0])
    assert not torch.equal(first[0, 1], second[0, 1])


@pytest.mark.timeout(120)
def test_full_absorbed_path_matches_the_model_layer():
    """mla_decode (Triton core) + W_o reproduces GatedMLA.decode on caches copied into pages."""
    from k3.model.mla import GatedMLA, MLACache
    from k3.model.presets import get_preset

    gen = fresh_generator()
    cfg = get_preset("tiny")
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    layer = GatedMLA(cfg, layer_idx=3).eval()
    lengths = [5, 12]
    caches = [MLACache(torch.randn(n, cfg.kv_lora_rank, generator=gen), torch.randn(n, cfg.qk_extra_dim, generator=gen))
              for n in lengths]
    x = torch.randn(len(lengths), cfg.hidden_size, generator=gen)
    with torch.no_grad():
        y_model, grown = layer.decode(x, caches)
        page = 4
        kv_cache = torch.zeros(8, page, cfg.kv_lora_rank + cfg.qk_extra_dim)
        block_table = torch.tensor([[6, 1, -1, -1], [3, 0, 7, 2]], dtype=torch.int32)
        for b, cache in enumerate(grown):
            rows = torch.cat([cache.c_kv, cache.k_extra], dim=-1)
            for s in range(len(cache)):
                kv_cache[block_table[b, s // page], s % page] = rows[s]
        seq_lens = torch.tensor([len(c) for c in grown])
        q_nope, q_extra = layer.queries(x)
        gate_logits = layer.w_gate(x)[:, None]
        args = (q_nope[:, None], q_extra[:, None], kv_cache, block_table, seq_lens, layer.wkv_b.weight, gate_logits)
        ours = layer.wo(mla_decode(*args, config=MLAConfig(block_n=16))[:, 0])
        ref = layer.wo(mla_decode_reference(*args)[:, 0])
    assert rel_rms(ours, y_model) <= TOLERANCE[torch.float32]
    assert rel_rms(ref, y_model) <= TOLERANCE[torch.float32]


def test_split_plan_covers_the_key_range():
    for max_len, block_n, batch, splits in [(32768, 32, 8, None), (100, 16, 1, None), (48, 16, 3, 7), (1, 16, 2, None)]:
        n, length = plan_splits(batch, 1, max_len, block_n, torch.device("cpu"), splits)
        assert length % block_n == 0 and n >= 1
        assert (n - 1) * length < max_len <= n * length  # no empty trailing slice, nothing uncovered


def test_split_plan_fills_one_wave_without_spilling_into_a_second():
    sms = 4  # what the plan assumes off the GPU
    for batch, row_blocks, per_sm in [(1, 1, 1), (3, 1, 1), (2, 1, 2), (3, 1, 2), (1, 3, 2), (5, 1, 1)]:
        n, _ = plan_splits(batch, row_blocks, 32768, 64, torch.device("cpu"), per_sm=per_sm)
        programs = batch * row_blocks * n
        assert programs <= max(per_sm * sms, batch * row_blocks)  # never a partial second wave
        assert programs + batch * row_blocks > per_sm * sms  # one more slice would overflow the wave


def test_resident_programs_takes_the_tightest_of_shared_memory_registers_and_threads():
    # Triton 3.6's sm_90a builds of the split kernel (B = 8 x 32K cache, 16 heads): Tq = 4 fills an SM with
    # shared memory, Tq = 2 with registers (177 x 256 threads), Tq = 1 fits two.
    assert resident_programs(222208, 255, 8) == 1
    assert resident_programs(114688, 177, 8) == 1
    assert resident_programs(94208, 207, 4) == 2
    assert resident_programs(0, 32, 4) == 16  # 2048 threads
    assert resident_programs(300000, 255, 8) == 1  # never below one: the launch itself reports what does not fit


def test_rejects_bad_inputs():
    q_latent, q_extra, kv_cache, block_table, seq_lens = _paged_problem(fresh_generator(), torch.float32, 2)
    with pytest.raises(ValueError, match=r"seq_lens must lie in \[Tq=2, max_pages \* page_size = 48\]"):
        mla_decode_attention(q_latent, q_extra, kv_cache, block_table, torch.tensor([1, 5, 5]))
    with pytest.raises(ValueError, match=r"kv_cache must be \[num_pages, page_size, R \+ e = 48\]"):
        mla_decode_attention(q_latent, q_extra, kv_cache[..., :-1], block_table, seq_lens)
    bad_table = block_table.clone()
    bad_table[1, 0] = NUM_PAGES
    with pytest.raises(ValueError, match=r"block_table entries in use must lie in \[0, num_pages=24\)"):
        mla_decode_attention(q_latent, q_extra, kv_cache, bad_table, seq_lens)
    with pytest.raises(ValueError, match="must share one dtype"):
        mla_decode_attention(q_latent.bfloat16(), q_extra, kv_cache, block_table, seq_lens)
    with pytest.raises(ValueError, match=r"max_seq_len must be an int in \[1, 48\]"):
        mla_decode_attention(q_latent, q_extra, kv_cache, block_table, seq_lens, max_seq_len=49)
    with pytest.raises(ValueError, match="MLAConfig.block_n must be a power of two >= 16"):
        MLAConfig(block_n=8)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("Tq,block_n", [(1, 16), (4, 16), (4, 32)])
def test_tensor_descriptor_loads_match_reference(Tq, block_n):
    """MLAConfig(tma=True): the mask-free tiles come through tensor descriptors, the masked tail through
    pointers; a cache row past a sequence's end is poisoned, so a descriptor box that strayed into it shows."""
    heads = 8
    q_latent, q_extra, kv_cache, block_table, seq_lens = _paged_problem(
        fresh_generator(), torch.bfloat16, Tq, lengths=(7, 45, 33), page=32, heads=heads)
    last = block_table[0, 0]
    kv_cache[last, 7:] = float("nan")  # rows of sequence 0's only page after its 7 tokens
    out = poisoned_empty(B, Tq, heads, R, dtype=torch.bfloat16)
    config = MLAConfig(block_n=block_n, num_splits=2, tma=True)
    o = mla_decode_attention(q_latent, q_extra, kv_cache, block_table, seq_lens, out=out, config=config)
    ref = mla_decode_attention_reference(q_latent.float(), q_extra.float(), kv_cache.float(), block_table, seq_lens)
    assert_close(o, ref, torch.bfloat16)


def test_tensor_descriptor_loads_refused_where_the_layout_forbids_them():
    q_latent, q_extra, kv_cache, block_table, seq_lens = _paged_problem(fresh_generator(), torch.float32, 1)
    with pytest.raises(ValueError, match=r"tma=True\) needs a 16-bit cache"):
        mla_decode_attention(q_latent, q_extra, kv_cache, block_table, seq_lens, config=MLAConfig(tma=True))
    bf = (q_latent.bfloat16(), q_extra.bfloat16(), kv_cache.bfloat16())
    with pytest.raises(ValueError, match="page_size a multiple of block_n"):  # pages of 8 rows, tiles of 16
        mla_decode_attention(*bf, block_table, seq_lens, config=MLAConfig(block_n=16, tma=True))
    with pytest.raises(ValueError, match="MLAConfig.tma must be"):
        MLAConfig(tma=1)
