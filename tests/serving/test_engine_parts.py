"""The engine's building blocks: detokenisation with stop strings, pages, slots, hand-off chunks, block format."""

from __future__ import annotations

import pytest
import torch

from k3.model.presets import get_preset
from k3.model.state import SequenceState
from k3.model.tokenizer import ByteTokenizer
from k3.services.cache.hashing import BLOCK_TOKENS, chain_block_hashes
from k3.services.common.errors import InvalidArgument
from k3.services.engine.blocks import (
    BlockFormatError,
    assemble,
    decode_kda,
    decode_mla,
    encode_kda,
    encode_mla,
    prefix_key,
)
from k3.services.engine.detokenize import TextStream
from k3.services.engine.handoff import HandoffAssembler, handoff_chunks
from k3.services.engine.pages import PagedLatentCache
from k3.services.engine.slots import SlotPool

TOK = ByteTokenizer()
CFG = get_preset("tiny")


def ids(text: str) -> list[int]:
    return TOK.encode_text(text)


def stream_text(text_stream: TextStream, token_ids: list[int]) -> list[str]:
    return [text_stream.push(t) for t in token_ids]


def random_state(n: int, seed: int = 0) -> SequenceState:
    g = torch.Generator().manual_seed(seed)
    state = SequenceState.fresh(CFG)
    state.num_tokens = n
    for kda in state.kda.values():
        for name in ("conv_q", "conv_k", "conv_v", "recurrent"):
            getattr(kda, name).copy_(torch.randn(getattr(kda, name).shape, generator=g))
    for i in state.mla:
        state.mla[i].c_kv = torch.randn(n, CFG.kv_lora_rank, generator=g)
        state.mla[i].k_extra = torch.randn(n, CFG.qk_extra_dim, generator=g)
    return state


# -- detokenisation ----------------------------------------------------------------------------------------------
def test_multibyte_characters_are_released_whole():
    s = TextStream(TOK)
    assert stream_text(s, ids("é€")) == ["", "é", "", "", "€"]
    assert s.finish() == "" and s.text == "é€"


def test_incomplete_utf8_at_the_end_becomes_a_replacement_character():
    s = TextStream(TOK)
    assert stream_text(s, ids("a") + ids("é")[:1]) == ["a", ""]
    assert s.finish() == "\ufffd"


def test_stop_string_across_tokens_is_never_sent():
    s = TextStream(TOK, stop=("END",))
    deltas = stream_text(s, ids("abEN"))
    assert "".join(deltas) == "ab"  # "EN" might start "END": held back
    assert s.push(ids("D")[0]) == "" and s.stopped
    assert s.text == "ab" and s.push(ids("x")[0]) == "" and s.finish() == ""


def test_held_back_text_is_released_when_it_cannot_match():
    s = TextStream(TOK, stop=("END", "xyz"))
    assert "".join(stream_text(s, ids("aEN"))) == "a"
    assert s.push(ids("!")[0]) == "EN!"
    assert "".join(stream_text(s, ids("xy"))) == ""
    assert s.finish() == "xy" and s.text == "aEN!xy" and not s.stopped


def test_the_first_stop_string_to_complete_ends_the_text():
    s = TextStream(TOK, stop=("cd", "bcdef"))
    assert "".join(stream_text(s, ids("abcdef"))) == "ab"
    assert s.stopped and s.text == "ab"


def test_ids_beyond_the_tokenizer_read_as_replacement_characters():
    assert TextStream(TOK).push(300) == "\ufffd"


# -- pages and slots ---------------------------------------------------------------------------------------------
def test_pages_write_and_gather_across_page_boundaries():
    cache = PagedLatentCache(CFG, num_pages=8, page_size=4)
    table = cache.allocate(3)
    assert cache.free == 5 and cache.allocate(6) is None and cache.free == 5
    state = random_state(10)
    cache.write(table, 0, {i: c for i, c in state.mla.items()})
    got = cache.gather(table, 10)
    for i, c in state.mla.items():
        assert torch.equal(got[i].c_kv, c.c_kv) and torch.equal(got[i].k_extra, c.k_extra)
    more = random_state(11, seed=1)
    cache.write(table, 10, {i: c for i, c in more.mla.items()}, rows_from=10)  # append token 10
    for i in state.mla:
        assert torch.equal(cache.gather(table, 11)[i].c_kv[10], more.mla[i].c_kv[10])
    with pytest.raises(ValueError, match="do not fit"):
        cache.write(table, 12, {i: c for i, c in state.mla.items()})
    cache.release(table)
    assert cache.free == 8


