"""Pretraining data: an offline text corpus, tokenised once, sampled as packed fixed-length windows.

Design decisions:

- The corpus is text every Python installation carries: the standard library's sources and text docs
  (``sysconfig.get_paths()["stdlib"]``, minus ``site-packages``). It needs no network, is large enough for the
  small presets and is the same on every machine with the same Python. Any other directory of text files works
  through ``CorpusConfig.root``.
- One file is one document. Files are visited in the order of the SHA-256 of their relative path: deterministic,
  yet a byte cap then samples the whole library instead of its alphabetically first packages. Whether a file is
  held out for evaluation is decided by a second, independent hash of its path, so the split is stable when the
  cap changes and a document never straddles the split.
- Tokenising is done once and cached as a safetensors file (``tokens`` + document ``offsets`` per split) keyed by
  the corpus content hash and the tokenizer's saved files, so a different tokenizer or a changed library never
  reuses a stale cache.
- A batch is ``rows`` windows of ``seq_len`` tokens cut at random offsets of the token stream, packed into one
  ``[1, rows * seq_len]`` row. Every window is split at document boundaries into segments and ``cu_seqlens``
  lists all segment boundaries, so the model attends (and carries recurrent state) only within a document. A
  position whose next token starts another document has no target (``IGNORE_INDEX``).
- The sampler is counter based: the offsets of batch ``i`` come from a generator seeded with ``(seed, i)``.
  Its whole state is two integers, so a resumed run draws exactly the batches the uninterrupted run would have,
  whatever ``seq_len``/``rows`` the current context stage asks for.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from safetensors.numpy import load_file, save_file

IGNORE_INDEX = -100
"""Target id of positions that must not contribute to the loss (``F.cross_entropy``'s default ignore index)."""

CACHE_FORMAT = 1
"""Bumped whenever the cache layout or the document encoding changes, so old caches are rebuilt."""

_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


class TextTokenizer(Protocol):
    """What the data pipeline needs from a tokenizer (``ByteTokenizer`` and the BPE ``K3Tokenizer`` both fit)."""

    vocab_size: int

    def encode_text(self, text: str) -> list[int]: ...

    def special_id(self, name: str) -> int: ...

    def save(self, directory: str | os.PathLike) -> Any: ...


@dataclass(frozen=True)
class CorpusConfig:
    """Which text files form the corpus and how it is split."""

    root: str | None = None
    """Directory searched recursively for text files; ``None`` means this interpreter's standard library."""
    max_bytes: int = 16_000_000
    """Cap on the total size of the selected files (train and eval together), in bytes of UTF-8 text."""
    eval_fraction: float = 0.05
    """Fraction of files (chosen by a hash of their relative path) held out for evaluation."""
    suffixes: tuple[str, ...] = (".py", ".txt", ".rst")
    """File name endings that count as text documents."""

    def __post_init__(self) -> None:
        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int) or self.max_bytes <= 0:
            raise ValueError(f"CorpusConfig.max_bytes must be a positive integer, got {self.max_bytes!r}")
        if not isinstance(self.eval_fraction, (int, float)) or not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"CorpusConfig.eval_fraction must be in (0, 1), got {self.eval_fraction!r}")
        if not self.suffixes or not all(isinstance(s, str) and s for s in self.suffixes):
            raise ValueError(f"CorpusConfig.suffixes must be non-empty strings, got {self.suffixes!r}")

    def resolved_root(self) -> Path:
        root = Path(self.root) if self.root is not None else Path(sysconfig.get_paths()["stdlib"])
        if not root.is_dir():
            raise ValueError(f"CorpusConfig.root {str(root)!r} is not a directory")
        return root.resolve()


@dataclass(frozen=True)
class Document:
    """One corpus file: its path relative to the corpus root, its text and whether it is held out."""

    path: str
    text: str
    held_out: bool


