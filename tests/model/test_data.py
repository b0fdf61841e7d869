"""Offline corpus, tokenisation cache, packing with cu_seqlens and the resumable window sampler."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from k3.model.config import K3Config
from k3.model.data import (
    IGNORE_INDEX,
    CorpusConfig,
    TokenStream,
    WindowSampler,
    eval_batches,
    list_documents,
    load_corpus,
    pack_windows,
)
from k3.model.tokenizer import ByteTokenizer


@pytest.fixture(autouse=True)
def _one_thread():
    """Toy shapes gain nothing from intra-op threads, and on a busy machine threads waiting for each other spin."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


EOS = ByteTokenizer().special_id("eos")


def _write_corpus(root: Path, count: int = 40) -> None:
    for i in range(count):
        sub = root / f"pkg{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"mod{i}.py").write_text(f"# module {i}\n" + f"value_{i} = {i} * 2\n" * (1 + i % 5), encoding="utf-8")
    (root / "notes.txt").write_text("plain text document\n", encoding="utf-8")
    (root / "image.png").write_bytes(b"\x89PNG not text")  # wrong suffix: ignored
    (root / "bad.py").write_bytes(b"\xff\xfe invalid utf-8")  # not UTF-8: skipped
    (root / "site-packages").mkdir()
    (root / "site-packages" / "third_party.py").write_text("x = 1\n", encoding="utf-8")


def _stream(doc_lengths: list[int]) -> TokenStream:
    offsets = np.concatenate([[0], np.cumsum(doc_lengths)]).astype(np.int64)
    tokens = np.arange(offsets[-1], dtype=np.int32) % 200 + 8
    return TokenStream(tokens, offsets)


def _doc_ids(stream: TokenStream) -> np.ndarray:
    return np.searchsorted(stream.offsets, np.arange(stream.num_tokens), side="right") - 1


# ---- corpus ----------------------------------------------------------------------------------------------------
def test_stdlib_corpus_is_deterministic_capped_and_split():
    cfg = CorpusConfig(max_bytes=400_000)
    docs = list_documents(cfg)
    assert [d.path for d in docs] == [d.path for d in list_documents(cfg)]
    assert sum(len(d.text.encode()) for d in docs) <= 400_000
    assert not any("site-packages" in d.path or "__pycache__" in d.path for d in docs)
    assert all(d.path.endswith((".py", ".txt", ".rst")) for d in docs)
    # The walk is hash-ordered, so even a small cap reaches many packages, not only the alphabetically first.
    assert len({d.path.split("/")[0] for d in docs}) > 5
    assert any(d.held_out for d in docs) and any(not d.held_out for d in docs)
    # The split depends on the path alone: a larger cap keeps every earlier file on the same side.
    bigger = {d.path: d.held_out for d in list_documents(CorpusConfig(max_bytes=800_000))}
    assert all(bigger[d.path] == d.held_out for d in docs if d.path in bigger)
    assert len(bigger) > len(docs)
    assert Path(sysconfig.get_paths()["stdlib"], docs[0].path).read_text(encoding="utf-8") == docs[0].text


def test_corpus_from_folder_skips_non_text_and_site_packages(tmp_path):
    _write_corpus(tmp_path)
    docs = list_documents(CorpusConfig(root=str(tmp_path), eval_fraction=0.2))
    paths = {d.path for d in docs}
    assert "notes.txt" in paths and "pkg0/mod0.py" in paths
    assert not paths & {"bad.py", "image.png", "site-packages/third_party.py"}
    assert len(paths) == 41