def test_pages_share_one_pool_per_layer_and_build_block_tables():
    cache = PagedLatentCache(CFG, num_pages=8, page_size=4)
    table = cache.allocate(3)
    state = random_state(6)
    cache.write(table, 0, {i: c for i, c in state.mla.items()})
    for i, c in state.mla.items():  # c_kv and k_extra are the two parts of the pool decode reads
        rows = cache.kv[i][torch.tensor(table)].flatten(0, 1)[:6]
        assert torch.equal(rows, torch.cat([c.c_kv, c.k_extra], dim=-1))
    assert cache.page_bytes == len(cache.layers) * 4 * (CFG.kv_lora_rank + CFG.qk_extra_dim) * 4
    blocks = cache.block_table([table, table[:1]], num_tokens=7)  # 7 tokens need 2 pages; a short table pads
    assert blocks.dtype == torch.int32 and blocks.tolist() == [table[:2], [table[0], 0]]


def test_slots_are_zeroed_on_acquire_and_written_in_place():
    pool = SlotPool(CFG, 2)
    a = pool.acquire()
    state = random_state(3)
    pool.write(a, state.kda)
    view = pool.views(a)
    for i, kda in state.kda.items():
        assert torch.equal(view[i].recurrent, kda.recurrent)
    snapshot = pool.snapshot(a)
    b = pool.acquire()
    assert pool.acquire() is None and pool.free == 0
    pool.release(a)
    assert pool.acquire() == a
    assert all(float(v.recurrent.abs().sum()) == 0 for v in pool.views(a).values())
    assert all(torch.equal(snapshot[i].recurrent, kda.recurrent) for i, kda in state.kda.items())
    with pytest.raises(ValueError):
        pool.release(5)
    pool.release(b)
    with pytest.raises(ValueError):
        pool.release(b)


# -- hand-off chunks ---------------------------------------------------------------------------------------------
def test_handoff_chunks_stay_small_and_reassemble_exactly():
    state = random_state(700).to_bytes()
    logits = torch.randn(CFG.vocab_size)
    tokens = list(range(700))
    chunks = list(handoff_chunks("req", state, logits, tokens, cached_tokens=512, chunk_bytes=4096))
    assert len(chunks) > 10 and max(c.ByteSize() for c in chunks) <= 4096
    assembler = HandoffAssembler(max_state_bytes=len(state))
    for chunk in chunks:
        assembler.add(chunk)
    result = assembler.result(CFG.vocab_size)
    assert (result.request_id, result.state, result.token_ids, result.cached_tokens) == ("req", state, tokens, 512)
    assert torch.equal(result.last_logits, logits)


def test_handoff_assembler_refuses_oversized_and_inconsistent_streams():
    chunks = list(handoff_chunks("req", b"x" * 5000, torch.zeros(4), [1], chunk_bytes=4096))
    with pytest.raises(InvalidArgument) as info:
        HandoffAssembler(max_state_bytes=4999).add(chunks[0])
    assert (info.value.field, info.value.reason) == ("total_bytes", "BAD_STATE_SIZE")
    assembler = HandoffAssembler(max_state_bytes=10_000)
    assembler.add(chunks[0])
    chunks[1].request_id = "other"
    with pytest.raises(InvalidArgument) as info:
        assembler.add(chunks[1])
    assert info.value.field == "request_id"


# -- block format ------------------------------------------------------------------------------------------------
def test_prefix_keys_extend_the_chained_block_hashes():
    tokens = list(range(8, 8 + 1100))
    chain = chain_block_hashes(tokens)
    assert prefix_key(tokens, 512, chain) == chain[0] and prefix_key(tokens, 1024, chain) == chain[1]
    partial = prefix_key(tokens, 700, chain)
    assert partial not in chain
    assert partial == prefix_key(tokens[:700] + [5, 6, 7], 700, chain_block_hashes(tokens[:700] + [5, 6, 7]))
    assert partial != prefix_key(tokens[:699] + [9], 700, chain)


def test_blocks_roundtrip_and_refuse_other_models():
    n = BLOCK_TOKENS + 100
    state = random_state(n)
    key = bytes(32)
    kda = decode_kda(encode_kda(key, state), CFG, n)
    first = decode_mla(encode_mla(key, state, 0, BLOCK_TOKENS), CFG, 0, BLOCK_TOKENS)
    last = decode_mla(encode_mla(key, state, BLOCK_TOKENS, n), CFG, BLOCK_TOKENS, n)
    restored = assemble(CFG, n, kda, [first, last])
    for i in state.kda:
        assert torch.equal(restored.kda[i].recurrent, state.kda[i].recurrent)
    for i in state.mla:
        assert torch.equal(restored.mla[i].c_kv, state.mla[i].c_kv)
    assert encode_mla(key, state, BLOCK_TOKENS, n).metadata["partial"] == "true"
    with pytest.raises(BlockFormatError, match="after 612 tokens"):
        decode_kda(encode_kda(key, state), CFG, n - 1)
    other = get_preset("tiny")
    other.rms_eps = 1e-6
    with pytest.raises(BlockFormatError, match="config"):
        decode_kda(encode_kda(key, state), other, n)
    with pytest.raises(BlockFormatError, match="starts at token"):
        decode_mla(encode_mla(key, state, BLOCK_TOKENS, n), CFG, 0, n)