def _hash_fraction(tag: bytes, relpath: str) -> float:
    digest = hashlib.sha256(tag + relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def list_documents(config: CorpusConfig) -> list[Document]:
    """The selected documents in their deterministic order (see the module docstring)."""
    root = config.resolved_root()
    candidates: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place stops os.walk from descending; sorting makes the walk itself deterministic.
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(config.suffixes):
                full = Path(dirpath) / name
                candidates.append((full.relative_to(root).as_posix(), full))
    candidates.sort(key=lambda item: (_hash_fraction(b"order:", item[0]), item[0]))

    documents: list[Document] = []
    total = 0
    for relpath, full in candidates:
        if full.is_symlink() or not full.is_file():
            continue
        size = full.stat().st_size
        if size == 0 or total + size > config.max_bytes:
            continue
        try:
            text = full.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            # Some library test fixtures are deliberately malformed; they are not text documents.
            continue
        total += size
        held_out = _hash_fraction(b"eval:", relpath) < config.eval_fraction
        documents.append(Document(relpath, text, held_out))
    if not any(not d.held_out for d in documents) or not any(d.held_out for d in documents):
        raise ValueError(
            f"corpus under {str(root)!r} with max_bytes={config.max_bytes} has too few files to form both a "
            f"train and an eval split ({len(documents)} file(s) selected)"
        )
    return documents


def corpus_hash(documents: list[Document]) -> str:
    """SHA-256 over every document's path, split and content: changes whenever any of them changes."""
    h = hashlib.sha256()
    for doc in documents:
        h.update(doc.path.encode("utf-8") + b"\0" + (b"E" if doc.held_out else b"T"))
        h.update(hashlib.sha256(doc.text.encode("utf-8")).digest())
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer: TextTokenizer) -> str:
    """SHA-256 of the files ``tokenizer.save`` writes: two tokenizers that save alike encode alike."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save(tmp)
        for path in sorted(Path(tmp).rglob("*")):
            if path.is_file():
                h.update(path.relative_to(tmp).as_posix().encode() + b"\0")
                h.update(path.read_bytes())
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TokenStream:
    """All documents of one split, concatenated: ``tokens[offsets[i]:offsets[i+1]]`` is document ``i``."""

    tokens: np.ndarray
    offsets: np.ndarray

    def __post_init__(self) -> None:
        if self.tokens.ndim != 1 or self.offsets.ndim != 1 or len(self.offsets) < 2:
            raise ValueError("TokenStream needs 1-D tokens and at least two offsets")
        if self.offsets[0] != 0 or self.offsets[-1] != len(self.tokens) or np.any(np.diff(self.offsets) <= 0):
            raise ValueError("TokenStream.offsets must rise strictly from 0 to len(tokens)")

    @property
    def num_tokens(self) -> int:
        return int(len(self.tokens))

    @property
    def num_documents(self) -> int:
        return int(len(self.offsets) - 1)


@dataclass(frozen=True)
class TokenizedCorpus:
    """The train and eval streams plus the cache key they were built under."""

    train: TokenStream
    eval: TokenStream
    key: str
    cache_path: Path


def _encode_documents(docs: list[Document], tokenizer: TextTokenizer) -> TokenStream:
    pieces: list[np.ndarray] = []
    offsets = [0]
    eos = tokenizer.special_id("eos")
    for doc in docs:
        # Every document ends in EOS so the model learns where a text stops; packing never predicts across it.
        ids = np.asarray([*tokenizer.encode_text(doc.text), eos], dtype=np.int64)
        pieces.append(ids)
        offsets.append(offsets[-1] + len(ids))
    tokens = np.concatenate(pieces)
    if tokens.min() < 0 or tokens.max() >= tokenizer.vocab_size:
        raise ValueError("tokenizer produced ids outside [0, vocab_size)")
    return TokenStream(tokens.astype(np.int32), np.asarray(offsets, dtype=np.int64))


def load_corpus(config: CorpusConfig, tokenizer: TextTokenizer, cache_dir: str | os.PathLike) -> TokenizedCorpus:
    """Tokenise the corpus (or load it from ``cache_dir`` when the same corpus and tokenizer were seen before)."""
    documents = list_documents(config)
    key_src = f"{CACHE_FORMAT}:{corpus_hash(documents)}:{tokenizer_fingerprint(tokenizer)}"
    key = hashlib.sha256(key_src.encode()).hexdigest()[:20]
    cache_dir = Path(cache_dir)
    path = cache_dir / f"corpus-{key}.safetensors"
    if path.is_file():
        arrays = load_file(str(path))
        return TokenizedCorpus(
            TokenStream(arrays["train_tokens"], arrays["train_offsets"]),
            TokenStream(arrays["eval_tokens"], arrays["eval_offsets"]),
            key,
            path,
        )
    train = _encode_documents([d for d in documents if not d.held_out], tokenizer)
    held = _encode_documents([d for d in documents if d.held_out], tokenizer)
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Write-then-rename: a crash mid-write never leaves a truncated cache that a later run would trust.
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    save_file(
        {
            "train_tokens": train.tokens, "train_offsets": train.offsets,
            "eval_tokens": held.tokens, "eval_offsets": held.offsets,
        },
        str(tmp),
        metadata={"key": key, "train_documents": str(train.num_documents), "eval_documents": str(held.num_documents)},
    )
    os.replace(tmp, path)
    return TokenizedCorpus(train, held, key, path)


# ----------------------------------------------------------------------------------------------------------------
@dataclass
class PackedBatch:
    """``rows`` windows packed into one row; ``cu_seqlens`` marks every document segment inside it."""

    input_ids: torch.Tensor
    """``[1, rows * seq_len]`` int64 token ids."""
    targets: torch.Tensor
    """``[1, rows * seq_len]`` int64 next-token ids, ``IGNORE_INDEX`` where the next token is another document's."""
    cu_seqlens: torch.Tensor
    """``[segments + 1]`` int32 cumulative segment lengths, from 0 to ``rows * seq_len``."""
    rows: int
    seq_len: int

    @property
    def num_targets(self) -> int:
        return int((self.targets != IGNORE_INDEX).sum())


