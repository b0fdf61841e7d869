"""Shared fixtures of the chat tests: a byte tokenizer and a small BPE trained once per session."""

from __future__ import annotations

import pytest

from k3.model.tokenizer import ByteTokenizer, default_corpus_files, train_tokenizer


@pytest.fixture(scope="session")
def byte_tok() -> ByteTokenizer:
    return ByteTokenizer()


@pytest.fixture(scope="session")
def bpe_tok(tmp_path_factory):
    # A few hundred KB of the standard library and a small vocabulary: trains in well under a second.
    out = tmp_path_factory.mktemp("bpe")
    return train_tokenizer(default_corpus_files()[:40], 1000, out, max_bytes=300_000)


@pytest.fixture(params=["byte", "bpe"])
def tok(request, byte_tok, bpe_tok):
    return byte_tok if request.param == "byte" else bpe_tok