def test_corpus_config_rejects_bad_values(tmp_path):
    with pytest.raises(ValueError, match=r"CorpusConfig.max_bytes must be a positive integer, got 0"):
        CorpusConfig(max_bytes=0)
    with pytest.raises(ValueError, match=r"CorpusConfig.eval_fraction must be in \(0, 1\), got 1.5"):
        CorpusConfig(eval_fraction=1.5)
    with pytest.raises(ValueError, match=r"CorpusConfig.suffixes must be non-empty strings"):
        CorpusConfig(suffixes=())
    with pytest.raises(ValueError, match=r"is not a directory"):
        list_documents(CorpusConfig(root=str(tmp_path / "missing")))
    (tmp_path / "only.py").write_text("x = 1\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"too few files to form both a train and an eval split \(1 file"):
        list_documents(CorpusConfig(root=str(tmp_path)))


def test_tokenised_corpus_is_cached_and_keyed_by_content(tmp_path, monkeypatch):
    root, cache = tmp_path / "corpus", tmp_path / "cache"
    _write_corpus(root)
    cfg = CorpusConfig(root=str(root), eval_fraction=0.2)
    tok = ByteTokenizer()
    first = load_corpus(cfg, tok, cache)
    assert first.cache_path.is_file() and first.cache_path.parent == cache
    # Every document is its UTF-8 bytes followed by EOS, and the two splits partition the files.
    docs = list_documents(cfg)
    train_docs = [d for d in docs if not d.held_out]
    s = first.train
    assert s.num_documents == len(train_docs) and first.eval.num_documents == len(docs) - len(train_docs)
    for i in (0, len(train_docs) - 1):
        ids = s.tokens[s.offsets[i]:s.offsets[i + 1]].tolist()
        assert ids[-1] == EOS and tok.decode(ids[:-1]) == train_docs[i].text

    # A second load must come from the cache: tokenising again would fail here.
    def refuse(self, text):
        raise AssertionError("tokenised again although the cache matches")

    monkeypatch.setattr(ByteTokenizer, "encode_text", refuse)
    again = load_corpus(cfg, tok, cache)
    assert again.key == first.key
    assert np.array_equal(again.train.tokens, first.train.tokens)
    assert np.array_equal(again.eval.offsets, first.eval.offsets)
    monkeypatch.undo()

    (root / "pkg1" / "mod1.py").write_text("changed = True\n", encoding="utf-8")
    changed = load_corpus(cfg, tok, cache)
    assert changed.key != first.key and changed.cache_path != first.cache_path


# ---- packing ---------------------------------------------------------------------------------------------------
def test_packing_splits_windows_at_document_boundaries():
    stream = _stream([5, 3, 10, 4])  # documents start at 0, 5, 8, 18; 22 tokens
    batch = pack_windows(stream, [3, 10], seq_len=6)
    # Window 0 covers tokens 3..8: doc 0 (3,4), doc 1 (5,6,7), doc 2 (8). Window 1 covers 10..15 inside doc 2.
    assert batch.cu_seqlens.tolist() == [0, 2, 5, 6, 12]
    assert batch.cu_seqlens.dtype == torch.int32
    assert batch.input_ids.shape == (1, 12) and batch.targets.shape == (1, 12)
    assert batch.input_ids[0, :6].tolist() == stream.tokens[3:9].tolist()
    targets = batch.targets[0].tolist()
    # The token before each document start gets no target; the window's last token predicts its next one.
    assert targets[:6] == [stream.tokens[4], IGNORE_INDEX, stream.tokens[6], stream.tokens[7], IGNORE_INDEX,
                           stream.tokens[9]]
    assert targets[6:] == stream.tokens[11:17].tolist()
    assert batch.num_targets == 10


def test_window_ending_exactly_at_a_document_boundary_has_no_last_target():
    stream = _stream([4, 4, 4])
    batch = pack_windows(stream, [0], seq_len=4)
    assert batch.cu_seqlens.tolist() == [0, 4]
    assert batch.targets[0, -1].item() == IGNORE_INDEX
    assert batch.targets[0, :3].tolist() == stream.tokens[1:4].tolist()


def test_packing_invariants_on_random_windows():
    rng = np.random.default_rng(7)
    stream = _stream(rng.integers(1, 40, size=60).tolist())
    doc = _doc_ids(stream)
    seq_len = 32
    starts = rng.integers(0, stream.num_tokens - seq_len, size=12)
    batch = pack_windows(stream, starts, seq_len)
    positions = np.concatenate([np.arange(s, s + seq_len) for s in starts])
    cu = batch.cu_seqlens.tolist()
    assert cu[0] == 0 and cu[-1] == len(positions) and all(b > a for a, b in zip(cu, cu[1:], strict=False))
    for a, b in zip(cu, cu[1:], strict=False):
        assert len(set(doc[positions[a:b]])) == 1, "a segment mixes documents"
        assert a // seq_len == (b - 1) // seq_len, "a segment crosses a row"
    # A position has a target exactly when its next token belongs to the same document.
    targets = batch.targets[0].numpy()
    same_doc = doc[positions] == doc[positions + 1]
    assert np.array_equal(targets != IGNORE_INDEX, same_doc)
    assert np.array_equal(targets[same_doc], stream.tokens[positions + 1][same_doc])


def test_packed_documents_are_separate_sequences_for_the_model():
    cfg = K3Config(
        vocab_size=272, hidden_size=32, num_layers=2, mla_every=2, dense_intermediate_size=32, kda_heads=2,
        kda_head_dim=8, kda_gate_rank=8, mla_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_dim=8,
        qk_extra_dim=4, v_head_dim=8, num_experts=4, top_k=2, num_shared_experts=1, latent_size=16,
        expert_intermediate_size=16, max_seq_len=64,
    )
    torch.manual_seed(0)
    from k3.model.transformer import K3Model

    model = K3Model(cfg).eval()
    stream = _stream([7, 9, 20])
    batch = pack_windows(stream, [2], seq_len=12)  # doc 0 tail (5 tokens), doc 1 (7 of its 9 tokens)
    assert batch.cu_seqlens.tolist() == [0, 5, 12]
    with torch.no_grad():
        packed = model(batch.input_ids, batch.cu_seqlens)
        alone = model(batch.input_ids[:, 5:])
    torch.testing.assert_close(packed[:, 5:], alone, rtol=1e-5, atol=1e-5)


def test_pack_windows_rejects_windows_outside_the_stream():
    stream = _stream([5, 5])
    with pytest.raises(ValueError, match=r"window of 6 tokens \(\+1 target\) does not fit the stream of 10"):
        pack_windows(stream, [4], seq_len=6)
    with pytest.raises(ValueError, match=r"at least one start offset"):
        pack_windows(stream, [], seq_len=2)
    with pytest.raises(ValueError, match=r"offsets must rise strictly from 0 to len\(tokens\)"):
        TokenStream(np.zeros(4, dtype=np.int32), np.array([0, 2, 2, 4]))


# ---- sampler ---------------------------------------------------------------------------------------------------
def test_sampler_is_seeded_and_resumes_exactly():
    stream = _stream([50] * 20)
    a = WindowSampler(stream.num_tokens, seed=3)
    draws = [a.next_starts(4, 16) for _ in range(6)]
    b = WindowSampler(stream.num_tokens, seed=3)
    assert all(np.array_equal(x, b.next_starts(4, 16)) for x in draws)
    other = WindowSampler(stream.num_tokens, seed=4)
    assert not np.array_equal(draws[0], other.next_starts(4, 16))
    assert all(x.min() >= 0 and x.max() + 16 + 1 <= stream.num_tokens for x in draws)

    # Resume after 2 batches from a JSON round trip of the state: the same next batches.
    c = WindowSampler(stream.num_tokens, seed=3)
    c.next_starts(4, 16)
    c.next_starts(4, 16)
    state = json.loads(json.dumps(c.state_dict()))
    assert state == {"num_tokens": stream.num_tokens, "seed": 3, "position": 2}
    d = WindowSampler(stream.num_tokens, seed=999)
    d.load_state_dict(state)
    assert all(np.array_equal(draws[i], d.next_starts(4, 16)) for i in range(2, 6))
    batch1 = WindowSampler(stream.num_tokens, 5).next_batch(stream, 3, 8)
    batch2 = WindowSampler(stream.num_tokens, 5).next_batch(stream, 3, 8)
    assert torch.equal(batch1.input_ids, batch2.input_ids) and torch.equal(batch1.cu_seqlens, batch2.cu_seqlens)


def test_sampler_rejects_bad_use():
    sampler = WindowSampler(100, seed=0)
    with pytest.raises(ValueError, match=r"rows and seq_len must be positive, got rows=0, seq_len=8"):
        sampler.next_starts(0, 8)
    with pytest.raises(ValueError, match=r"seq_len 100 does not fit a stream of 100 tokens"):
        sampler.next_starts(1, 100)
    with pytest.raises(ValueError, match=r"sampler state is for a stream of 50 tokens, this corpus has 100"):
        sampler.load_state_dict({"num_tokens": 50, "seed": 0, "position": 0})
    with pytest.raises(ValueError, match=r"stream of a different length"):
        sampler.next_batch(_stream([10, 10]), 1, 4)


def test_eval_batches_are_fixed_and_cover_the_stream():
    stream = _stream([30] * 10)
    first = list(eval_batches(stream, seq_len=16, rows=2, num_batches=3))
    second = list(eval_batches(stream, seq_len=16, rows=2, num_batches=3))
    assert len(first) == 3 and all(b.input_ids.shape == (1, 32) for b in first)
    assert all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(first, second, strict=True))
    assert first[0].input_ids[0, 0].item() == stream.tokens[0]
    assert first[-1].input_ids[0, -1].item() == stream.tokens[stream.num_tokens - 2]
    with pytest.raises(ValueError, match=r"eval seq_len 300 does not fit the held-out stream of 300 tokens"):
        list(eval_batches(stream, seq_len=300, rows=1, num_batches=1))
