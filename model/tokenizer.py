"""Tokenizers for K3: a byte-level BPE (``K3Tokenizer``) and a plain byte tokenizer (``ByteTokenizer``).

Design decisions:

* **Reserved ids are fixed and low.** Every tokenizer puts the same eight special tokens at ids 0..7
  (``SPECIAL_TOKENS``): ``<|pad|>`` 0, ``<|bos|>`` 1, ``<|eos|>`` 2, ``<|open|>`` 3, ``<|close|>`` 4,
  ``<|sep|>`` 5, ``<|end_of_msg|>`` 6, ``<|kimi_image_placeholder|>`` 7. Ordinary tokens start at id 8, so a
  model trained with the byte tokenizer and one trained with a BPE agree on what the structural ids mean.
* **Text can never produce a reserved id.** ``encode_text`` treats its input as data: the characters
  ``<|open|>`` inside a user message or a tool result are encoded as ordinary pieces. For the BPE this is the
  ``tokenizers`` library's ``encode_special_tokens`` switch (added-token matching off), and the result is
  checked besides; the byte tokenizer has no way to produce them at all. Reserved ids come only from
  ``encode_structure`` (trusted structural text) or from the XTML renderer, which emits them directly.
* **Decoding is ours, byte-exact.** Every id maps to a byte string (special ids to their literal text) and
  ``decode`` joins the bytes and decodes UTF-8 once, so ``decode(encode_text(s)) == s`` for any ``s`` and a
  streaming consumer can use ``token_bytes`` with an incremental UTF-8 decoder.
* **Saved as JSON only.** ``save(dir)`` writes ``k3_tokenizer.json`` (kind and reserved ids) and, for the BPE,
  the library's own ``tokenizer.json``; ``load_tokenizer(dir)`` picks the class from the former. No pickle.
* **Default training corpus is local.** ``train_tokenizer`` with no files reads the Python standard library's
  own ``.py``, ``.rst`` and ``.txt`` files (sorted by relative path, ``site-packages``/``dist-packages``
  excluded, files that are not UTF-8 skipped), stopping before ``DEFAULT_MAX_BYTES`` (8 MB) in total; on one
  core a 32k vocabulary trains from that in well under a minute.
"""

from __future__ import annotations

import json
import os
import sysconfig
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

# Order is the id: SPECIAL_TOKENS[i] has id i in every K3 tokenizer.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|pad|>",
    "<|bos|>",
    "<|eos|>",
    "<|open|>",
    "<|close|>",
    "<|sep|>",
    "<|end_of_msg|>",
    "<|kimi_image_placeholder|>",
)
NUM_SPECIAL = len(SPECIAL_TOKENS)
SPECIAL_IDS: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}

META_FILE = "k3_tokenizer.json"
BPE_FILE = "tokenizer.json"
FORMAT_VERSION = 1

DEFAULT_VOCAB_SIZE = 32768
DEFAULT_MAX_BYTES = 8_000_000
DEFAULT_SUFFIXES = (".py", ".rst", ".txt")


class TokenizerError(ValueError):
    """Invalid tokenizer input, file or configuration."""


def special_literal(name: str) -> str:
    """``"open"`` or ``"<|open|>"`` -> ``"<|open|>"``; raises ``TokenizerError`` for unknown names."""
    literal = name if name.startswith("<|") else f"<|{name}|>"
    if literal not in SPECIAL_IDS:
        known = ", ".join(SPECIAL_TOKENS)
        raise TokenizerError(f"unknown special token {name!r}; known: {known}")
    return literal