def pack_windows(stream: TokenStream, starts: np.ndarray | list[int], seq_len: int) -> PackedBatch:
    """Cut ``seq_len + 1`` tokens at each start (inputs and shifted targets) and pack them with ``cu_seqlens``."""
    starts = np.asarray(starts, dtype=np.int64)
    if starts.ndim != 1 or len(starts) == 0:
        raise ValueError("pack_windows needs at least one start offset")
    if np.any(starts < 0) or np.any(starts + seq_len + 1 > stream.num_tokens):
        raise ValueError(f"window of {seq_len} tokens (+1 target) does not fit the stream of {stream.num_tokens}")
    inputs = np.empty((len(starts), seq_len), dtype=np.int64)
    targets = np.empty((len(starts), seq_len), dtype=np.int64)
    cu = [0]
    for row, start in enumerate(starts.tolist()):
        end = start + seq_len
        inputs[row] = stream.tokens[start:end]
        targets[row] = stream.tokens[start + 1:end + 1]
        # Document starts strictly inside the window split it into segments.
        inner = stream.offsets[(stream.offsets > start) & (stream.offsets < end)] - start
        targets[row, inner - 1] = IGNORE_INDEX  # the token before a document start must not predict it
        if end < stream.num_tokens and np.any(stream.offsets == end):
            targets[row, -1] = IGNORE_INDEX  # the window ends exactly at a document boundary
        base = row * seq_len
        cu.extend((base + inner).tolist())
        cu.append(base + seq_len)
    return PackedBatch(
        input_ids=torch.from_numpy(inputs.reshape(1, -1)),
        targets=torch.from_numpy(targets.reshape(1, -1)),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        rows=len(starts),
        seq_len=seq_len,
    )


class WindowSampler:
    """Seeded, resumable source of window offsets: batch ``i`` is a pure function of ``(seed, i)``."""

    def __init__(self, num_tokens: int, seed: int, position: int = 0) -> None:
        if num_tokens < 2:
            raise ValueError(f"WindowSampler needs a stream of at least 2 tokens, got {num_tokens}")
        self.num_tokens = int(num_tokens)
        self.seed = int(seed)
        self.position = int(position)

    def next_starts(self, rows: int, seq_len: int) -> np.ndarray:
        """Start offsets of the next batch (``rows`` windows of ``seq_len`` tokens plus one target each)."""
        if rows <= 0 or seq_len <= 0:
            raise ValueError(f"rows and seq_len must be positive, got rows={rows}, seq_len={seq_len}")
        if seq_len + 1 > self.num_tokens:
            raise ValueError(f"seq_len {seq_len} does not fit a stream of {self.num_tokens} tokens")
        rng = np.random.Generator(np.random.PCG64([self.seed, self.position]))
        self.position += 1
        return rng.integers(0, self.num_tokens - seq_len, size=rows, dtype=np.int64)

    def next_batch(self, stream: TokenStream, rows: int, seq_len: int) -> PackedBatch:
        if stream.num_tokens != self.num_tokens:
            raise ValueError("WindowSampler used with a stream of a different length than it was built for")
        return pack_windows(stream, self.next_starts(rows, seq_len), seq_len)

    def state_dict(self) -> dict[str, int]:
        return {"num_tokens": self.num_tokens, "seed": self.seed, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if int(state["num_tokens"]) != self.num_tokens:
            raise ValueError(
                f"sampler state is for a stream of {state['num_tokens']} tokens, this corpus has {self.num_tokens}"
            )
        self.seed = int(state["seed"])
        self.position = int(state["position"])


def eval_batches(stream: TokenStream, seq_len: int, rows: int, num_batches: int) -> Iterator[PackedBatch]:
    """Fixed evaluation batches: windows spread evenly over the held-out stream, the same at every eval."""
    if seq_len + 1 > stream.num_tokens:
        raise ValueError(f"eval seq_len {seq_len} does not fit the held-out stream of {stream.num_tokens} tokens")
    count = rows * num_batches
    starts = np.linspace(0, stream.num_tokens - seq_len - 1, num=count).astype(np.int64)
    for i in range(num_batches):
        yield pack_windows(stream, starts[i * rows:(i + 1) * rows], seq_len)
