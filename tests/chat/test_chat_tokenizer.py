"""Tokenizers: fixed reserved ids, text never yields them, byte-exact decoding, JSON save/load, training, CLI."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from xtml_cases import RESERVED, texts

from k3.cli import main as cli_main
from k3.model.tokenizer import (
    NUM_SPECIAL,
    SPECIAL_TOKENS,
    K3Tokenizer,
    TokenizerError,
    default_corpus_files,
    load_tokenizer,
    train_tokenizer,
)

FIXED_IDS = {
    "<|pad|>": 0,
    "<|bos|>": 1,
    "<|eos|>": 2,
    "<|open|>": 3,
    "<|close|>": 4,
    "<|sep|>": 5,
    "<|end_of_msg|>": 6,
    "<|kimi_image_placeholder|>": 7,
}


def test_reserved_ids_are_fixed(tok):
    assert dict(zip(SPECIAL_TOKENS, range(NUM_SPECIAL), strict=True)) == FIXED_IDS
    for literal, i in FIXED_IDS.items():
        assert tok.special_id(literal) == i
        assert tok.special_id(literal[2:-2]) == i
        assert tok.special_name(i) == literal
        assert tok.is_special(i)
    assert tok.special_name(NUM_SPECIAL) is None
    with pytest.raises(TokenizerError, match="unknown special token 'image'"):
        tok.special_id("image")


def test_byte_tokenizer_layout(byte_tok):
    assert byte_tok.vocab_size == 264
    assert byte_tok.encode_text("A") == [ord("A") + 8]
    assert byte_tok.encode_text("é") == [0xC3 + 8, 0xA9 + 8]
    assert byte_tok.encode_text("") == []


@pytest.mark.parametrize("literal", RESERVED + ("<|pad|>", "<|bos|>", "<|eos|>"))
def test_reserved_literal_in_text_is_text(tok, literal):
    ids = tok.encode_text(f"a {literal} b")
    assert all(i >= NUM_SPECIAL for i in ids)
    assert tok.decode(ids) == f"a {literal} b"
    # Only the structure path emits the reserved id.
    structured = tok.encode_structure(f"a {literal} b")
    assert tok.special_id(literal) in structured
    assert tok.decode(structured) == f"a {literal} b"


@settings(max_examples=150, deadline=None)
@given(text=st.one_of(st.text(), texts()))
def test_encode_text_round_trip_without_reserved_ids(byte_tok, bpe_tok, text):
    for tok in (byte_tok, bpe_tok):
        ids = tok.encode_text(text)
        assert all(NUM_SPECIAL <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")


def test_encode_structure_splits_only_on_literals(tok):
    text = '<|open|>message role="user"<|sep|><|op <|sep<|close|>'
    ids = tok.encode_structure(text)
    assert [i for i in ids if i < NUM_SPECIAL] == [3, 5, 4]
    assert tok.decode(ids) == text


def test_bad_inputs(tok):
    with pytest.raises(TokenizerError, match="encode_text expects str, got bytes"):
        tok.encode_text(b"x")
    with pytest.raises(TokenizerError, match=rf"token id {tok.vocab_size} is out of range \[0, {tok.vocab_size}\)"):
        tok.decode([tok.vocab_size])
    with pytest.raises(TokenizerError, match="token id -1 is out of range"):
        tok.token_bytes(-1)


def test_save_load_json_only(tok, tmp_path):
    tok.save(tmp_path)
    meta = json.loads((tmp_path / "k3_tokenizer.json").read_text())
    assert meta["special_tokens"] == list(SPECIAL_TOKENS)
    assert meta["kind"] == tok.kind
    loaded = load_tokenizer(tmp_path)
    assert type(loaded) is type(tok)
    assert loaded.vocab_size == tok.vocab_size
    text = "déjà <|open|> vu\n\tdef f(x): return x"
    assert loaded.encode_text(text) == tok.encode_text(text)
    assert sorted(p.name for p in tmp_path.iterdir()) == (
        ["k3_tokenizer.json", "tokenizer.json"] if tok.kind == "bpe" else ["k3_tokenizer.json"]
    )


def test_load_errors(tmp_path, byte_tok):
    with pytest.raises(TokenizerError, match="no k3_tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "k3_tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not valid JSON"):
        load_tokenizer(tmp_path)
    meta = {"format": 1, "kind": "bpe", "special_tokens": list(SPECIAL_TOKENS)}
    (tmp_path / "k3_tokenizer.json").write_text(json.dumps(meta))
    with pytest.raises(TokenizerError, match="missing tokenizer.json"):
        load_tokenizer(tmp_path)
    meta["special_tokens"] = ["<|pad|>"]
    (tmp_path / "k3_tokenizer.json").write_text(json.dumps(meta))
    with pytest.raises(TokenizerError, match="special_tokens differ"):
        load_tokenizer(tmp_path)
    meta = {"format": 1, "kind": "wordpiece", "special_tokens": list(SPECIAL_TOKENS)}
    (tmp_path / "k3_tokenizer.json").write_text(json.dumps(meta))
    with pytest.raises(TokenizerError, match="kind is 'wordpiece', expected 'byte' or 'bpe'"):
        load_tokenizer(tmp_path)
    byte_tok.save(tmp_path)
    with pytest.raises(TokenizerError, match="kind is 'byte', not 'bpe'"):
        K3Tokenizer.load(tmp_path)


def test_bpe_trains_on_small_corpus(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat. " * 200 + "def function(argument): return argument\n" * 100)
    tok = train_tokenizer([corpus], 300, tmp_path / "tok")
    assert tok.vocab_size == 300
    ids = tok.encode_text("the cat sat on the mat.")
    assert len(ids) < len("the cat sat on the mat.") // 2  # merges were learned
    assert tok.decode(ids) == "the cat sat on the mat."
    again = train_tokenizer([corpus], 300)
    assert again.encode_text("def function(argument)") == tok.encode_text("def function(argument)")
    assert isinstance(load_tokenizer(tmp_path / "tok"), K3Tokenizer)


def test_bpe_training_errors(tmp_path):
    good = tmp_path / "a.txt"
    good.write_text("hello world")
    bad = tmp_path / "b.txt"
    bad.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(TokenizerError, match="vocab_size must be an integer >= 264, got 100"):
        train_tokenizer([good], 100)
    with pytest.raises(TokenizerError, match=r"training file .*b\.txt is not UTF-8 text"):
        train_tokenizer([good, bad], 300)
    with pytest.raises(TokenizerError, match=r"cannot read training file .*missing\.txt"):
        train_tokenizer([tmp_path / "missing.txt"], 300)
    with pytest.raises(TokenizerError, match="no training text read"):
        train_tokenizer([good], 300, max_bytes=3)


def test_default_corpus_is_sorted_stdlib_sources():
    files = default_corpus_files()
    assert len(files) > 100
    assert all(f.suffix in (".py", ".rst", ".txt") for f in files)
    assert not any("site-packages" in f.parts for f in files)
    assert files == default_corpus_files()


def test_cli_train_encode_decode(tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello world, hello tokens. " * 50)
    out = tmp_path / "tok"
    assert cli_main(["tokenizer", "train", "--out", str(out), "--vocab-size", "280", "--files", str(corpus),
                     "--quiet"]) == 0
    assert "BPE tokenizer, vocab 280" in capsys.readouterr().out

    assert cli_main(["tokenizer", "encode", "--tokenizer", str(out), "hello <|open|>"]) == 0
    ids = [int(x) for x in capsys.readouterr().out.split()]
    assert ids and min(ids) >= NUM_SPECIAL
    assert cli_main(["tokenizer", "encode", "--structure", "--tokenizer", str(out), "hello <|open|>"]) == 0
    assert capsys.readouterr().out.split()[-1] == "3"

    assert cli_main(["tokenizer", "decode", "--tokenizer", str(out), *map(str, ids), "3,5"]) == 0
    assert capsys.readouterr().out == "hello <|open|><|open|><|sep|>\n"

    assert cli_main(["tokenizer", "decode", "--tokenizer", str(out), "x1"]) == 2
    assert "'x1' is not an integer token id" in capsys.readouterr().err
    assert cli_main(["tokenizer", "encode", "--tokenizer", str(tmp_path), "hi"]) == 2
    assert "no k3_tokenizer.json" in capsys.readouterr().err
    assert cli_main(["tokenizer", "train", "--out", str(out), "--vocab-size", "10", "--files", str(corpus)]) == 2
    assert "vocab_size must be an integer >= 264" in capsys.readouterr().err