class _Base(ABC):
    """What both tokenizers share: the reserved ids, structure encoding and byte-exact decoding."""

    kind = ""

    # Subclasses fill this with one byte string per id (special ids hold their literal text).
    _id_bytes: list[bytes]

    @property
    def vocab_size(self) -> int:
        return len(self._id_bytes)

    def special_id(self, name: str) -> int:
        """The id of a reserved token, by ``"open"`` or ``"<|open|>"``."""
        return SPECIAL_IDS[special_literal(name)]

    def is_special(self, token_id: int) -> bool:
        return 0 <= token_id < NUM_SPECIAL

    def special_name(self, token_id: int) -> str | None:
        """The literal (``"<|sep|>"``) of a reserved id, or None for an ordinary token."""
        return SPECIAL_TOKENS[token_id] if 0 <= token_id < NUM_SPECIAL else None

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes an ordinary id stands for (a reserved id gives its literal text)."""
        if not isinstance(token_id, int) or isinstance(token_id, bool) or not 0 <= token_id < self.vocab_size:
            raise TokenizerError(f"token id {token_id!r} is out of range [0, {self.vocab_size})")
        return self._id_bytes[token_id]

    @abstractmethod
    def encode_text(self, text: str) -> list[int]:
        """Ordinary text -> ids; never yields a reserved id."""

    def encode_structure(self, text: str) -> list[int]:
        """Encode trusted structural text: reserved-token literals become reserved ids, the rest is text.

        Only for text the program wrote itself (templates, the renderer's own markup); never for user data.
        """
        ids: list[int] = []
        pos = 0
        while pos < len(text):
            start = text.find("<|", pos)
            while start != -1 and not any(text.startswith(lit, start) for lit in SPECIAL_TOKENS):
                start = text.find("<|", start + 1)
            if start == -1:
                ids.extend(self.encode_text(text[pos:]))
                break
            ids.extend(self.encode_text(text[pos:start]))
            literal = next(lit for lit in SPECIAL_TOKENS if text.startswith(lit, start))
            ids.append(SPECIAL_IDS[literal])
            pos = start + len(literal)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Exact text of ``ids``: reserved ids as their literals, ordinary ids as UTF-8 bytes."""
        return b"".join(self.token_bytes(int(i)) for i in ids).decode("utf-8", errors="replace")

    def _meta(self) -> dict[str, Any]:
        return {"format": FORMAT_VERSION, "kind": self.kind, "special_tokens": list(SPECIAL_TOKENS)}

    def _write_meta(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / META_FILE).write_text(json.dumps(self._meta(), indent=2) + "\n", encoding="utf-8")


class ByteTokenizer(_Base):
    """One token per UTF-8 byte (ids 8..263) plus the reserved ids 0..7: for tiny models and tests."""

    kind = "byte"

    def __init__(self) -> None:
        self._id_bytes = [lit.encode() for lit in SPECIAL_TOKENS] + [bytes([b]) for b in range(256)]

    def encode_text(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TokenizerError(f"encode_text expects str, got {type(text).__name__}")
        return [b + NUM_SPECIAL for b in text.encode("utf-8")]

    def save(self, directory: str | Path) -> None:
        self._write_meta(Path(directory))

    @classmethod
    def load(cls, directory: str | Path) -> ByteTokenizer:
        meta = _read_meta(Path(directory))
        if meta["kind"] != cls.kind:
            raise TokenizerError(f"{directory}: tokenizer kind is {meta['kind']!r}, not {cls.kind!r}")
        return cls()


def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE convention: every byte is shown as one printable character.

    Printable Latin-1 bytes stand for themselves; the remaining 68 bytes (controls, space, a few others) are
    shifted to code points 256 and up in byte order. Returns character -> byte.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


class K3Tokenizer(_Base):
    """A byte-level BPE (``tokenizers`` library) with the K3 reserved ids; see the module docstring."""

    kind = "bpe"

    def __init__(self, tokenizer: Any) -> None:
        for i, literal in enumerate(SPECIAL_TOKENS):
            got = tokenizer.token_to_id(literal)
            if got != i:
                raise TokenizerError(f"BPE tokenizer has {literal} at id {got}, expected {i}")
        # Added-token matching off: text is data (the reserved literals in it are plain characters).
        tokenizer.encode_special_tokens = True
        self._tok = tokenizer
        alphabet = _byte_level_alphabet()
        id_bytes: list[bytes] = []
        for i in range(tokenizer.get_vocab_size()):
            if i < NUM_SPECIAL:
                id_bytes.append(SPECIAL_TOKENS[i].encode())
                continue
            piece = tokenizer.id_to_token(i)
            try:
                id_bytes.append(bytes(alphabet[ch] for ch in piece))
            except (KeyError, TypeError) as exc:
                raise TokenizerError(f"BPE token {i} ({piece!r}) is not a byte-level token") from exc
        self._id_bytes = id_bytes

    def encode_text(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TokenizerError(f"encode_text expects str, got {type(text).__name__}")
        if not text:
            return []
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if min(ids) < NUM_SPECIAL:
            # The byte-level pre-tokeniser splits "<|", letters and "|>" apart, so no merge can rebuild a
            # reserved literal; this guards the invariant against a hand-edited tokenizer.json.
            raise TokenizerError("BPE model produced a reserved id from ordinary text: invalid vocabulary")
        return ids

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        self._write_meta(directory)
        self._tok.save(str(directory / BPE_FILE))

    @classmethod
    def load(cls, directory: str | Path) -> K3Tokenizer:
        from tokenizers import Tokenizer

        directory = Path(directory)
        meta = _read_meta(directory)
        if meta["kind"] != cls.kind:
            raise TokenizerError(f"{directory}: tokenizer kind is {meta['kind']!r}, not {cls.kind!r}")
        path = directory / BPE_FILE
        if not path.is_file():
            raise TokenizerError(f"{directory}: missing {BPE_FILE}")
        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as exc:  # the library raises its own exception type for malformed files
            if isinstance(exc, TokenizerError):
                raise
            raise TokenizerError(f"{path}: cannot load BPE tokenizer: {exc}") from exc


AnyTokenizer = ByteTokenizer | K3Tokenizer


def _read_meta(directory: Path) -> dict[str, Any]:
    path = directory / META_FILE
    if not path.is_file():
        raise TokenizerError(f"{directory}: no {META_FILE} (not a saved K3 tokenizer)")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(meta, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    if meta.get("format") != FORMAT_VERSION:
        raise TokenizerError(f"{path}: format is {meta.get('format')!r}, this k3 reads {FORMAT_VERSION}")
    if meta.get("special_tokens") != list(SPECIAL_TOKENS):
        raise TokenizerError(f"{path}: special_tokens differ from the K3 reserved tokens {SPECIAL_TOKENS}")
    if meta.get("kind") not in ("byte", "bpe"):
        raise TokenizerError(f"{path}: kind is {meta.get('kind')!r}, expected 'byte' or 'bpe'")
    return meta


def load_tokenizer(directory: str | Path) -> AnyTokenizer:
    """Load a tokenizer saved by ``save``, choosing the class from ``k3_tokenizer.json``."""
    meta = _read_meta(Path(directory))
    cls = ByteTokenizer if meta["kind"] == "byte" else K3Tokenizer
    return cls.load(directory)


def default_corpus_files(suffixes: Sequence[str] = DEFAULT_SUFFIXES) -> list[Path]:
    """The standard library's own sources and docs, sorted by path relative to the stdlib root."""
    root = Path(sysconfig.get_paths()["stdlib"])
    excluded = {"site-packages", "dist-packages", "__pycache__"}
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune third-party and cache folders instead of walking them (they can dwarf the stdlib).
        dirnames[:] = [d for d in dirnames if d not in excluded]
        for name in filenames:
            if os.path.splitext(name)[1] in suffixes:
                path = Path(dirpath, name)
                found.append((path.relative_to(root).as_posix(), path))
    return [path for _, path in sorted(found)]


def read_corpus(
    files: Sequence[str | Path], max_bytes: int, *, skip_undecodable: bool
) -> tuple[list[str], int]:
    """Read files in the given order until adding the next would pass ``max_bytes``.

    Returns the texts and their total size in bytes. A file that is not UTF-8 is skipped when
    ``skip_undecodable`` (the default corpus), else it is an error naming the file.
    """
    texts: list[str] = []
    total = 0
    for f in files:
        path = Path(f)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise TokenizerError(f"cannot read training file {path}: {exc.strerror}") from exc
        if total + len(data) > max_bytes:
            break
        try:
            texts.append(data.decode("utf-8"))
        except UnicodeDecodeError as exc:
            if skip_undecodable:
                continue
            raise TokenizerError(f"training file {path} is not UTF-8 text") from exc
        total += len(data)
    return texts, total


def train_tokenizer(
    files: Sequence[str | Path] | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    out_path: str | Path | None = None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    show_progress: bool = False,
    log: Callable[[str], None] | None = None,
) -> K3Tokenizer:
    """Train a byte-level BPE with the K3 reserved ids at 0..7 and save it to ``out_path`` if given.

    ``files`` default to ``default_corpus_files()``; at most ``max_bytes`` of them are read (in order).
    ``vocab_size`` counts the reserved ids and the 256 byte tokens, so it must be at least 264.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not isinstance(vocab_size, int) or vocab_size < NUM_SPECIAL + 256:
        raise TokenizerError(f"vocab_size must be an integer >= {NUM_SPECIAL + 256}, got {vocab_size!r}")
    if max_bytes <= 0:
        raise TokenizerError(f"max_bytes must be positive, got {max_bytes}")
    default = files is None
    paths = default_corpus_files() if default else list(files)
    if not paths:
        raise TokenizerError("no training files given")
    texts, total = read_corpus(paths, max_bytes, skip_undecodable=default)
    if not texts:
        raise TokenizerError(f"no training text read (first file is larger than max_bytes={max_bytes}?)")
    if log:
        log(f"training BPE on {len(texts)} files, {total} bytes, vocab {vocab_size}")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer, length=len(texts))
    result = K3Tokenizer(tok)
    if out_path is not None:
        result.save(out_path)
        if log:
            log(f"saved {result.vocab_size}-token BPE to {out_path}")
    return result
